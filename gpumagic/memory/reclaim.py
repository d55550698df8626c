"""Ending this user's orphans on the GPUs, and the memory that gives back (``%gpumem --reclaim``).

An orphan is a gpumagic worker, or a DataLoader or multiprocessing child,
whose kernel is gone (:mod:`gpumagic.devices.process_names` says how that is
proved). :func:`reclaim` ends each one by pid, as gpumagic ends its own workers
(:mod:`gpumagic.procs.teardown`): SIGTERM, a grace period, SIGKILL. Just before
signalling, each pid is checked again: still this user's, still the process
that was named (same start time: pids are reused), not this kernel nor one of
its ancestors. Another user's process, a kernel, a worker whose kernel lives,
any process not proved an orphan is never signalled.

The memory freed is NVML's used memory before and after, per GPU, read once
the ended processes have left NVML's lists (or ``settle`` seconds passed).
"""
from __future__ import annotations

import html
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, field

from ..devices import discovery, nvml
from ..devices.gpu_processes import WhoReport, read_processes, who
from ..devices.process_names import Kind
from ..display import fmt_bytes, html_table, text_table
from ..procs.teardown import STOP_GRACE

logger = logging.getLogger(__name__)

__all__ = ["Ended", "ReclaimReport", "reclaim"]

_POLL = 0.02   # seconds between looks at whether the orphans are gone
_SETTLED = 2 << 20   # bytes of change between readings that count as none (NVML's own noise)
_HEADER = ["pid", "held", "outcome", "what it was"]


@dataclass
class Ended:
    """One orphan: what it held (NVML, every GPU) and what became of it."""
    pid: int
    label: str
    held: int
    outcome: str   # "ended by SIGTERM", "ended by SIGKILL", "was gone already", "still running", "left alone: ..."

    @property
    def gone(self) -> bool:
        return self.outcome.startswith(("ended", "was gone"))


@dataclass
class ReclaimReport:
    """What ``%gpumem --reclaim`` did: the orphans, and NVML's used bytes per GPU before and after."""
    ended: list[Ended] = field(default_factory=list)
    before: dict[str, int | None] = field(default_factory=dict)
    after: dict[str, int | None] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def freed(self) -> int:
        """NVML's used bytes before minus after, over the GPUs read both times."""
        total = 0
        for device, before in self.before.items():
            after = self.after.get(device)
            if before is not None and after is not None:
                total += before - after
        return total

    def as_dict(self) -> dict:
        return {"ended": [asdict(e) for e in self.ended], "before": dict(self.before), "after": dict(self.after),
                "freed": self.freed, "seconds": round(self.seconds, 3), "notes": list(self.notes)}

    def _cells(self) -> list[list[str]]:
        return [[str(e.pid), fmt_bytes(e.held), e.outcome, e.label] for e in self.ended]

    def summary(self) -> str:
        if not self.ended:
            return "No orphan holds GPU memory: nothing to end."
        gone = sum(e.gone for e in self.ended)
        return (f"Ended {gone} of {len(self.ended)} orphan(s) in {self.seconds:.1f} s; the GPUs' used memory fell by "
                f"{fmt_bytes(self.freed)} (NVML, before - after).")

    def text(self) -> str:
        table = [text_table(self._cells(), _HEADER)] if self.ended else []
        return "\n".join([self.summary(), *table, *self.notes])

    def _repr_html_(self) -> str:
        table = html_table(self._cells(), _HEADER) if self.ended else ""
        notes = "".join(f"<div>{html.escape(n)}</div>" for n in self.notes)
        return f"<div>{html.escape(self.summary())}</div>{table}{notes}"

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def __repr__(self):
        return self.text()


def reclaim(device: str | None = None, gpus=None, grace: float = STOP_GRACE, settle: float = 5.0,
            timeout: float | None = None) -> ReclaimReport:
    """End this user's orphans on ``device`` (None: every GPU); returns what was ended and freed.

    In a notebook::

        from gpumagic.memory.reclaim import reclaim
        reclaim().freed          # bytes NVML shows freed
    """
    started = time.monotonic()
    gpus = discovery.visible_gpus() if gpus is None else gpus
    report = who(device, gpus, timeout=timeout)
    result = ReclaimReport(notes=list(report.notes))
    held = _held(report)
    if not held:
        result.seconds = time.monotonic() - started
        return result
    result.before = {row.device: row.used for row in report.devices}
    targets = []
    for proc in report.orphans():
        reason, handle = _check(proc.pid, proc.who.started)
        if handle is None:
            result.ended.append(Ended(proc.pid, proc.who.label, held[proc.pid], reason))
        else:
            targets.append((proc, handle))
    outcomes = _end([handle for _, handle in targets], grace)
    for proc, handle in targets:
        result.ended.append(Ended(proc.pid, proc.who.label, held[proc.pid], outcomes[handle.pid]))
    chosen = [g for g in gpus if g.device in result.before]
    result.after = _settled(chosen, {e.pid for e in result.ended if e.gone}, settle)
    result.seconds = time.monotonic() - started
    return result


