"""Discover devices and parse device names, without touching CUDA.

GPUs are listed through NVML and numbered the way torch numbers them: NVML's
own order is PCI order, torch's follows ``CUDA_DEVICE_ORDER`` and
``CUDA_VISIBLE_DEVICES`` (integers, UUIDs or their prefixes, MIG ids), so GPUs
are matched by UUID and PCI bus id, never by index. Once the user has
initialised CUDA, torch's own UUIDs settle the mapping exactly. What
``%gpuinfo`` shows about each device is :mod:`.facts`.

Where torch is a CPU-only build, the GPUs are still listed (they exist and
``%gpuinfo`` shows them) but are never offered to cells: not the default
device, not among the valid choices.

Nothing here imports IPython's shell or creates a CUDA context.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from .. import session
from ..errors import usage_error
from . import nvml

logger = logging.getLogger(__name__)

__all__ = [
    "visible_devices_setting",
    "Gpu", "visible_gpus", "available_devices", "parse_device", "default_device", "current_device",
    "set_current_device", "torch_cuda_initialized", "normalize_bus_id", "multiprocessors", "mps_available",
    "torch_cpu_only", "cpu_only_note", "unchecked_gpu", "bounded_gpus",
]


@dataclass(frozen=True)
class Gpu:
    """One GPU as torch numbers it (``cuda:<index>``), with its NVML handle."""
    index: int
    uuid: str
    pci_bus_id: str | None
    name: str
    nvml_index: int | None = None
    mig: bool = False
    handle: Any = field(default=None, repr=False, compare=False)

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"


def torch_cuda_initialized() -> bool:
    """True when this process has initialised CUDA through torch (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except AttributeError:  # torch is half imported: another thread is importing it right now
        return False


def torch_cpu_only() -> bool:
    """True when torch is built without CUDA and ROCm, so no cell can run on a GPU NVML shows.

    Reads ``torch.version`` only: no driver call, no CUDA context. Imports torch.
    """
    try:
        import torch
    except ImportError:
        return False
    version = getattr(torch, "version", None)
    return getattr(version, "cuda", None) is None and getattr(version, "hip", None) is None


def cpu_only_note() -> str:
    """What ``%gpuinfo`` says about GPUs a CPU-only torch cannot use, and how to get a CUDA build."""
    import torch
    # Worded like the refusal in gpumagic.ondevice.run._check_torch_cuda.
    return (f"this torch ({torch.__version__}, CUDA not built) is a CPU-only build: cells cannot run on "
            "the GPUs shown, so they are not offered as devices. For a CUDA build, reinstall torch from "
            "PyPI, whose Linux wheels are built with CUDA: pip uninstall torch, then "
            "pip install torch --index-url https://pypi.org/simple")


def _usable(gpus: list[Gpu]) -> list[Gpu]:
    """The GPUs a cell can run on: none where torch is a CPU-only build."""
    return [] if gpus and torch_cpu_only() else gpus


def normalize_bus_id(bus_id: str | bytes | None) -> str | None:
    """``00000000:18:00.0`` (NVML) and ``0000:18:00.0`` (CUDA) -> ``0000:18:00.0``."""
    bus_id = nvml.text(bus_id)
    if not bus_id:
        return None
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 3:
        domain, bus, devfn = parts
        try:
            return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{devfn}"
        except ValueError:
            return bus_id.lower()
    return bus_id.lower()


def _nvml_physical_gpus(nv) -> list[dict]:
    """Every GPU NVML sees, in NVML's (PCI) order, with its MIG devices."""
    gpus = []
    count = nvml.query(nv.nvmlDeviceGetCount, default=0) or 0
    for i in range(count):
        handle = nvml.query(nv.nvmlDeviceGetHandleByIndex, i)
        if handle is None:
            continue
        pci = nvml.query(nv.nvmlDeviceGetPciInfo, handle)
        cc = nvml.query(nv.nvmlDeviceGetCudaComputeCapability, handle, default=(0, 0))
        entry = {
            "nvml_index": i,
            "handle": handle,
            "uuid": nvml.text(nvml.query(nv.nvmlDeviceGetUUID, handle)) or f"nvml-{i}",
            "name": nvml.text(nvml.query(nv.nvmlDeviceGetName, handle)) or "GPU",
            "pci_bus_id": normalize_bus_id(getattr(pci, "busId", None)),
            "cc": tuple(cc) if cc else (0, 0),
            "sms": multiprocessors(nv, handle) or 0,
            "migs": [],
        }
        mode = nvml.query(nv.nvmlDeviceGetMigMode, handle)
        if mode and mode[0]:
            for m in range(nvml.query(nv.nvmlDeviceGetMaxMigDeviceCount, handle, default=0) or 0):
                mh = nvml.query(nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, m)
                if mh is not None:
                    entry["migs"].append({
                        "handle": mh,
                        "uuid": nvml.text(nvml.query(nv.nvmlDeviceGetUUID, mh)) or f"MIG-{i}-{m}",
                        "name": nvml.text(nvml.query(nv.nvmlDeviceGetName, mh)) or entry["name"],
                    })
        gpus.append(entry)
    return gpus


# CUDA cores per multiprocessor by compute capability (as CUDA's deviceQuery sample tabulates).
_CORES_PER_SM = {(6, 0): 64, (6, 1): 128, (6, 2): 128, (7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64,
                 (8, 6): 128, (8, 7): 128, (8, 9): 128, (9, 0): 128, (10, 0): 128, (10, 3): 128,
                 (11, 0): 128, (12, 0): 128, (12, 1): 128}


def multiprocessors(nv, handle) -> int | None:
    """NVML reports multiprocessors only for MIG devices; elsewhere derive them from the core count."""
    attrs = nvml.query(getattr(nv, "nvmlDeviceGetAttributes", None) or (lambda h: None), handle)
    count = getattr(attrs, "multiprocessorCount", None) if attrs is not None else None
    if count:
        return count
    cores = nvml.query(getattr(nv, "nvmlDeviceGetNumGpuCores", None) or (lambda h: None), handle)
    cc = nvml.query(nv.nvmlDeviceGetCudaComputeCapability, handle)
    per_sm = _CORES_PER_SM.get(tuple(cc)) if cc else None
    return cores // per_sm if cores and per_sm else None


def _cuda_order(gpus: list[dict], order: str | None) -> list[dict]:
    """Order physical GPUs as CUDA enumerates them.

    ``PCI_BUS_ID`` is NVML's order. The default, ``FASTEST_FIRST``, puts the
    most capable GPUs first (compute capability, then multiprocessors) with
    PCI order breaking ties; on machines with identical GPUs both agree.
    """
    by_pci = sorted(gpus, key=lambda g: (g["pci_bus_id"] or "", g["nvml_index"]))
    if (order or "FASTEST_FIRST").strip().upper() == "PCI_BUS_ID":
        return by_pci
    return sorted(by_pci, key=lambda g: (-g["cc"][0], -g["cc"][1], -g["sms"]))


def visible_devices_setting() -> str:
    """``CUDA_VISIBLE_DEVICES`` as notes quote it: an empty value (which hides every GPU) shows."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if spec is None else f"CUDA_VISIBLE_DEVICES={spec!r}"


def _parse_visible(spec: str, ordered: list[dict]) -> list[tuple[dict, dict | None]]:
    """Apply ``CUDA_VISIBLE_DEVICES`` the way the CUDA driver does.

    Entries are ordinals into the CUDA order, ``GPU-`` UUIDs (or unique
    prefixes) or ``MIG-`` ids. An invalid entry ends the list; a repeated
    device makes the whole list empty. Returns (gpu, mig or None) pairs.
    """
    chosen: list[tuple[dict, dict | None]] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            break
        pick: tuple[dict, dict | None] | None = None
        lowered = item.lower()
        if lowered.startswith(("gpu-", "mig-")):
            candidates = []
            for g in ordered:
                if g["uuid"].lower().startswith(lowered):
                    candidates.append((g, None))
                for m in g["migs"]:
                    if m["uuid"].lower().startswith(lowered):
                        candidates.append((g, m))
            if len(candidates) == 1:
                pick = candidates[0]
        else:
            digits = ""
            for ch in item:
                if not ch.isdigit():
                    break
                digits += ch
            if digits and int(digits) < len(ordered):
                g = ordered[int(digits)]
                pick = (g, g["migs"][0] if g["migs"] else None)
        if pick is None:
            break
        key = (pick[0]["uuid"], pick[1]["uuid"] if pick[1] else None)
        if any((g["uuid"], m["uuid"] if m else None) == key for g, m in chosen):
            return []
        chosen.append(pick)
    return chosen


_visible_cache: tuple | None = None


def visible_gpus(environ: dict | None = None) -> list[Gpu]:
    """The GPUs torch can use, as ``cuda:0``, ``cuda:1``..., matched to NVML.

    Empty on a machine without NVML or GPUs. Never initialises CUDA. With the
    process environment, the answer is kept while what decides it is unchanged
    (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``, whether CUDA is initialised,
    the NVML library), so a cell magic pays microseconds, not an NVML round.
    While an NVML reading is stuck (:func:`.nvml.stuck_note`: a wedged driver),
    NVML is not asked: the GPUs are those torch knows, as without NVML.
    """
    global _visible_cache
    if environ is not None:
        return _discover(environ)
    key = (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"),
           torch_cuda_initialized(), nvml.generation)
    cached = _visible_cache
    if cached is None or cached[0] != key:
        if nvml.stuck_note() is not None:   # asking would hang this thread too; not kept for later
            return _torch_only_gpus()
        cached = _visible_cache = (key, _discover(os.environ))
    return list(cached[1])


def _discover(env) -> list[Gpu]:
    try:
        nv = nvml.lib()
    except nvml.NvmlUnavailable:
        return _torch_only_gpus()
    ordered = _cuda_order(_nvml_physical_gpus(nv), env.get("CUDA_DEVICE_ORDER"))
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        pairs = [(g, g["migs"][0] if g["migs"] else None) for g in ordered]
    else:
        pairs = _parse_visible(spec, ordered)
    gpus = [
        Gpu(index=i, uuid=(m or g)["uuid"], pci_bus_id=g["pci_bus_id"], name=(m or g)["name"],
            nvml_index=g["nvml_index"], mig=m is not None, handle=(m or g)["handle"])
        for i, (g, m) in enumerate(pairs)
    ]
    return _confirm_with_torch(gpus)


def _confirm_with_torch(gpus: list[Gpu]) -> list[Gpu]:
    """Where CUDA is already initialised, renumber by torch's own UUIDs (exact)."""
    if not gpus or not torch_cuda_initialized():
        return gpus
    import torch
    by_uuid = {g.uuid.lower().removeprefix("gpu-").removeprefix("mig-"): g for g in gpus}
    confirmed = []
    for i in range(torch.cuda.device_count()):
        try:
            uuid = str(torch.cuda.get_device_properties(i).uuid).lower()
        except Exception:
            logger.debug("torch gave no UUID for cuda:%d; keeping the NVML numbering", i, exc_info=True)
            return gpus
        g = by_uuid.get(uuid)
        if g is None:
            return gpus
        confirmed.append(Gpu(i, g.uuid, g.pci_bus_id, g.name, g.nvml_index, g.mig, g.handle))
    return confirmed


def _torch_only_gpus() -> list[Gpu]:
    """Without NVML, GPUs are known only if the user already initialised CUDA."""
    if not torch_cuda_initialized():
        return []
    import torch
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(Gpu(i, f"GPU-{props.uuid}", None, props.name))
    return gpus


def mps_available() -> bool:
    """True where torch can use Apple's MPS (imports torch if nothing has yet)."""
    torch = sys.modules.get("torch")
    if torch is None:
        import torch as imported
        torch = imported
    try:
        return bool(torch.backends.mps.is_available())
    except Exception:
        logger.debug("torch.backends.mps.is_available() failed; taking MPS as absent", exc_info=True)
        return False


def available_devices(gpus: list[Gpu] | None = None) -> list[str]:
    """Every device a cell can run on, e.g. ``['cpu', 'cuda:0', 'cuda:1', 'meta']``.

    GPUs are left out where torch is a CPU-only build (:func:`torch_cpu_only`).
    """
    gpus = visible_gpus() if gpus is None else gpus
    names = ["cpu"] + [g.device for g in _usable(gpus)]
    if mps_available():
        names.append("mps")
    names.append("meta")
    return names


def parse_device(spec, gpus: list[Gpu] | None = None) -> str:
    """Check ``spec`` against the devices that exist; return its canonical name.

    Accepts ``cpu``, ``cuda`` (or ``gpu``: the current GPU), ``cuda:N``, ``N``,
    ``mps``, ``meta`` and ``torch.device`` objects, in any case. Raises
    ``UsageError`` naming the devices that exist.

    >>> parse_device("0")            # doctest: +SKIP
    'cuda:0'
    """
    gpus = visible_gpus() if gpus is None else gpus
    text_spec = str(spec).strip().lower()
    shown = _shown(spec)

    def choices():  # listed only when there is an error to explain
        return available_devices(gpus)
    if text_spec.isdigit():
        text_spec = f"cuda:{text_spec}"
    if text_spec in ("cpu", "meta"):
        return text_spec
    if text_spec in ("mps", "mps:0"):
        if mps_available():
            return "mps"
        raise usage_error("device 'mps' is not available on this machine", choices())
    if text_spec == "cuda" or text_spec == "gpu":
        if not gpus:
            raise usage_error(f"device {shown} needs a GPU, and this machine has none visible", choices())
        picked = session.picked_device()
        return picked if picked and picked.startswith("cuda:") else "cuda:0"
    if text_spec.startswith("cuda:"):
        index = text_spec[5:]
        if not index.isdigit():
            raise usage_error(f"malformed device {shown}", choices())
        if not gpus:
            raise usage_error(f"device {text_spec!r} needs a GPU, and this machine has none visible", choices())
        if int(index) >= len(gpus):
            usable = "" if _usable(gpus) else ", none usable by this CPU-only torch"
            raise usage_error(f"device {text_spec!r} is out of range ({len(gpus)} GPU(s) visible{usable})",
                              choices())
        return f"cuda:{int(index)}"
    raise usage_error(f"unknown device {shown}", choices())


def unchecked_gpu(spec) -> str | None:
    """The GPU ``spec`` names (``cuda:N``), not checked against the GPUs there are: for when they cannot
    be listed (the driver does not answer). None where ``spec`` names no GPU."""
    text = str(spec).strip().lower()
    if text in ("cuda", "gpu"):
        picked = session.picked_device()
        return picked if picked and picked.startswith("cuda:") else "cuda:0"
    index = text[5:] if text.startswith("cuda:") else text
    return f"cuda:{int(index)}" if index.isdigit() else None


def bounded_gpus() -> tuple[list[Gpu], str | None]:
    """:func:`visible_gpus` read in a thread waited for at most :data:`.nvml.READ_TIMEOUT` seconds:
    ``(gpus, None)``, or ``([], note)`` where the driver did not answer (or an earlier reading is
    still stuck)."""
    try:
        return nvml.bounded(visible_gpus, what="listing the GPUs"), None
    except nvml.NvmlTimeout as exc:
        return [], str(exc)


def _shown(spec, most: int = 60) -> str:
    """``spec`` as an error message quotes it: at most ``most`` characters of it."""
    text = str(spec)
    return repr(text) if len(text) <= most else repr(text[:most]) + f"... ({len(text)} characters)"


def default_device(gpus: list[Gpu] | None = None) -> str:
    """The picked device, else ``cuda:0`` where torch can use a GPU, else ``cpu``."""
    picked = session.picked_device()
    if picked:
        return picked
    gpus = visible_gpus() if gpus is None else gpus
    return "cuda:0" if _usable(gpus) else "cpu"


def current_device():
    """The session's current device as a ``torch.device``.

    In a notebook::

        %gpuinfo                 # pick cuda:1 in the dropdown
        gpumagic.current_device()
        device(type='cuda', index=1)
    """
    import torch
    return torch.device(default_device())


def set_current_device(spec) -> str:
    """Make ``spec`` the device later gpumagic cells run on; returns its canonical name."""
    gpus = visible_gpus()
    name = parse_device(spec, gpus)
    if name.startswith("cuda:") and not _usable(gpus):
        import torch
        # Refused here, not at the next cell: a picked device every cell then fails on helps no one.
        raise usage_error(f"device {name!r} is not usable by this torch ({torch.__version__}, CUDA not built)",
                          available_devices(gpus))
    session.set_picked_device(name)
    return name
