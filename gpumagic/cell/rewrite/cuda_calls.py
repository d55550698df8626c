"""What ``torch.cuda`` and ``torch.accelerator`` calls answer in a cell that runs on DEVICE.

The rewrite (:mod:`.transform`) turns ``torch.cuda.get_device_name(0)``
into ``H.query(torch.cuda.get_device_name, 0)``: every method here gets the
original function first, so that without a target (:class:`~.placement.Placement`
passing through) the call is exactly the original. With a target, the device
stands in for "the GPU" of the notebook's author; per call:

===============================================  ====================  ==============================
call                                             DEVICE is cuda:k      DEVICE is cpu / meta / mps
===============================================  ====================  ==============================
``is_available()`` (both)                        True                  True
``device_count()`` (both)                        real count            1
``current_device()``, ``current_device_index()``  k                     0
``set_device(i)``, ``set_device_index(i)``       stays on k            nothing
``synchronize()`` (both)                         synchronises k        nothing (mps: synchronises)
``torch.cuda.device(i)``, ``device_index(i)``    device k              nothing
``current_accelerator()``                        ``cuda:k``            DEVICE (``.type``: its type)
``get_device_name(i)``                           k's name              the CPU's model; ``meta``
``memory_allocated()`` and the other counters    k's                   0: no CUDA allocator there
``empty_cache()``, ``reset_peak_memory_stats()``  on k                  nothing
``mem_get_info()``                               k's                   cpu: the machine's free/total
``get_device_properties()``, ``..._capability()``  k's                   an error that says why
``Stream()``, ``current_stream()``, ``Event()``  on k                  stand-ins (below)
``torch.cuda.stream(s)``, ``set_stream(s)``      torch's               nothing
``x.get_device()``                               torch's               0 for a tensor on DEVICE
``x.type()``, ``torch.typename(x)``              torch's               its CUDA type on DEVICE
===============================================  ====================  ==============================

On a device without streams, work runs in program order, so a stream has
nothing to order: :class:`HostStream` and :class:`HostEvent` take every call of
``torch.cuda.Stream`` and ``torch.cuda.Event`` and keep that promise trivially;
an event's ``elapsed_time`` is wall time between its records. None of this
touches ``torch.cuda`` when DEVICE is not a GPU, so CUDA never starts.
"""
from __future__ import annotations

import contextlib
import time

from .part import PlacementPart
from .values import said_cuda, said_cuda_name

__all__ = ["CudaCalls", "HostStream", "HostEvent", "NoCudaAnswer", "watch_streams", "unwatch_streams", "device_name"]

# Counters of torch's CUDA caching allocator: a device without one holds nothing in it.
_ZERO = frozenset({"memory_allocated", "memory_reserved", "memory_cached", "max_memory_allocated",
                   "max_memory_reserved", "max_memory_cached"})
_NOTHING = frozenset({"empty_cache", "empty_host_cache", "reset_peak_memory_stats", "reset_max_memory_allocated",
                      "reset_max_memory_cached", "reset_accumulated_memory_stats"})
_NO_DEVICE_ARGUMENT = frozenset({"empty_cache", "empty_host_cache"})
_cpu_name: list[str] = []
# The CUDA streams rewritten code made or made current, one list per ``--time`` cell running now (nested
# cells time themselves too): its end event waits for their work (gpumagic.ondevice.timing).
_watchers: list[list] = []


def watch_streams() -> list:
    """Start collecting the CUDA streams rewritten code makes (``torch.cuda.Stream()``) or makes current
    (``with torch.cuda.stream(s):``, ``set_stream(s)``) on a GPU DEVICE; returns the list they go in."""
    seen: list = []
    _watchers.append(seen)
    return seen


def unwatch_streams(seen: list) -> None:
    """Stop collecting into ``seen`` (nothing if it was stopped already)."""
    for i, watched in enumerate(_watchers):
        if watched is seen:
            del _watchers[i]
            return


def _watched(stream):
    for seen in _watchers:
        if not any(stream is s for s in seen):
            seen.append(stream)
    return stream


class NoCudaAnswer(RuntimeError):
    """A CUDA query that has no honest answer on the cell's device."""


def device_name(target) -> str:
    """What ``torch.cuda.get_device_name()`` says for a non-CUDA device: the CPU's model, else the type."""
    if target.type != "cpu":
        return {"mps": "Apple MPS"}.get(target.type, target.type)
    if not _cpu_name:
        from ...devices.facts import cpu_name  # the name alone: a utilisation reading may wait 0.1 s
        _cpu_name.append(cpu_name())
    return _cpu_name[0]


class HostEvent:
    """``torch.cuda.Event`` on a device without streams: recorded when the code gets there.

    Examples
    --------
    In a notebook::

        %%ondevice cpu
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); y = x @ x; end.record()
        start.elapsed_time(end)       # milliseconds, wall time (the CPU finished y already)
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False):
        self.enable_timing = enable_timing
        self.recorded_at: float | None = None

    def record(self, stream=None) -> None:
        self.recorded_at = time.perf_counter()

    def wait(self, stream=None) -> None:
        """Nothing to wait for: what came before has run."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end_event: HostEvent) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.recorded_at is None or end_event.recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event.recorded_at - self.recorded_at) * 1e3

    def __repr__(self):
        return f"HostEvent(recorded={self.recorded_at is not None})"


