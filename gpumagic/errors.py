"""The error kinds gpumagic raises.

One error path per kind:

* bad arguments to a magic -> :class:`IPython.core.error.UsageError` (a plain
  one: IPython shows it as a one-line message, subclasses get full tracebacks);
* the user's own exception -> re-raised unchanged, with their line numbers;
* an exception in a worker process -> :class:`WorkerError`; a worker that
  died without one (killed, out of memory, ``os._exit``) -> :class:`WorkerDied`;
* an interrupt while workers ran the cell -> :class:`CellInterrupted`, once they stopped.
"""
from __future__ import annotations

import os
from typing import Any

from IPython.core.error import UsageError

__all__ = ["UsageError", "WorkerError", "WorkerDied", "CellInterrupted", "usage_error", "release_frames"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def usage_error(what: str, choices=None) -> UsageError:
    """A UsageError whose message names the valid choices.

    >>> str(usage_error("unknown device 'tpu'", ["cpu", "cuda:0"]))
    "unknown device 'tpu'; valid choices: cpu, cuda:0"
    """
    if choices is not None:
        listed = ", ".join(str(c) for c in choices) or "(none)"
        what = f"{what}; valid choices: {listed}"
    return UsageError(what)


class WorkerError(RuntimeError):
    """An exception raised in a worker process, shown with the worker's traceback.

    ``rank`` and ``pid`` say which worker failed; ``remote_traceback`` is the
    worker's formatted traceback, which points at the user's cell lines.
    ``exc_type`` is the name of the worker's exception class; ``all_errors``
    what every failed rank reported (``{rank: info}``).
    """

    def __init__(self, rank: int, pid: int | None, exc_type: str, message: str,
                 remote_traceback: str = ""):
        self.rank = rank
        self.pid = pid
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.all_errors: dict = {}
        self.still_running: list = []   # ranks that had not finished the cell (stopped then)
        self.report: Any = None         # what the rank reported beside its traceback (an out-of-memory report)
        super().__init__(f"rank {rank} (pid {pid}) raised {exc_type}: {message}")

    def _render_traceback_(self):
        # IPython calls this instead of formatting our own (uninteresting) frames.
        head = f"WorkerError: rank {self.rank} (pid {self.pid}) raised {self.exc_type}"
        lines = [head, ""]
        lines += self.remote_traceback.rstrip("\n").splitlines() or [f"{self.exc_type}: {self.message}"]
        if hasattr(self.report, "lines"):
            lines += ["", *self.report.lines()]
        if self.still_running:
            # a collective that timed out names the rank that waited, not the one that never came
            ranks = ", ".join(map(str, self.still_running))
            which = "it" if len(self.still_running) == 1 else "they"
            lines += ["", f"rank{'s' if len(self.still_running) > 1 else ''} {ranks} had not finished the cell "
                          f"(stopped now): where a collective above timed out or failed, look at what {which} "
                          f"did instead of reaching it."]
        return lines

    def __reduce__(self):
        return (type(self), (self.rank, self.pid, self.exc_type, self.message, self.remote_traceback))


class WorkerDied(WorkerError):
    """A worker died or was killed without reporting an exception (``exc_type`` is ``"WorkerDied"``).

    A ``%%dataparallel`` pool is gone after this, and the next cell starts a fresh one.
    """


class CellInterrupted(KeyboardInterrupt):
    """The cell was interrupted while its workers ran; they have stopped (a note says what the notebook holds).

    Shown as a plain ``KeyboardInterrupt``: where the kernel happened to be waiting is not the user's concern.
    """

    def _render_traceback_(self):
        return [f"KeyboardInterrupt: {self}" if str(self) else "KeyboardInterrupt"]


def release_frames(exc: BaseException) -> None:
    """Drop the locals of gpumagic's finished frames in ``exc``'s traceback (and those it chains to).

    A failed cell's traceback stays with the notebook (``sys.last_traceback``, and in reference cycles
    until the garbage collector runs), and gpumagic's frames in it hold what the cell shipped: the
    workers' shared-memory buffer, the model's size, once per failed cell. Their locals show nowhere
    (worker errors render the workers' traceback; interrupts a line). Any other exception keeps them:
    IPython shows its frames, and ``%debug`` their locals (the user's own error from a ``--strategy dp``
    cell, which runs in the kernel; a failure of gpumagic's own).
    """
    if not (isinstance(exc, (KeyboardInterrupt, UsageError)) or hasattr(exc, "_render_traceback_")):
        return
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):
                try:
                    tb.tb_frame.clear()
                except RuntimeError:   # still running: the magic's own frame, which ends with the cell
                    pass
            tb = tb.tb_next
        pending += [current.__cause__, current.__context__]
