"""What gpumagic does around every cell: the out-of-memory report, and the per-cell ledger.

Registered with IPython's ``pre_run_cell`` and ``post_run_cell`` events when the
extension loads: a cell that fails with an out-of-memory error gets
:class:`gpumagic.memory.oom.OomReport` shown once, under its traceback; while
``%gpumem --cells`` is on, each cell gets its :class:`gpumagic.memory.ledger.CellLedger`
line. The handlers never raise (IPython would print their errors after every
cell): a failure is logged.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

__all__ = ["register", "unregister", "show_oom_report", "toggle_ledger", "ledger_on"]


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
    from ..display import show
    show(shell, report)


class _Handlers:
    """The bound callbacks, kept so that unloading removes exactly these."""

    def __init__(self, shell):
        self.shell = shell
        self.ledger = None        # a memory.ledger.Ledger while `%gpumem --cells` is on
        self._started = False     # the ledger read the figures before this cell

    def pre_run_cell(self, info) -> None:
        if self.ledger is None:
            return
        try:
            self.ledger.start(self.shell.user_ns, self.shell.user_ns_hidden)
            self._started = True
        except Exception:  # the ledger is a help: the cell runs all the same
            logger.warning("the memory ledger could not read the figures before the cell", exc_info=True)

    def post_run_cell(self, result) -> None:
        try:
            show_oom_report(self.shell, result)
        except Exception:  # never let a report break the cell that follows
            logger.warning("the out-of-memory report failed", exc_info=True)
        if self.ledger is None or not self._started:
            return
        self._started = False
        try:
            info = getattr(result, "info", None)
            entry = self.ledger.finish(self.shell.user_ns, getattr(info, "raw_cell", "") or "",
                                       f"In[{result.execution_count}]")
        except Exception:
            logger.warning("the memory ledger could not read the figures after the cell", exc_info=True)
            return
        if entry is not None:
            print(entry.text())


def toggle_ledger(shell) -> bool:
    """Turn the per-cell ledger on (off where it was on); returns whether it is on now."""
    handlers = _registered.get(id(shell))
    if handlers is None:
        register(shell)
        handlers = _registered[id(shell)]
    if handlers.ledger is None:
        from ..memory.ledger import Ledger
        handlers.ledger = Ledger()
    else:
        handlers.ledger = None
    handlers._started = False
    return handlers.ledger is not None


def ledger_on(shell) -> bool:
    handlers = _registered.get(id(shell))
    return handlers is not None and handlers.ledger is not None


_registered: dict[int, _Handlers] = {}


def register(shell) -> None:
    """Connect the handlers to ``shell``'s events (once)."""
    if id(shell) in _registered:
        return
    handlers = _registered[id(shell)] = _Handlers(shell)
    shell.events.register("pre_run_cell", handlers.pre_run_cell)
    shell.events.register("post_run_cell", handlers.post_run_cell)


def unregister(shell) -> None:
    handlers = _registered.pop(id(shell), None)
    if handlers is None:
        return
    for event in ("pre_run_cell", "post_run_cell"):
        try:
            shell.events.unregister(event, getattr(handlers, event))
        except ValueError:  # already removed by hand
            logger.debug("%s handler was not registered", event, exc_info=True)
