"""Memory per device: the figures ``%gpumem`` and its gauges show.

:func:`snapshot` gives used/total per device (NVML for GPUs, psutil for the
CPU), this kernel's own share, and torch's allocator figures where this
kernel has already initialised CUDA; :func:`device_memory` reads one device.
Which variables hold the memory, and freeing it, live in :mod:`gpumagic.memory`.

Nothing here initialises CUDA or creates a CUDA context: GPU figures come from
NVML, and torch is asked only about devices it has already set up. A
snapshot reads its GPUs in a thread waited for at most
:data:`.nvml.READ_TIMEOUT` seconds (a wedged driver leaves them n/a, with a
note). Nothing here needs IPython.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

from ..display import NA, fmt_bytes, html_table, text_table
from . import discovery as devices
from . import nvml

logger = logging.getLogger(__name__)

__all__ = ["DeviceMemory", "MemorySnapshot", "snapshot", "device_memory", "gpu_process_memory", "listed_processes",
           "targets", "torch_allocator"]


@dataclass
class DeviceMemory:
    """Memory of one device, in bytes; ``None`` where it cannot be known.

    For a GPU, ``used``/``total`` are the device's (NVML), ``process`` is this
    kernel's own share (NVML per-process accounting) and ``allocated``,
    ``reserved``, ``peak`` are torch's caching-allocator figures (only once
    this kernel has initialised CUDA). For the CPU, ``used``/``total`` are the
    machine's and ``process`` is the kernel's resident memory.
    """
    device: str
    name: str
    total: int | None = None
    used: int | None = None
    process: int | None = None
    process_note: str | None = None
    allocated: int | None = None
    reserved: int | None = None
    peak: int | None = None
    note: str | None = None

    @property
    def free(self) -> int | None:
        if self.total is None or self.used is None:
            return None
        return self.total - self.used

    @property
    def fraction(self) -> float | None:
        """Used over total, 0..1."""
        if not self.total or self.used is None:
            return None
        return self.used / self.total

    def as_dict(self) -> dict:
        return {
            "device": self.device, "name": self.name, "total": self.total, "used": self.used,
            "free": self.free, "process": self.process, "process_note": self.process_note,
            "allocated": self.allocated, "reserved": self.reserved, "peak": self.peak,
            "note": self.note,
        }


_HEADER = ["device", "name", "used / total", "used", "this kernel", "torch allocated",
           "torch reserved", "torch peak"]


def _pct(fraction) -> str:
    return NA if fraction is None else f"{100 * fraction:.0f}%"


class MemorySnapshot:
    """What ``%gpumem`` shows: one :class:`DeviceMemory` per device, and notes.

    ``rows`` holds the figures; ``as_dict()`` gives plain data
    (``{"devices": {name: figures}, "notes": [...]}``, the notes kept as
    ``%gpuinfo --json`` keeps them). Shown as an HTML table in a notebook and
    as text in a terminal.
    """

    def __init__(self, rows: list[DeviceMemory], notes: list[str] | None = None):
        self.rows = rows
        self.notes = notes or []

    def __getitem__(self, device: str) -> DeviceMemory:
        for row in self.rows:
            if row.device == device:
                return row
        raise KeyError(device)

    def as_dict(self) -> dict:
        return {"devices": {row.device: row.as_dict() for row in self.rows}, "notes": list(self.notes)}

    def _cells(self) -> list[list[str]]:
        cells = []
        for r in self.rows:
            own = fmt_bytes(r.process) if r.process is not None else f"{NA} ({r.process_note})" \
                if r.process_note else NA
            cells.append([
                r.device, r.name, f"{fmt_bytes(r.used)} / {fmt_bytes(r.total)}", _pct(r.fraction),
                own, fmt_bytes(r.allocated), fmt_bytes(r.reserved), fmt_bytes(r.peak),
            ])
        return cells

    def text(self) -> str:
        out = text_table(self._cells(), _HEADER)
        return "\n".join([out, *self.notes])

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def _repr_html_(self):
        import html
        notes = "".join(f"<div>{html.escape(n)}</div>" for n in self.notes)
        return html_table(self._cells(), _HEADER) + notes

    def __repr__(self):
        return self.text()


def _torch():
    """torch if this process imported it; monitoring never imports it itself."""
    return sys.modules.get("torch")


def gpu_process_memory(handle, pid: int | None = None) -> tuple[int | None, str | None]:
    """Bytes process ``pid`` (default: this one) holds on the GPU behind ``handle``.

    Reads NVML's compute and graphics process lists. Returns ``(bytes, None)``
    or ``(None, why)`` where the figure cannot be known: the driver does not
    report it, or the lists carry pids from another pid namespace (containers),
    so that absence from the list proves nothing.
    """
    pid = os.getpid() if pid is None else pid
    listed = listed_processes(handle)
    if listed is None:  # CUDA contexts are compute processes: without that list, unknown
        return None, "not reported"
    if pid in listed:
        used = listed[pid]
        return (int(used), None) if used is not None else (None, "not reported")
    if any(not _pid_exists(other) for other in listed):
        return None, "pid namespace"
    return 0, None


def listed_processes(handle) -> dict[int, int | None] | None:
    """``{pid: bytes}`` of every process NVML lists on the GPU behind ``handle`` (bytes None where
    the driver does not say); None where NVML cannot list its compute processes."""
    nv = nvml.lib()
    listed: dict[int, int | None] = {}
    compute_known = False
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        func = getattr(nv, fn, None)
        if func is None:
            continue
        try:
            procs = func(handle)
        except Exception:  # NotSupported (MIG without permission, vGPU...)
            logger.debug("NVML %s is unsupported here", fn, exc_info=True)
            continue
        compute_known = compute_known or "Compute" in fn
        for p in procs or ():
            used = getattr(p, "usedGpuMemory", None)
            known = listed.get(p.pid)
            # A compute+graphics process is listed twice with the same figure.
            listed[p.pid] = used if known is None else max(known, used or 0)
    return listed if compute_known else None


def _pid_exists(pid: int) -> bool:
    import psutil
    try:
        return psutil.pid_exists(pid)
    except Exception:
        logger.debug("could not tell whether pid %d exists; taking it as gone", pid, exc_info=True)
        return False


def torch_allocator(index: int) -> tuple[int | None, int | None, int | None]:
    """(allocated, reserved, peak) bytes of torch's caching allocator on ``cuda:index``.

    ``None``s until this process has initialised CUDA, and where torch cannot
    answer (the query raised: logged at debug). These read the allocator's
    host-side counters: nothing initialises CUDA or makes a context, and
    nothing raises. ``%gpumem`` and ``%gpuinfo`` both show these figures.
    """
    if not devices.torch_cuda_initialized():
        return None, None, None
    torch = _torch()
    try:
        return (int(torch.cuda.memory_allocated(index)), int(torch.cuda.memory_reserved(index)),
                int(torch.cuda.max_memory_allocated(index)))
    except Exception:
        logger.debug("torch's allocator figures for cuda:%d are unavailable", index, exc_info=True)
        return None, None, None


def _has_context(index: int) -> bool:
    """True when torch already made a CUDA context on ``cuda:index``."""
    torch = _torch()
    check = getattr(getattr(torch, "_C", None), "_cuda_hasPrimaryContext", None)
    if check is None:
        return False
    try:
        return bool(check(index))
    except Exception:
        logger.debug("torch could not say whether cuda:%d has a context", index, exc_info=True)
        return False


def device_memory(target, processes: bool = True) -> DeviceMemory:
    """Memory of one device: ``"cpu"``, ``"mps"`` or a :class:`gpumagic.devices.Gpu`.

    ``processes=False`` skips the per-process listing (this kernel's share).
    """
    if target == "cpu":
        return _cpu_memory()
    if target == "mps":
        return _mps_memory()
    return _gpu_memory(target, processes)


def _cpu_memory() -> DeviceMemory:
    import psutil
    vm = psutil.virtual_memory()
    return DeviceMemory(
        device="cpu", name="CPU (machine)", total=int(vm.total), used=int(vm.total - vm.available),
        process=int(psutil.Process().memory_info().rss),
    )


def _mps_memory() -> DeviceMemory:
    row = DeviceMemory(device="mps", name="Apple MPS")
    torch = _torch()
    try:
        row.allocated = int(torch.mps.current_allocated_memory())
        row.reserved = int(torch.mps.driver_allocated_memory())
        row.total = int(torch.mps.recommended_max_memory())
        row.used = row.reserved
        row.process = row.reserved
    except Exception as exc:
        logger.debug("MPS memory figures are unavailable; the row notes why", exc_info=True)
        row.note = f"mps: {exc}"
    return row


def _gpu_memory(gpu, processes: bool = True) -> DeviceMemory:
    row = DeviceMemory(device=gpu.device, name=gpu.name)
    if gpu.handle is not None:
        nv = nvml.lib()
        info = nvml.query(nv.nvmlDeviceGetMemoryInfo, gpu.handle)
        if info is not None:
            row.total, row.used = int(info.total), int(info.used)
        else:
            row.note = f"{gpu.device}: memory not reported by NVML"
        if processes:
            row.process, row.process_note = gpu_process_memory(gpu.handle)
            if row.process == 0 and devices.torch_cuda_initialized() and _has_context(gpu.index):
                # We hold a context there, yet NVML lists no process of our pid:
                # its pids come from another pid namespace.
                row.process, row.process_note = None, "pid namespace"
        else:
            row.process_note = "not read"
    elif _has_context(gpu.index):
        # No NVML, but torch already holds a context here, so asking costs nothing.
        free, total = _torch().cuda.mem_get_info(gpu.index)
        row.total, row.used = int(total), int(total - free)
        row.process_note = "needs NVML"
    else:
        row.process_note = "needs NVML"
        row.note = f"{gpu.device}: NVML is unavailable and this kernel has no CUDA context there"
    row.allocated, row.reserved, row.peak = torch_allocator(gpu.index)
    return row


def targets(device: str | None, gpus) -> list:
    """``"cpu"``, ``"mps"`` and Gpu objects for ``device`` (None: every device); a GPU not among
    ``gpus`` (unlisted: the driver did not answer) has none."""
    if device is None:
        names = ["cpu"] + [g.device for g in gpus]
        if _torch() is not None and devices.mps_available():
            names.append("mps")
    else:
        names = [device]
    by_name = {g.device: g for g in gpus}
    return [by_name.get(n, n) for n in names if n in by_name or not n.startswith("cuda:")]


def snapshot(device: str | None = None, gpus=None, hung: str | None = None) -> MemorySnapshot:
    """Memory of ``device`` (canonical name, e.g. ``"cuda:0"``) or of every device.

    ``hung``: the note where listing the GPUs timed out (:func:`.nvml.bounded`); the
    GPUs' own figures are read in one bounded reading too.

    In a notebook::

        from gpumagic.devices.memory import snapshot
        snapshot()["cuda:0"].used        # bytes used on cuda:0, from NVML
        snapshot("cpu").rows[0].process  # this kernel's resident memory
    """
    gpus = devices.visible_gpus() if gpus is None else gpus
    chosen = targets(device, gpus)
    on_gpus = [t for t in chosen if not isinstance(t, str)]
    try:
        read = nvml.bounded(lambda: {t.device: device_memory(t) for t in on_gpus}, what="reading GPU memory") \
            if on_gpus else {}
    except nvml.NvmlTimeout as exc:
        hung = str(exc)
        read = {t.device: DeviceMemory(t.device, t.name, process_note="no answer") for t in on_gpus}
    rows = [read[t.device] if not isinstance(t, str) else device_memory(t) for t in chosen]
    notes = [r.note for r in rows if r.note] + ([hung] if hung else [])
    has_gpu = any(r.device.startswith("cuda:") for r in rows)
    if has_gpu and not devices.torch_cuda_initialized():
        notes.append("torch allocator figures appear once this kernel uses CUDA "
                     "(reading memory here never initialises it).")
    if any(r.process_note == "pid namespace" for r in rows):
        notes.append("this kernel's GPU share is n/a: NVML lists processes by pids "
                     "of another pid namespace (a container).")
    if device is None and not gpus and not hung:
        # With NVML working, the environment hid the GPUs (an empty or invalid CUDA_VISIBLE_DEVICES).
        reason = nvml.unavailable_reason() or devices.visible_devices_setting()
        notes.append(f"no GPU visible: {reason}.")
    return MemorySnapshot(rows, notes)
