"""Every process on every GPU, with its memory, named for what it is (``%gpumem --who``).

NVML lists the processes of each GPU and what each holds; :mod:`.process_names`
says what each one is (this kernel, another kernel and its notebook, a worker,
an orphan, another user's process). Nothing here creates a CUDA context or
initialises CUDA: the GPUs are read through NVML only, in one reading bounded
by :data:`.nvml.READ_TIMEOUT` (a wedged driver leaves a note, not a hung kernel).

In a notebook::

    from gpumagic.devices.gpu_processes import who
    report = who()
    [p.who.label for p in report["cuda:0"].processes]   # ['this kernel (a.ipynb)', 'kernel 5e1f2a3b (b.ipynb)']
    report.orphans()                                   # what %gpumem --reclaim would end
"""
from __future__ import annotations

import html
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..display import fmt_bytes, html_table, text_table
from . import discovery, nvml
from .memory import listed_processes
from .process_names import Kind, Who, name_processes

logger = logging.getLogger(__name__)

__all__ = ["GpuProcess", "DeviceProcesses", "WhoReport", "who", "read_processes"]

_NOT_AVAILABLE = 2**63   # NVML's "not available" is 2**64 - 1 in some bindings: no process holds that much
_HEADER = ["pid", "memory", "who"]


@dataclass
class GpuProcess:
    """One process on one GPU: its pid, the bytes NVML says it holds there (None: not reported), what it is."""
    pid: int
    used: int | None
    who: Who

    def as_dict(self) -> dict:
        return {"pid": self.pid, "used": self.used, **self.who.as_dict()}


@dataclass
class DeviceProcesses:
    """One GPU: NVML's used/total and its processes, largest first."""
    device: str
    name: str
    uuid: str | None
    used: int | None = None
    total: int | None = None
    processes: list[GpuProcess] = field(default_factory=list)
    note: str | None = None

    @property
    def listed(self) -> int:
        """Bytes the processes listed hold together (those NVML gives a figure for)."""
        return sum(p.used or 0 for p in self.processes)

    def as_dict(self) -> dict:
        return {"device": self.device, "name": self.name, "uuid": self.uuid, "used": self.used, "total": self.total,
                "listed": self.listed, "note": self.note, "processes": [p.as_dict() for p in self.processes]}

    def heading(self) -> str:
        head = f"{self.device} {self.name}: {fmt_bytes(self.used)} / {fmt_bytes(self.total)} used"
        if self.processes:
            head += f", {fmt_bytes(self.listed)} by the {len(self.processes)} process(es) below"
        return head + (f" ({self.note})" if self.note else "")

    def cells(self) -> list[list[str]]:
        return [[str(p.pid), fmt_bytes(p.used), p.who.label] for p in self.processes]

    def holders(self, top: int = 4) -> str:
        """Who else holds this GPU, in a line: ``"b.ipynb 20.0 GiB · orphan pid 4242 5.0 GiB · nobody 1.0 GiB"``
        (this kernel left out: its gauge shows it already)."""
        others = [p for p in self.processes if p.who.kind is not Kind.THIS_KERNEL]
        words = [f"{_holder(p)} {fmt_bytes(p.used)}" for p in others[:top]]
        if len(others) > top:
            words.append(f"+{len(others) - top} more")
        return " · ".join(words)


@dataclass
class WhoReport:
    """What ``%gpumem --who`` shows: per GPU, its processes named; ``seconds`` it took to find out."""
    devices: list[DeviceProcesses]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def __getitem__(self, device: str) -> DeviceProcesses:
        for row in self.devices:
            if row.device == device:
                return row
        raise KeyError(device)

    def processes(self) -> Iterator[tuple[DeviceProcesses, GpuProcess]]:
        for row in self.devices:
            for proc in row.processes:
                yield row, proc

    def orphans(self) -> list[GpuProcess]:
        """This user's orphans, each pid once (on several GPUs: the first)."""
        seen: dict[int, GpuProcess] = {}
        for _, proc in self.processes():
            if proc.who.kind is Kind.ORPHAN:
                seen.setdefault(proc.pid, proc)
        return list(seen.values())

    def by_kind(self) -> dict[str, int]:
        """Bytes held, summed by kind over every GPU."""
        sums: dict[str, int] = {}
        for _, proc in self.processes():
            sums[proc.who.kind.value] = sums.get(proc.who.kind.value, 0) + (proc.used or 0)
        return sums

    def as_dict(self) -> dict:
        return {"devices": {row.device: row.as_dict() for row in self.devices}, "by_kind": self.by_kind(),
                "notes": list(self.notes), "seconds": round(self.seconds, 4)}

    def text(self) -> str:
        parts = []
        for row in self.devices:
            parts.append(row.heading())
            parts.append(text_table(row.cells(), _HEADER) if row.processes else "  (no process)")
        return "\n".join([*parts, *self.notes]) if parts or self.notes else "no GPU to list processes of"

    def _repr_html_(self) -> str:
        out = []
        for row in self.devices:
            out.append(f"<div><b>{html.escape(row.heading())}</b></div>")
            out.append(html_table(row.cells(), _HEADER) if row.processes else "<div>(no process)</div>")
        out += [f"<div>{html.escape(n)}</div>" for n in self.notes]
        return "".join(out)

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def __repr__(self):
        return self.text()


