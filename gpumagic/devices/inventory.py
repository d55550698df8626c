"""The facts ``%gpuinfo`` shows: every device, as plain data.

Everything comes from NVML and psutil, so nothing here initialises CUDA.
"""
from __future__ import annotations

from . import discovery as devices
from . import nvml

__all__ = ["device_report"]


def device_report(device: str | None = None, with_pycuda: bool = False) -> dict:
    """``{"system": {...}, "devices": [cpu facts, cuda:0 facts, ...], "notes": [...]}``.

    ``device`` (a canonical name from :func:`devices.parse_device`) keeps one
    device; ``with_pycuda`` adds every CUDA attribute under ``"attributes"``.

    Examples
    --------
    >>> report = device_report()                     # doctest: +SKIP
    >>> [d["device"] for d in report["devices"]]     # doctest: +SKIP
    ['cpu', 'cuda:0', 'cuda:1']
    """
    gpus = devices.visible_gpus()
    report = {"system": devices.system_facts(), "devices": [], "notes": []}
    if not nvml.available():
        report["notes"].append(f"{nvml.unavailable_reason()}; GPU facts come from NVML (nvidia-ml-py and an NVIDIA driver)")
    elif not gpus:
        report["notes"].append("NVML sees no GPU visible to this process (CUDA_VISIBLE_DEVICES="
                               f"{__import__('os').environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if device in (None, "cpu"):
        report["devices"].append(devices.cpu_facts())
    for gpu in gpus:
        if device in (None, gpu.device):
            facts = devices.gpu_facts(gpu, gpus) if nvml.available() else {"device": gpu.device, "name": gpu.name, "uuid": gpu.uuid}
            facts.update(_torch_allocator(gpu.index))
            report["devices"].append(facts)
    if device in ("meta", "mps"):
        report["devices"].append({"device": device, "name": "meta tensors (shapes only, no storage)" if device == "meta" else "Apple Metal"})
    if with_pycuda:
        _add_pycuda(report)
    return report


def _torch_allocator(index: int) -> dict:
    """torch's caching-allocator figures, only where the user already initialised CUDA."""
    if not devices.torch_cuda_initialized():
        return {}
    import torch
    return {
        "torch_allocated": torch.cuda.memory_allocated(index),
        "torch_reserved": torch.cuda.memory_reserved(index),
        "torch_peak": torch.cuda.max_memory_allocated(index),
    }


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
        report["notes"].append(str(exc))
        return
    for facts in gpus:
        entry = by_bus.get(facts.get("pci_bus_id"))
        if entry is not None:
            facts["attributes"] = entry["attributes"]
            facts.setdefault("pycuda_version", entry["pycuda_version"])
