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
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["RankOutput"]


class RankOutput:
    """Writes ranks' output to ``sys.stdout``/``sys.stderr``; ``prefix`` adds ``[rank N]`` to each line.

    ``before_write()`` runs before anything is written (to clear a terminal status line, say).
    """

    def __init__(self, prefix: bool, before_write: Callable[[], None] | None = None):
        self.prefix = prefix
        self.before_write = before_write
        self._partial: dict[tuple[int, str], str] = {}

    def write(self, rank: int, stream: str, text: str) -> None:
        if self.before_write is not None:
            self.before_write()
        target = sys.stderr if stream == "stderr" else sys.stdout
        if not self.prefix:
            target.write(text)
            return
        key = (rank, stream)
        lines = (self._partial.pop(key, "") + text).split("\n")
        if lines[-1]:
            self._partial[key] = lines[-1]
        complete = lines[:-1]
        if complete:
            target.write("".join(f"[rank {rank}] {line}\n" for line in complete))
            target.flush()

    def flush(self) -> None:
        """Write every rank's unfinished line, then flush both streams."""
        partial, self._partial = self._partial, {}
        for (rank, stream), rest in sorted(partial.items()):
            (sys.stderr if stream == "stderr" else sys.stdout).write(f"[rank {rank}] {rest}\n")
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing more to show
                logger.debug("could not flush %r", s, exc_info=True)
