"""Run code on a side stream of a CUDA device, in order with the stream around it.

The race in torch's CUDA semantics notes::

    A = torch.empty((100, 100), device=cuda).normal_(0.0, 1.0)
    with torch.cuda.stream(s):
        B = torch.sum(A)          # may start before normal_() finishes

cannot happen inside :func:`side_stream`: on entry the side stream waits for
the current stream (everything queued before, such as ``normal_``), on exit
the current stream waits for the side stream (everything after sees the
results), and tensors the code leaves behind are ``record_stream``-ed on the
current stream, so the caching allocator does not hand their memory to
another stream while the current stream may still use it.

The side stream is made once per device and reused, so the memory the
caching allocator keeps for it (blocks are cached per stream) serves the
next ``--stream`` cell instead of piling up in a new stream's pool.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

__all__ = ["side_stream", "SideStream", "tensors_in", "record_on"]

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_streams: dict[int, object] = {}   # device index -> torch.cuda.Stream


@dataclass
class SideStream:
    """What :func:`side_stream` yields: the two streams, and what was recorded at exit."""
    stream: object            # the side stream the code runs on
    current: object           # the stream that was current before
    recorded: int = 0         # tensors record_stream-ed on ``current`` at exit
    extra: list = field(default_factory=list)   # values to protect besides changed names


def _side_stream_for(torch, index: int):
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            _streams[index] = stream
        return stream


def tensors_in(value, device, *, limit: int = 10_000) -> list:
    """Tensors on ``device`` reachable from ``value``: itself, a module's parameters,
    buffers and gradients, an optimizer's state, and lists/tuples/sets/dicts of those
    (three levels deep, at most ``limit`` items looked at)."""
    import torch
    finder = _TensorFinder(torch, torch.device(device), limit)
    finder.walk(value, 0)
    return list(finder.found.values())


class _TensorFinder:
    """The walk of :func:`tensors_in`: each tensor (and its gradient) once, within a budget of items."""

    def __init__(self, torch, device, limit: int):
        self.torch, self.device, self.budget = torch, device, limit
        self.found: dict[int, object] = {}

    def add(self, t) -> None:
        if isinstance(t, self.torch.Tensor) and t.device == self.device:
            self.found.setdefault(id(t), t)
            grad = t.grad if t.is_leaf or t.retains_grad else None
            if grad is not None and grad.device == self.device:
                self.found.setdefault(id(grad), grad)

    def walk(self, v, depth: int) -> None:
        self.budget -= 1
        if self.budget < 0:
            return
        torch = self.torch
        if isinstance(v, torch.Tensor):
            self.add(v)
        elif isinstance(v, torch.nn.Module):
            for t in (*v.parameters(), *v.buffers()):
                self.add(t)
        elif isinstance(v, torch.optim.Optimizer):
            for state in v.state.values():
                self.walk(state, depth + 1)
        elif depth < 3 and isinstance(v, (list, tuple, set, frozenset, dict)):
            for item in (v.values() if isinstance(v, dict) else v):
                self.walk(item, depth + 1)


def record_on(tensors, stream) -> int:
    """``t.record_stream(stream)`` for each tensor; returns how many were recorded."""
    count = 0
    for t in tensors:
        try:
            t.record_stream(stream)
            count += 1
        except RuntimeError as exc:   # memory torch's allocator does not own (from_blob, DLPack)
            logger.debug("record_stream skipped a tensor of %s: %s", tuple(t.shape), exc)
    return count


def _changed(namespace: dict, before: dict) -> list:
    """Values bound to names that are new or rebound since ``before`` (name -> id)."""
    return [v for k, v in namespace.items() if before.get(k) != id(v)]


@contextlib.contextmanager
def side_stream(device, namespace: dict | None = None, also=(), wait: bool = True):
    """Make a side stream of ``device`` current for the block, ordered as the module says.

    ``namespace`` (the notebook's ``user_ns``): tensors bound to new or
    rebound names there after the block, and tensors inside ``also`` (e.g.
    modules and optimizers the block used), are ``record_stream``-ed on the
    current stream. Append to the yielded ``SideStream.extra`` to protect more
    (the cell's value). The previous current stream is restored, whether the
    block succeeded or not.

    ``wait=False`` skips both waits; it exists to show the race they prevent.

    Examples
    --------
    ::

        with side_stream("cuda:0", shell.user_ns):
            B = torch.sum(A)       # runs after everything queued before
    """
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"side streams need a CUDA device, not {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(index)
    side = _side_stream_for(torch, index)
    if wait:
        side.wait_stream(current)
    before = {k: id(v) for k, v in namespace.items()} if namespace is not None else None
    info = SideStream(stream=side, current=current)
    torch.cuda.set_stream(side)
    try:
        yield info
    finally:
        torch.cuda.set_stream(current)
        if wait:
            current.wait_stream(side)
            values = list(also) + info.extra
            if namespace is not None and before is not None:
                values += _changed(namespace, before)
            seen: dict[int, object] = {}
            for value in values:
                for t in tensors_in(value, torch.device("cuda", index)):
                    seen.setdefault(id(t), t)
            info.recorded = record_on(seen.values(), current)
