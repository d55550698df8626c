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
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

__all__ = ["RankOutput"]

_LINE_ENDS = re.compile(r"(\r\n|\n|\r(?!\n))")
# A redraw (after "\r": a progress bar) up to this long shows again on every write that extends it;
# a longer one only once it has doubled since it showed, so that a line that grows without end costs
# the cell what the worker wrote, not its square.
SHORT_REDRAW = 200


@dataclass
class _Line:
    """A rank's stream's unfinished line: its text in pieces (joined once, when it ends)."""
    pieces: list = field(default_factory=list)
    size: int = 0
    cr: bool = False            # the last write ended in "\r": maybe half of a "\r\n"
    redraw: bool = False        # the line follows a "\r": a redraw, shown as it grows
    shown: str | None = None    # the redraw on screen now, if any

    def text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""


class RankOutput:
    """Writes ranks' output to ``sys.stdout``/``sys.stderr``; ``prefix`` adds ``[rank N]`` to each line.

    ``before_write()`` runs before anything is written (to clear a terminal status line, say).
    Each write costs what it adds: a rank's unfinished line is kept in pieces, and only the new text
    is searched for line ends.
    """

    def __init__(self, prefix: bool, before_write: Callable[[], None] | None = None):
        self.prefix = prefix
        self.before_write = before_write
        self._lines: dict[tuple[int, str], _Line] = {}

    def write(self, rank: int, stream: str, text: str) -> None:
        if self.before_write is not None:
            self.before_write()
        target = sys.stderr if stream == "stderr" else sys.stdout
        if not self.prefix:
            target.write(text)
            return
        line = self._lines.setdefault((rank, stream), _Line())
        if line.cr:
            text, line.cr = "\r" + text, False
        if text.endswith("\r"):   # maybe half of a "\r\n" split over two writes
            text, line.cr = text[:-1], True
        if _LINE_ENDS.search(text) is None:
            line.pieces.append(text)
            line.size += len(text)
            out = _redrawn(rank, line) if line.redraw and text else []
        else:
            out = self._ended(rank, (rank, stream), line, _LINE_ENDS.split(text))
        if out:
            target.write("".join(out))
            target.flush()

    def _ended(self, rank: int, key, line: _Line, pieces: list) -> list:
        """The lines ``pieces`` (text, end, text, end, ..., rest) complete, prefixed; the rest kept."""
        out = []
        shown = line.shown   # the unfinished redraw already on screen
        first = line.text() + pieces[0]
        for i in range(0, len(pieces) - 1, 2):
            text, end = (first if i == 0 else pieces[i]), pieces[i + 1]
            if end == "\r":
                # A progress bar (tqdm) redraws its line after "\r": each redraw shows now,
                # prefixed, and the next one replaces it, as in a plain cell.
                if text and text != shown:
                    out.append(f"[rank {rank}] {text}\r")
            else:
                out.append(f"[rank {rank}] {text}\n")
            if text:
                shown = None
        rest = pieces[-1]
        fresh = self._lines[key] = _Line([rest] if rest else [], len(rest), line.cr, redraw=pieces[-2] == "\r")
        if fresh.redraw and rest:   # a redraw so far: shown now, and kept to complete
            out += _redrawn(rank, fresh)
        return out

    def flush(self) -> None:
        """Write every rank's unfinished line, then flush both streams."""
        lines, self._lines = self._lines, {}
        for (rank, stream), line in sorted(lines.items()):
            text = line.text()
            if text:
                (sys.stderr if stream == "stderr" else sys.stdout).write(f"[rank {rank}] {text}\n")
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing more to show
                logger.debug("could not flush %r", s, exc_info=True)


def _redrawn(rank: int, line: _Line) -> list:
    """The redraw ``line`` as it is now, prefixed, where it is short or has doubled since it showed."""
    if line.size > SHORT_REDRAW and line.shown is not None and line.size < 2 * len(line.shown):
        return []
    line.shown = line.text()
    return [f"[rank {rank}] {line.shown}\r"]
