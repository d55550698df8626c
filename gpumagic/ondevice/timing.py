"""Honest timing of a cell on an asynchronous device.

On a GPU the cell's Python code returns long before its kernels finish, so
the wall time of the code alone says little. :class:`CellTimer` waits for the
device to be idle before starting (earlier cells' queued work is not
counted), records CUDA events on the cell's stream around it, and
synchronises the device at the end: the report gives the events' time, the
wall time until the device finished, and when the Python code returned.
Work the cell queued on streams of its own (``s = torch.cuda.Stream()``,
``with torch.cuda.stream(s):``) counts in the events' time too: the end event
is recorded after the cell's stream waits for those streams, which the
placement collects (:func:`~gpumagic.cell.rewrite.cuda_calls.watch_streams`). A
stream only code outside the rewrite uses is not seen; the wall time, which
waits for every stream of the device, still covers it.
Time torch.compile spent compiling in the cell is said apart: it is in every
one of those times, and later runs of the same code skip it.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from ..cell.rewrite.cuda_calls import unwatch_streams, watch_streams

__all__ = ["Timing", "CellTimer"]

logger = logging.getLogger(__name__)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.2f} s"


# torch's outermost compile timers: a frame's graph (dynamo and inductor), and a backward compiled lazily.
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def _compile_times() -> dict:
    """torch's lists of compile times by timer (none before dynamo is imported: nothing compiled then)."""
    metrics = getattr(sys.modules.get("torch._dynamo.utils"), "compilation_time_metrics", None)
    return metrics if isinstance(metrics, dict) else {}


def _compile_marks() -> dict:
    times = _compile_times()
    return {name: (times[name], len(times[name])) for name in _COMPILE_TIMERS if name in times}


def _compiled_since(marks: dict) -> float:
    """Seconds torch.compile spent compiling since :func:`_compile_marks` gave ``marks``; a list that
    ``torch.compiler.reset()`` replaced in between counts whole."""
    total = 0.0
    for name in _COMPILE_TIMERS:
        times = _compile_times().get(name) or []
        was, count = marks.get(name, (None, 0))
        total += sum(times[count:] if times is was else times)
    return total


@dataclass
class Timing:
    """A cell's times, in seconds. ``device_s`` is None where there are no events."""
    device: str
    wall_s: float              # start -> device finished
    returned_s: float          # start -> the cell's Python code returned
    device_s: float | None = None
    method: str = "wall clock"
    compile_s: float = 0.0     # of those, torch.compile compiling

    def __str__(self):
        compiling = f"; {_ms(self.compile_s)} of it compiling (torch.compile)" if self.compile_s >= 0.0005 else ""
        return self._times() + compiling

    def _times(self) -> str:
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
    """``start()`` before the cell, ``stop()`` after it (on the stream that was current at start);
    ``close()`` where the cell failed, so that it stops collecting the cell's streams.

    Examples
    --------
    ::

        timer = CellTimer("cuda:0")
        timer.start()
        run_the_cell()
        print(timer.stop())      # cuda:0: 151.92 ms (CUDA events); wall 152.10 ms ...
    """

    def __init__(self, device) -> None:
        import torch
        self._torch = torch
        self.device = torch.device(device)
        self._events: tuple | None = None   # (begin, end, the cell's stream) on CUDA
        self._streams: list | None = None   # streams the cell's code made or made current (CUDA only)
        self._t0 = 0.0
        self._compile_marks: dict = {}

    def _synchronize(self):
        torch = self._torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    def start(self) -> None:
        torch = self._torch
        self._synchronize()
        self._compile_marks = _compile_marks()
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            self._events = (begin, end, stream)
            self._streams = watch_streams()
            self._t0 = time.perf_counter()
            begin.record(stream)
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> Timing:
        returned = time.perf_counter() - self._t0
        name = str(self.device)
        compiled = _compiled_since(self._compile_marks)
        if self._events is not None:
            begin, end, stream = self._events
            joined = self._join(stream)
            end.record(stream)
            self._synchronize()
            wall = time.perf_counter() - self._t0
            method = "CUDA events" + (f", {joined} side stream{'s' * (joined > 1)} joined" if joined else "")
            return Timing(name, wall, returned, begin.elapsed_time(end) / 1e3, method, compiled)
        if self.device.type == "mps":
            self._synchronize()
            return Timing(name, time.perf_counter() - self._t0, returned, None, "synchronised", compiled)
        return Timing(name, returned, returned, None, "wall clock", compiled)

    def _join(self, stream) -> int:
        """Make ``stream`` wait for the cell's own streams on the device, so the end event follows their
        work; returns how many it waits for."""
        streams, self._streams = self._streams, None
        if streams is None:
            return 0
        unwatch_streams(streams)   # (the list itself: an empty one is still registered)
        joined = 0
        for side in streams:
            if side == stream or getattr(side, "device", None) != self.device:
                continue
            try:
                stream.wait_stream(side)
            except (RuntimeError, TypeError, AttributeError):
                logger.warning("--time: could not order %r after %r; the events' time may leave its work out",
                               stream, side, exc_info=True)
                continue
            joined += 1
        return joined

    def close(self) -> None:
        """Stop collecting the cell's streams (where ``stop()`` did not run: the cell failed)."""
        if self._streams is not None:
            unwatch_streams(self._streams)
            self._streams = None