def _held(report: WhoReport) -> dict[int, int]:
    """Bytes each orphan holds over every GPU."""
    held: dict[int, int] = {}
    for _, proc in report.processes():
        if proc.who.kind is Kind.ORPHAN:
            held[proc.pid] = held.get(proc.pid, 0) + (proc.used or 0)
    return held


def _check(pid: int, started: float | None):
    """``(why not, None)`` where ``pid`` must not be signalled, else ``("", psutil.Process)``."""
    import psutil
    me = os.getpid()
    try:
        proc = psutil.Process(pid)
        if started is None or abs(proc.create_time() - started) > 0.5:
            return "left alone: its pid now belongs to another process", None
        if proc.uids().real != os.getuid():
            return "left alone: another user's process", None
        if pid == me or pid in {p.pid for p in psutil.Process(me).parents()}:
            return "left alone: this kernel or one of its parents", None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "was gone already", None
        return "", proc
    except psutil.NoSuchProcess:
        return "was gone already", None
    except psutil.Error as exc:
        logger.debug("cannot check process %d; it is left alone", pid, exc_info=True)
        return f"left alone: {type(exc).__name__}", None


def _end(procs: list, grace: float) -> dict[int, str]:
    """SIGTERM each, wait up to ``grace`` s, SIGKILL what is left; each pid's outcome."""
    outcomes: dict[int, str] = {}
    for how, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        running = [p for p in procs if p.pid not in outcomes]
        for proc in running:
            _signal(proc, how)
        deadline = time.monotonic() + wait
        while running:
            running = [p for p in running if not _gone(p)]
            if not running or time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
        for proc in procs:
            if proc.pid not in outcomes and proc not in running:
                outcomes[proc.pid] = f"ended by {how.name}"
    for proc in procs:
        outcomes.setdefault(proc.pid, "still running")
    return outcomes


def _signal(proc, how: signal.Signals) -> None:
    import psutil
    try:
        proc.send_signal(how)   # psutil checks the pid is still this process before signalling
    except psutil.NoSuchProcess:
        pass   # it ended by itself meanwhile
    except psutil.Error:
        logger.warning("gpumagic: could not send %s to orphan %d", how.name, proc.pid, exc_info=True)


def _gone(proc) -> bool:
    import psutil
    try:
        return proc.status() == psutil.STATUS_ZOMBIE   # dead, waiting for a parent that is not us to reap it
    except psutil.NoSuchProcess:
        return True


def _settled(gpus: list, ended: set[int], settle: float) -> dict[str, int | None]:
    """NVML's used bytes per GPU once none of ``ended`` is listed any more and the driver has given
    their memory back (two readings apart no longer falling), or after ``settle`` s.

    A process leaves NVML's lists before the driver has released all of its memory: the first
    reading without it can still count part of what it held."""
    deadline = time.monotonic() + settle
    last: dict[str, int | None] | None = None
    while True:
        try:
            rows = nvml.bounded(read_processes, gpus, what="reading GPU memory after ending orphans")
        except nvml.NvmlUnavailable:
            logger.debug("NVML did not answer after the orphans ended", exc_info=True)
            return {g.device: None for g in gpus}
        used = {device: row.used for device, row in rows.items()}
        if {p.pid for row in rows.values() for p in row.processes} & ended:
            last = None
        elif last is not None and not any(_falling(last.get(d), u) for d, u in used.items()):
            return used
        else:
            last = used
        if time.monotonic() >= deadline:
            return used
        time.sleep(_POLL * 5)


def _falling(before: int | None, now: int | None) -> bool:
    """Still going down by more than NVML's noise between two readings."""
    return before is not None and now is not None and before - now > _SETTLED
