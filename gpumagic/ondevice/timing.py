"""Honest timing of a cell on an asynchronous device.

On a GPU the cell's Python code returns long before its kernels finish, so
the wall time of the code alone says little. :class:`CellTimer` waits for the
device to be idle before starting (earlier cells' queued work is not
counted), records CUDA events on the cell's stream around it, and
synchronises the device at the end: the report gives the events' time, the
wall time until the device finished, and when the Python code returned.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Timing", "CellTimer"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.2f} s"


@dataclass
class Timing:
    """A cell's times, in seconds. ``device_s`` is None where there are no events."""
    device: str
    wall_s: float              # start -> device finished
    returned_s: float          # start -> the cell's Python code returned
    device_s: float | None = None
    method: str = "wall clock"

    def __str__(self):
        if self.device_s is not None:
            return (f"{self.device}: {_ms(self.device_s)} ({self.method}); wall {_ms(self.wall_s)} "
                    f"until the device finished; Python returned after {_ms(self.returned_s)}")
        if self.method == "synchronised":
            return (f"{self.device}: wall {_ms(self.wall_s)} until the device finished "
                    f"(synchronised); Python returned after {_ms(self.returned_s)}")
        return f"{self.device}: wall {_ms(self.wall_s)}"

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


class CellTimer:
    """``start()`` before the cell, ``stop()`` after it (on the stream that was current at start).

    Examples
    --------
    ::

        timer = CellTimer("cuda:0")
        timer.start()
        run_the_cell()
        print(timer.stop())      # cuda:0: 151.92 ms (CUDA events); wall 152.10 ms ...
    """

    def __init__(self, device):
        import torch
        self._torch = torch
        self.device = torch.device(device)
        self._events = None
        self._t0 = 0.0

    def _synchronize(self):
        torch = self._torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    def start(self) -> None:
        torch = self._torch
        self._synchronize()
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            self._events = (begin, end, stream)
            self._t0 = time.perf_counter()
            begin.record(stream)
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> Timing:
        returned = time.perf_counter() - self._t0
        name = str(self.device)
        if self._events is not None:
            begin, end, stream = self._events
            end.record(stream)
            self._synchronize()
            wall = time.perf_counter() - self._t0
            return Timing(name, wall, returned, begin.elapsed_time(end) / 1e3, "CUDA events")
        if self.device.type == "mps":
            self._synchronize()
            return Timing(name, time.perf_counter() - self._t0, returned, None, "synchronised")
        return Timing(name, returned, returned, None, "wall clock")
