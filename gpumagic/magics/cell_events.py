"""What gpumagic does around every cell: the out-of-memory report, and the per-cell ledger.

Registered with IPython's ``post_run_cell`` (and ``pre_run_cell``) events when
the extension loads: a cell that fails with an out-of-memory error gets
:class:`gpumagic.memory.oom.OomReport` shown once, under its traceback. The
handlers never raise (IPython would print their errors after every cell): a
failure is logged.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

__all__ = ["register", "unregister", "show_oom_report"]


def show_oom_report(shell, result) -> None:
    """Show the out-of-memory report under a cell's traceback, where the cell ran out of memory."""
    error = getattr(result, "error_in_exec", None)
    if error is None:
        return
    from ..errors import WorkerError
    from ..memory import oom
    if isinstance(error, WorkerError) or not oom.is_out_of_memory(error):
        return   # a rank's error carries the rank's own report
    try:
        report = oom.oom_report(error, shell.user_ns, hidden=shell.user_ns_hidden, holders=(shell,), shell=shell)
    except Exception:  # the report is a help; the cell's own error is already shown
        logger.warning("the out-of-memory report could not be made", exc_info=True)
        return
    finally:
        del error
    from .memory import _show
    _show(shell, report)


class _Handlers:
    """The bound callbacks, kept so that unloading removes exactly these."""

    def __init__(self, shell):
        self.shell = shell

    def post_run_cell(self, result) -> None:
        try:
            show_oom_report(self.shell, result)
        except Exception:  # never let a report break the cell that follows
            logger.warning("the out-of-memory report failed", exc_info=True)


_registered: dict[int, _Handlers] = {}


def register(shell) -> None:
    """Connect the handlers to ``shell``'s events (once)."""
    if id(shell) in _registered:
        return
    handlers = _registered[id(shell)] = _Handlers(shell)
    shell.events.register("post_run_cell", handlers.post_run_cell)


def unregister(shell) -> None:
    handlers = _registered.pop(id(shell), None)
    if handlers is None:
        return
    try:
        shell.events.unregister("post_run_cell", handlers.post_run_cell)
    except ValueError:  # already removed by hand
        logger.debug("post_run_cell handler was not registered", exc_info=True)