def _holder(proc: GpuProcess) -> str:
    """A process in a few words, for a gauge."""
    who = proc.who
    if who.kind is Kind.KERNEL:
        return who.notebook.rsplit("/", 1)[-1] if who.notebook else f"kernel {(who.kernel_id or '?')[:8]}"
    if who.kind is Kind.ORPHAN:
        return f"orphan pid {proc.pid}"
    if who.kind is Kind.OTHER_USER:
        return who.user or "another user"
    if who.kind is Kind.UNKNOWN:
        return f"pid {proc.pid}"
    return who.label if len(who.label) <= 32 else who.label[:29] + "..."


def read_processes(gpus) -> dict[str, DeviceProcesses]:
    """NVML's used/total and ``{pid: bytes}`` per GPU, processes not named yet (``who`` empty)."""
    nv = nvml.lib()
    rows = {}
    for gpu in gpus:
        row = DeviceProcesses(gpu.device, gpu.name, getattr(gpu, "uuid", None))
        if gpu.handle is None:
            row.note = "NVML cannot read this GPU"
            rows[gpu.device] = row
            continue
        info = nvml.query(nv.nvmlDeviceGetMemoryInfo, gpu.handle)
        if info is not None:
            row.total, row.used = int(info.total), int(info.used)
        listed = listed_processes(gpu.handle)
        if listed is None:
            row.note = "NVML does not list this GPU's processes"
        for pid, used in (listed or {}).items():
            known = int(used) if used is not None and 0 <= used < _NOT_AVAILABLE else None
            row.processes.append(GpuProcess(pid, known, Who(Kind.UNKNOWN, "")))
        rows[gpu.device] = row
    return rows


def who(device: str | None = None, gpus=None, timeout: float | None = None, max_age: float = 0.0,
        in_thread: bool = True) -> WhoReport:
    """Every process on ``device`` (``"cuda:N"``; None: every GPU), named; see :mod:`.process_names`.

    ``timeout``: seconds the Jupyter servers have to answer (all at once); ``max_age``: seconds
    their answers may be reused (the gauges refresh every few seconds). ``in_thread=False`` reads
    NVML here, not in a bounded reading of its own (the gauges' thread, which is one already).
    """
    started = time.monotonic()
    notes: list[str] = []
    if gpus is None:
        gpus = discovery.visible_gpus()
    chosen = [g for g in gpus if device is None or g.device == device]
    try:
        read = (lambda: nvml.bounded(read_processes, chosen, what="listing GPU processes")) if in_thread \
            else (lambda: read_processes(chosen))
        rows = read() if chosen else {}
    except nvml.NvmlUnavailable as exc:   # a wedged driver (NvmlTimeout) included: its message says so
        rows, notes = {}, [str(exc)]
    pids = [p.pid for row in rows.values() for p in row.processes]
    named, server_notes = name_processes(pids, timeout=timeout, max_age=max_age) if pids else ({}, [])
    for row in rows.values():
        row.processes = sorted((GpuProcess(p.pid, p.used, named[p.pid]) for p in row.processes),
                               key=lambda p: (-(p.used or 0), p.pid))
    if not chosen and not notes:
        notes.append(f"no GPU visible: {nvml.unavailable_reason() or discovery.visible_devices_setting()}.")
    if any(p.who.kind is Kind.UNKNOWN for row in rows.values() for p in row.processes):
        notes.append("processes named 'not visible here' run in another pid namespace (a container), or ended "
                     "as they were read.")
    return WhoReport([rows[g.device] for g in chosen if g.device in rows], notes + server_notes,
                     time.monotonic() - started)
