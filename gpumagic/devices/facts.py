"""The facts ``%gpuinfo`` shows: every device, as plain data.

:func:`device_report` gathers them: :func:`gpu_facts` per GPU (NVML),
:func:`cpu_facts` for the CPU (psutil), :func:`system_facts` for the driver
and torch, and every CUDA attribute through pycuda on request. Everything
comes from NVML and psutil, so nothing here initialises CUDA; torch's
allocator figures (:func:`.memory.torch_allocator`) join once the user has.
Every NVML figure is read at once by :func:`read_nvml`, in a thread waited
for at most :data:`.nvml.READ_TIMEOUT` seconds: a wedged driver leaves the
report with what needs no NVML, and a note.
"""
from __future__ import annotations

import logging
import platform
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import nvml
from .discovery import (
    Gpu,
    cpu_only_note,
    default_device,
    multiprocessors,
    normalize_bus_id,
    torch_cpu_only,
    torch_cuda_initialized,
    visible_devices_setting,
    visible_gpus,
)
from .memory import torch_allocator

logger = logging.getLogger(__name__)

__all__ = ["device_report", "NvmlReading", "read_nvml", "gpu_facts", "cpu_facts", "system_facts",
           "prime_cpu_utilisation", "cpu_utilisation", "cpu_name"]

_OTHER_DEVICES = {"meta": "meta tensors (shapes only, no storage)", "mps": "Apple Metal"}


@dataclass
class NvmlReading:
    """Everything ``%gpuinfo`` reads from NVML, read at once (:func:`read_nvml`).

    ``gpus`` the visible GPUs, ``facts`` each one's :func:`gpu_facts` by device name,
    ``system`` the driver's versions and NVML's state, ``notes`` why GPUs are missing;
    ``hung`` the note where the driver did not answer (then all of them are empty).
    """
    gpus: list[Gpu] = field(default_factory=list)
    facts: dict[str, dict] = field(default_factory=dict)
    system: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    hung: str | None = None


def read_nvml() -> NvmlReading:
    """Read every NVML figure ``%gpuinfo`` shows, in a thread waited for at most :data:`.nvml.READ_TIMEOUT`
    seconds (:func:`.nvml.bounded`); where the driver does not answer, an empty reading with the note."""
    try:
        return nvml.bounded(_read_nvml, what="%gpuinfo's NVML reading")
    except nvml.NvmlTimeout as exc:
        note = str(exc)
        return NvmlReading(system={"driver_version": None, "cuda_driver_version": None, "nvml": note},
                           notes=[note], hung=note)


def _read_nvml() -> NvmlReading:
    # NVML only: no torch import here (a first import takes seconds, and would count against the bound).
    gpus = visible_gpus()
    reason = nvml.unavailable_reason()
    system = {"driver_version": None, "cuda_driver_version": None, "nvml": reason or "ok"}
    notes = []
    if reason is not None:
        notes.append(f"{reason}; GPU facts come from NVML (nvidia-ml-py and an NVIDIA driver)")
    else:
        if not gpus:
            notes.append(f"NVML sees no GPU visible to this process ({visible_devices_setting()})")
        nv = nvml.lib()
        system["driver_version"] = nvml.text(nvml.query(nv.nvmlSystemGetDriverVersion))
        cuda = nvml.query(nv.nvmlSystemGetCudaDriverVersion)
        if cuda:
            system["cuda_driver_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    facts = {gpu.device: gpu_facts(gpu, gpus) if reason is None else
             {"device": gpu.device, "name": gpu.name, "uuid": gpu.uuid} for gpu in gpus}
    return NvmlReading(gpus, facts, system, notes)


def device_report(device: str | None = None, with_pycuda: bool = False,
                  reading: NvmlReading | None = None) -> dict:
    """``{"system": {...}, "devices": [cpu facts, cuda:0 facts, ...], "notes": [...]}``.

    ``system["current_device"]`` is the device later gpumagic cells run on.

    ``device`` (a canonical name from :func:`~.discovery.parse_device`) keeps one
    device; ``with_pycuda`` adds every CUDA attribute under ``"attributes"``.
    ``reading`` is NVML's part, read by :func:`read_nvml` where not given: where
    the driver did not answer, the report holds what needs no NVML and says so.

    Examples
    --------
    >>> report = device_report()                     # doctest: +SKIP
    >>> [d["device"] for d in report["devices"]]     # doctest: +SKIP
    ['cpu', 'cuda:0', 'cuda:1']
    """
    reading = read_nvml() if reading is None else reading
    gpus = reading.gpus
    system = system_facts(reading)
    system["current_device"] = default_device(gpus)   # where gpumagic cells run: what the picker shows
    found: list[dict] = []
    notes = list(reading.notes)
    if gpus and not reading.notes and torch_cpu_only():
        notes.append(cpu_only_note())
    if device in (None, "cpu"):
        found.append(cpu_facts())
    for gpu in gpus:
        if device in (None, gpu.device):
            facts = dict(reading.facts[gpu.device])
            if torch_cuda_initialized():  # the allocator rows: None (n/a) where torch cannot answer
                facts["torch_allocated"], facts["torch_reserved"], facts["torch_peak"] = torch_allocator(gpu.index)
            found.append(facts)
    if device in ("meta", "mps"):
        found.append({"device": device, "name": _OTHER_DEVICES[device]})
    report = {"system": system, "devices": found, "notes": notes}
    if with_pycuda and reading.hung is None:   # pycuda would ask the same driver (in a subprocess, bounded)
        _add_pycuda(report)
    return report


