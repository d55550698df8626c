"""What workers print, shown in the cell: the kernel's side of the forwarded streams.

Workers send text as it is written (:class:`~.worker.ForwardedStream`); here it
goes to the cell's stdout or stderr, either as it came (one rank's output,
progress bars included) or line by line with a ``[rank N]`` prefix, each
rank's partial line kept until it is complete.

In a notebook::

    output = RankOutput(prefix=True)
    output.write(1, "stdout", "epoch 1\\n")     # [rank 1] epoch 1
    output.flush()
"""
from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["RankOutput"]

_LINE_ENDS = re.compile(r"(\r\n|\n|\r(?!\n))")


class RankOutput:
    """Writes ranks' output to ``sys.stdout``/``sys.stderr``; ``prefix`` adds ``[rank N]`` to each line.

    ``before_write()`` runs before anything is written (to clear a terminal status line, say).
    """

    def __init__(self, prefix: bool, before_write: Callable[[], None] | None = None):
        self.prefix = prefix
        self.before_write = before_write
        self._partial: dict[tuple[int, str], str] = {}
        self._shown: dict[tuple[int, str], str] = {}

    def write(self, rank: int, stream: str, text: str) -> None:
        if self.before_write is not None:
            self.before_write()
        target = sys.stderr if stream == "stderr" else sys.stdout
        if not self.prefix:
            target.write(text)
            return
        key = (rank, stream)
        buffered = self._partial.pop(key, "") + text
        held = ""
        if buffered.endswith("\r"):   # maybe half of a "\r\n" split over two writes
            buffered, held = buffered[:-1], "\r"
        pieces = _LINE_ENDS.split(buffered)
        rest, ended = pieces[-1], pieces[:-1]
        out = []
        shown = self._shown.pop(key, None)   # the unfinished redraw already on screen
        for line, end in zip(ended[0::2], ended[1::2]):
            if end == "\r":
                # A progress bar (tqdm) redraws its line after "\r": each redraw shows now,
                # prefixed, and the next one replaces it, as in a plain cell.
                if line and line != shown:
                    out.append(f"[rank {rank}] {line}\r")
            else:
                out.append(f"[rank {rank}] {line}\n")
            if line:
                shown = None
        redrawing = bool(rest) and bool(ended) and ended[-1] == "\r"
        if redrawing:   # a redraw so far: shown now, and kept (after its "\r") to complete
            out.append(f"[rank {rank}] {rest}\r")
            self._shown[key] = rest
        if rest or held:
            self._partial[key] = ("\r" if redrawing else "") + rest + held
        if out:
            target.write("".join(out))
            target.flush()

    def flush(self) -> None:
        """Write every rank's unfinished line, then flush both streams."""
        partial, self._partial = self._partial, {}
        self._shown.clear()
        for (rank, stream), rest in sorted(partial.items()):
            line = rest.strip("\r")
            if line:
                (sys.stderr if stream == "stderr" else sys.stdout).write(f"[rank {rank}] {line}\n")
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing more to show
                logger.debug("could not flush %r", s, exc_info=True)