class HostStream:
    """``torch.cuda.Stream`` on a device without streams (cpu, meta): its work runs in program order.

    Waiting, recording and synchronising have nothing to do, and ``with
    torch.cuda.stream(s):`` changes nothing: code inside runs after what came
    before it, which is the promise a side stream only keeps with
    ``wait_stream``.
    """

    def __init__(self, device, priority: int = 0):
        self.device = device
        self.priority = priority

    def wait_stream(self, stream) -> None:
        """Nothing to wait for: what came before has run."""

    def wait_event(self, event) -> None:
        """Nothing to wait for."""

    def record_event(self, event=None) -> HostEvent:
        event = event if event is not None else HostEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def __repr__(self):
        return f"<HostStream on {self.device}: runs in program order>"


class CudaCalls(PlacementPart):
    """``torch.cuda`` / ``torch.accelerator`` calls of a :class:`~.placement.Placement` (see the module notes).

    Each method takes the original function first and calls it unchanged without a target.
    """


    # -- mixed precision --------------------------------------------------------
    def amp(self, fn, *args, **kwargs):
        """``torch.autocast('cuda', ...)``, ``torch.amp.GradScaler('cuda')``: on a CPU or meta DEVICE, the
        CPU's autocast and scaler (which run bf16 and fp16 too), not CUDA's, which would turn
        themselves off with a warning right after ``is_available()`` said True."""
        __tracebackhide__ = True
        if self.target is None or self._kind == "cuda":
            return fn(*args, **kwargs)
        if args:
            args = (self._amp_type(args[0]), *args[1:])
        for key in ("device_type", "device"):
            if key in kwargs:
                kwargs[key] = self._amp_type(kwargs[key])
        return fn(*args, **kwargs)

    def amp_cuda_autocast(self, fn, enabled=True, dtype=None, cache_enabled=True):
        """``torch.cuda.amp.autocast(...)``: ``torch.autocast('cpu', ...)`` off a GPU."""
        __tracebackhide__ = True
        if self.target is None or self._kind == "cuda":
            return fn(enabled, *([] if dtype is None else [dtype]), cache_enabled)
        return self._torch.autocast("cpu", dtype=dtype or self._torch.bfloat16, enabled=enabled,
                                    cache_enabled=cache_enabled)

    def amp_cuda_scaler(self, fn, *args, **kwargs):
        """``torch.cuda.amp.GradScaler(...)``: ``torch.amp.GradScaler('cpu', ...)`` off a GPU."""
        __tracebackhide__ = True
        if self.target is None or self._kind == "cuda":
            return fn(*args, **kwargs)
        return self._torch.amp.GradScaler("cpu", *args, **kwargs)

    def _amp_type(self, device):
        kind = device.type if isinstance(device, self._torch.device) else str(device).split(":")[0]
        return "cpu" if kind == "cuda" else kind

    # -- devices ----------------------------------------------------------------
    def cuda_is_available(self, fn) -> bool:
        __tracebackhide__ = True
        return fn() if self.target is None else True

    def cuda_device_count(self, fn) -> int:
        __tracebackhide__ = True
        return fn() if self.target is None or self._kind == "cuda" else 1

    def cuda_current_device(self, fn) -> int:
        __tracebackhide__ = True
        if self.target is None:
            return fn()
        return self.target.index if self._kind == "cuda" else 0

    def cuda_set_device(self, fn, device) -> None:
        __tracebackhide__ = True
        if self.target is None:
            return fn(device)
        if self._kind == "cuda":
            self._torch.cuda.set_device(self.target)
        return None

    def cuda_synchronize(self, fn, device=None) -> None:
        __tracebackhide__ = True
        if self.target is None:
            return fn(device)
        if self._kind == "cuda":
            self._torch.cuda.synchronize(self.target)
        elif self._kind == "mps":
            self._torch.mps.synchronize()
        return None

    def cuda_device(self, fn, device):
        """``with torch.cuda.device(i):`` and ``with torch.accelerator.device_index(i):``."""
        __tracebackhide__ = True
        if self.target is None:
            return fn(device)
        if self._kind == "cuda":
            return fn(self.target.index)
        return contextlib.nullcontext()

    def accelerator(self, fn, *args, **kwargs):
        """``torch.accelerator.current_accelerator()``: DEVICE (a value that stays the cell's device)."""
        __tracebackhide__ = True
        return fn(*args, **kwargs) if self.target is None else said_cuda(self.target)

    def accelerator_type(self, fn, *args, **kwargs):
        """``torch.accelerator.current_accelerator().type``: DEVICE's type, as the quickstart reads it."""
        __tracebackhide__ = True
        if self.target is None:
            return fn(*args, **kwargs).type
        return said_cuda_name(self.target.type)

    # -- queries ------------------------------------------------------------------
    def _on_target(self, fn, args: tuple, kwargs: dict):
        """``fn`` on the target GPU: a device given means DEVICE, and none given means DEVICE too."""
        __tracebackhide__ = True
        if args:
            args = (self.map(args[0]), *args[1:])
        elif "device" in kwargs:
            kwargs["device"] = self.map(kwargs["device"])
        elif getattr(fn, "__name__", "") not in _NO_DEVICE_ARGUMENT:
            args = (self.target,)
        return fn(*args, **kwargs)

    def query(self, fn, *args, **kwargs):
        """``get_device_name``, ``memory_allocated``, ``mem_get_info``... (see the module's table)."""
        __tracebackhide__ = True
        if self.target is None:
            return fn(*args, **kwargs)
        if self._kind == "cuda":
            return self._on_target(fn, args, kwargs)
        name = getattr(fn, "__name__", "")
        module = str(getattr(fn, "__module__", "torch.cuda")).removesuffix(".memory")   # torch.cuda.memory_...
        spelled = f"{module}.{name}()"
        if name == "get_device_name":
            return device_name(self.target)
        if name in _ZERO:
            return 0
        if name in _NOTHING:
            return None
        if name == "memory_stats":
            return {}
        if name == "memory_summary":
            return f"{self.target}: no CUDA caching allocator, nothing to summarise"
        if name in ("mem_get_info", "get_memory_info") and self._kind == "cpu":
            import psutil
            memory = psutil.virtual_memory()
            return memory.available, memory.total
        raise NoCudaAnswer(f"{spelled} has no answer under %%ondevice {self.target}: it asks about a GPU, "
                           f"and {self.target} is not one. Run the cell on a GPU (%%ondevice cuda:0), or leave "
                           "the call out of it.")

    # -- streams and events ---------------------------------------------------------
    def stream_new(self, fn, *args, **kwargs):
        """``torch.cuda.Stream(...)``."""
        __tracebackhide__ = True
        if self.target is None:
            return fn(*args, **kwargs)
        if self._kind == "cuda":
            return _watched(self._on_target(fn, args, kwargs))
        return HostStream(self.target, kwargs.get("priority", args[1] if len(args) > 1 else 0))

    def stream_current(self, fn, *args, **kwargs):
        """``torch.cuda.current_stream()``, ``default_stream()``, ``torch.accelerator.current_stream()``."""
        __tracebackhide__ = True
        if self.target is None:
            return fn(*args, **kwargs)
        if self._kind == "cuda":
            return self._on_target(fn, args, kwargs)
        return HostStream(self.target)

    def stream_use(self, fn, stream):
        """``with torch.cuda.stream(s):``."""
        __tracebackhide__ = True
        if self.target is None or (self._kind == "cuda" and not isinstance(stream, HostStream)):
            if self.target is not None and stream is not None:
                _watched(stream)
            return fn(stream)
        return contextlib.nullcontext()

    def stream_set(self, fn, stream) -> None:
        """``torch.cuda.set_stream(s)``, ``torch.accelerator.set_stream(s)``."""
        __tracebackhide__ = True
        if self.target is None or (self._kind == "cuda" and not isinstance(stream, HostStream)):
            if self.target is not None and stream is not None:
                _watched(stream)
            return fn(stream)
        return None

    def event_new(self, fn, *args, **kwargs):
        """``torch.cuda.Event(...)``."""
        __tracebackhide__ = True
        if self.target is None or self._kind == "cuda":
            return fn(*args, **kwargs)
        return HostEvent(*args, **kwargs)

    def record_stream(self, obj, stream) -> None:
        """``x.record_stream(s)``: nothing to record for a stand-in stream."""
        __tracebackhide__ = True
        if isinstance(stream, HostStream):
            return None
        return obj.record_stream(stream)

    def get_device(self, obj) -> int:
        """``x.get_device()``: 0 for a tensor on a non-CUDA DEVICE (which stands in for GPU 0)."""
        __tracebackhide__ = True
        if self.target is not None and self._kind != "cuda" and getattr(obj, "device", None) == self.target:
            return 0
        return obj.get_device()

    def type_name(self, obj) -> str:
        """``x.type()``: a tensor on a non-CUDA DEVICE names its CUDA type (``'torch.cuda.FloatTensor'``), as its
        ``is_cuda`` is True and ``get_device()`` 0; anything else answers as written."""
        __tracebackhide__ = True
        name = obj.type()
        if self.target is None or self._kind == "cuda" or not isinstance(obj, self._torch.Tensor) \
                or obj.device != self.target or not name.startswith("torch."):
            return name
        # 'torch.FloatTensor', 'torch.sparse.FloatTensor', 'torch.meta.FloatTensor' -> the same type on CUDA
        rest = name[len("torch."):]
        own = f"{self._kind}."
        return "torch.cuda." + (rest[len(own):] if rest.startswith(own) else rest)

    def typename(self, fn, obj) -> str:
        """``torch.typename(x)``: torch answers ``x.type()`` for a tensor, so it answers as :meth:`type_name`."""
        __tracebackhide__ = True
        if self.target is not None and fn is self._torch.typename and isinstance(obj, self._torch.Tensor):
            return self.type_name(obj)
        return fn(obj)
