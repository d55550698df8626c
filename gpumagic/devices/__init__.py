"""Devices: discovery through NVML (matched to torch by UUID), facts, memory, pycuda.

``from gpumagic import devices`` gives the discovery API (:mod:`.discovery`)
and the per-device facts (:mod:`.facts`); the other modules (:mod:`.memory`,
:mod:`.nvml`, :mod:`.pycuda_query`, :mod:`.gpu_processes`) are imported by name
where they are needed.

In a notebook::

    from gpumagic import devices
    devices.visible_gpus()           # [Gpu(index=0, uuid='GPU-...', ...), ...]
    devices.parse_device("1")        # 'cuda:1'
"""
from __future__ import annotations

from .discovery import (
    Gpu,
    available_devices,
    current_device,
    default_device,
    parse_device,
    set_current_device,
    torch_cpu_only,
    torch_cuda_initialized,
    visible_gpus,
)
from .facts import cpu_facts, gpu_facts

__all__ = ["Gpu", "visible_gpus", "gpu_facts", "cpu_facts", "available_devices", "parse_device",
           "default_device", "current_device", "set_current_device", "torch_cuda_initialized", "torch_cpu_only"]
