"""How busy a device is, 0..1: NVML's GPU utilisation, the CPU's busy share since the last reading.

What the gauges' history line draws beside memory. NVML averages a GPU's
utilisation over its own sample period (1/6 s to 1 s), and a reading costs
tens of microseconds, several memory readings' worth: the monitor reads it
every :data:`EVERY` seconds (twice per 5 s step of the line), not at every
tick, so that a tick costs what it did before. Nothing here initialises CUDA.

In a notebook::

    from gpumagic.devices.utilization import reader
    busy = reader("cpu")
    busy()          # e.g. 0.12: 12 % of the CPU busy since the last call
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from . import nvml

logger = logging.getLogger(__name__)

__all__ = ["reader", "gpu_utilization", "CpuLoad", "EVERY"]

EVERY = 2.5   # seconds between utilisation readings of one device: two per step of the history line


def gpu_utilization(handle) -> float | None:
    """NVML's utilisation of the GPU behind ``handle`` (its SMs' busy share), 0..1; None where unsupported."""
    rates = nvml.query(nvml.lib().nvmlDeviceGetUtilizationRates, handle)
    return None if rates is None else min(max(rates.gpu / 100.0, 0.0), 1.0)


class CpuLoad:
    """The machine's CPU busy share between two calls (its own reference point: ``psutil.cpu_percent``'s
    is shared by every caller in the process)."""

    def __init__(self):
        import psutil
        self._psutil = psutil
        self._last = psutil.cpu_times()

    def __call__(self) -> float | None:
        now = self._psutil.cpu_times()
        total = sum(now) - sum(self._last)
        idle = (now.idle + getattr(now, "iowait", 0.0)) - (self._last.idle + getattr(self._last, "iowait", 0.0))
        self._last = now
        if total <= 0:
            return None   # read twice within a clock tick: nothing to tell yet
        return min(max(1.0 - idle / total, 0.0), 1.0)


def reader(target) -> Callable[[], float | None]:
    """A function that reads ``target``'s utilisation (``"cpu"``, ``"mps"`` or a Gpu); None where unknown."""
    if target == "cpu":
        return CpuLoad()
    handle = getattr(target, "handle", None)
    if handle is None:   # MPS, or a GPU NVML cannot read
        return lambda: None
    return lambda: gpu_utilization(handle)