def _add_pycuda(report: dict) -> None:
    from .pycuda_query import INSTALL_HINT, pycuda_attributes, pycuda_installed
    if not pycuda_installed():
        report["notes"].append(INSTALL_HINT)
        return
    gpus = [d for d in report["devices"] if d["device"].startswith("cuda:")]
    if not gpus:
        report["notes"].append("pycuda is installed, but there is no GPU to query")
        return
    try:
        by_bus = pycuda_attributes()
    except Exception as exc:  # driver missing, query timed out...
        logger.debug("the pycuda query failed; the report says so in a note", exc_info=True)
        report["notes"].append(str(exc))
        return
    for facts in gpus:
        entry = by_bus.get(facts.get("pci_bus_id"))
        if entry is not None:
            facts["attributes"] = entry["attributes"]
            facts.setdefault("pycuda_version", entry["pycuda_version"])


def _mhz_pair(nv, handle, clock) -> tuple:
    return (nvml.query(nv.nvmlDeviceGetClockInfo, handle, clock),
            nvml.query(nv.nvmlDeviceGetMaxClockInfo, handle, clock))


def gpu_facts(gpu: Gpu, gpus: list[Gpu] | None = None) -> dict:
    """Everything people look up about ``gpu``; unsupported fields are ``None``.

    Memory in bytes, power in watts, clocks in MHz, utilisation in percent.
    """
    nv = nvml.lib()
    h = gpu.handle
    mem = nvml.query(nv.nvmlDeviceGetMemoryInfo, h)
    util = nvml.query(nv.nvmlDeviceGetUtilizationRates, h)
    cc = nvml.query(nv.nvmlDeviceGetCudaComputeCapability, h)
    power = nvml.query(nv.nvmlDeviceGetPowerUsage, h)
    limit = nvml.query(nv.nvmlDeviceGetEnforcedPowerLimit, h)
    sm_now, sm_max = _mhz_pair(nv, h, getattr(nv, "NVML_CLOCK_SM", 1))
    mem_now, mem_max = _mhz_pair(nv, h, getattr(nv, "NVML_CLOCK_MEM", 2))
    facts = {
        "device": gpu.device,
        "name": gpu.name,
        "uuid": gpu.uuid,
        "pci_bus_id": gpu.pci_bus_id,
        "mig": gpu.mig,
        "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
        "multiprocessors": multiprocessors(nv, h),
        "memory_total": getattr(mem, "total", None),
        "memory_used": getattr(mem, "used", None),
        "memory_free": getattr(mem, "free", None),
        "utilization_gpu": getattr(util, "gpu", None),
        "utilization_memory": getattr(util, "memory", None),
        "temperature_c": nvml.query(nv.nvmlDeviceGetTemperature, h, getattr(nv, "NVML_TEMPERATURE_GPU", 0)),
        "power_w": power / 1000 if power is not None else None,
        "power_limit_w": limit / 1000 if limit is not None else None,
        "clock_sm_mhz": sm_now, "clock_sm_max_mhz": sm_max,
        "clock_mem_mhz": mem_now, "clock_mem_max_mhz": mem_max,
        "pcie_generation": nvml.query(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
        "pcie_width": nvml.query(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
        "nvlink_peers": _nvlink_peers(nv, h, gpus or []),
    }
    if facts["multiprocessors"] is None and torch_cuda_initialized():
        import torch
        facts["multiprocessors"] = torch.cuda.get_device_properties(gpu.index).multi_processor_count
    return facts


def _nvlink_peers(nv, handle, gpus: list[Gpu]) -> dict | None:
    """``{"cuda:1": 18}``: active NVLink links per peer GPU.

    The far end of a link is read by PCI bus id. Where NVML cannot say (links
    into an NVSwitch fabric, or a virtual machine, report ``ffffffff:ff:ff.0``),
    GPUs that NVML says are peers over NVLink share all the active links.
    """
    max_links = getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)
    enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
    by_bus = {g.pci_bus_id: g.device for g in gpus if g.pci_bus_id}
    peers: dict[str, int] = {}
    active = 0
    unknown = 0
    supported = False
    for link in range(max_links):
        state = nvml.query(nv.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            continue
        supported = True
        if state != enabled:
            continue
        active += 1
        remote = nvml.query(nv.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        bus = normalize_bus_id(getattr(remote, "busId", None))
        if bus in by_bus:
            peers[by_bus[bus]] = peers.get(by_bus[bus], 0) + 1
        else:
            unknown += 1
    if not supported:
        return None
    if unknown:
        p2p = getattr(nv, "nvmlDeviceGetP2PStatus", None)
        nvlink_index = getattr(nv, "NVML_P2P_CAPS_INDEX_NVLINK", 3)
        ok = getattr(nv, "NVML_P2P_STATUS_OK", 0)
        fabric_peers = [g.device for g in gpus if g.handle is not None and g.handle is not handle
                        and p2p is not None and nvml.query(p2p, handle, g.handle, nvlink_index) == ok]
        for device in fabric_peers:
            peers[device] = peers.get(device, 0) + unknown
        if not fabric_peers:
            peers["other"] = unknown
    return peers


def system_facts(reading: NvmlReading | None = None) -> dict:
    """Driver and CUDA versions (NVML, from ``reading``: read now where not given) and torch's version
    (imports torch, not CUDA)."""
    reading = read_nvml() if reading is None else reading
    facts: dict[str, Any] = {"driver_version": None, "cuda_driver_version": None, "nvml": "ok", **reading.system}
    import torch
    facts["torch_version"] = torch.__version__
    facts["torch_cuda_version"] = torch.version.cuda
    facts["cuda_initialized"] = torch_cuda_initialized()
    return facts


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else what :mod:`platform` says); reads no utilisation."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:   # not Linux, or /proc hidden: platform's answer
        logger.debug("could not read /proc/cpuinfo for the CPU's name", exc_info=True)
    return name


def cpu_facts() -> dict:
    """The CPU as a device: name, cores, memory of the machine and of this kernel, and its busy share
    (:func:`cpu_utilisation`; ``utilization_cpu_seconds`` is the window it covers)."""
    import psutil
    busy, window = cpu_utilisation()
    vm = psutil.virtual_memory()
    name = cpu_name()
    return {
        "device": "cpu",
        "name": name,
        "cores_logical": psutil.cpu_count(logical=True),
        "cores_physical": psutil.cpu_count(logical=False),
        "memory_total": vm.total,
        "memory_used": vm.total - vm.available,
        "memory_free": vm.available,
        "process_rss": psutil.Process().memory_info().rss,
        "utilization_cpu": busy,
        "utilization_cpu_seconds": round(window, 3),
    }


# The CPU's busy share is measured between two readings of its times, as psutil.cpu_percent(interval=None)
# does, but from a baseline of gpumagic's own: psutil's is taken when psutil is imported (its first call
# in a fresh process reads 0.0 over a window of microseconds), per thread, and moved by the user's calls.
CPU_SAMPLE_MIN = 0.1   # seconds: a shorter window holds a tick or two of the kernel's 10 ms clock, noise
_cpu_lock = threading.Lock()
_cpu_base: tuple[float, Any] | None = None             # (monotonic time, psutil.cpu_times()) of the last reading
_cpu_last: tuple[float, float | None, float] | None = None   # (time, percent, window) of the last reading


def prime_cpu_utilisation() -> None:
    """Start the CPU's first busy-time window (when the extension loads), so the first reading covers the
    time since then instead of none."""
    global _cpu_base
    import psutil
    with _cpu_lock:
        if _cpu_base is None:
            _cpu_base = (time.monotonic(), psutil.cpu_times())


def _busy_and_total(times) -> tuple[float, float]:
    fields = times._asdict()
    # As psutil counts: guest time is already in user time (Linux), iowait is idle.
    total = sum(fields.values()) - fields.get("guest", 0.0) - fields.get("guest_nice", 0.0)
    return total - fields.get("idle", 0.0) - fields.get("iowait", 0.0), total


def cpu_utilisation() -> tuple[float | None, float]:
    """``(percent, seconds)``: the share of all cores' time spent busy since the previous reading (or since
    :func:`prime_cpu_utilisation`), and how long that window was.

    A window shorter than :data:`CPU_SAMPLE_MIN` says nothing, so a reading that recent is given again,
    and where there is none the call waits until the window is that long (at most 0.1 s: the first
    reading of a process that never primed, or ``%load_ext`` and ``%gpuinfo`` in one cell).
    ``percent`` is None where the clock did not advance.
    """
    global _cpu_base, _cpu_last
    import psutil
    with _cpu_lock:   # held while waiting: a concurrent caller then gets this reading
        now = time.monotonic()
        if _cpu_last is not None and now - _cpu_last[0] < CPU_SAMPLE_MIN:
            return _cpu_last[1], _cpu_last[2]
        base = _cpu_base or (now, psutil.cpu_times())
        if now - base[0] < CPU_SAMPLE_MIN:
            time.sleep(CPU_SAMPLE_MIN - (now - base[0]))
        now, times = time.monotonic(), psutil.cpu_times()
        (busy0, total0), (busy1, total1) = _busy_and_total(base[1]), _busy_and_total(times)
        percent = round(min(100.0, max(0.0, 100 * (busy1 - busy0) / (total1 - total0))), 1) \
            if total1 > total0 else None
        _cpu_base, _cpu_last = (now, times), (now, percent, now - base[0])
        return percent, now - base[0]
