"""Moving tensor storages to another device in place: the same tensor objects, one copy per storage.

What an object reaches is gathered by storage (:func:`gather`): the tensor
objects over each storage (views and tied weights share one), and the tensors
an autograd graph saved for backward. :func:`move` copies each storage once and
points every one of them at the copy:

* a tensor object through ``t.data = copy`` (as ``nn.Module._apply`` does; torch
  refuses a cross-device ``set_``), so parameters, modules and optimizer state
  keyed by parameters stay the same objects;
* a saved tensor through ``SavedTensor.register_hooks``: the graph keeps the copy
  and hands the tensor back on its old device should ``backward()`` need it.

What cannot move is named with the reason (a sparse tensor, a wrapper subclass,
a saved tensor a hook already packed). Copies from a GPU into pageable memory go
through two pinned buffers, so the GPU copies at pinned speed while the CPU
copies the other buffer out.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .storages import Collector

logger = logging.getLogger(__name__)

__all__ = ["StorageGroup", "MoveResult", "gather", "move", "interrupts_held"]

STAGE_BYTES = 64 << 20   # each of the two pinned buffers a GPU-to-pageable copy goes through


@dataclass
class StorageGroup:
    """One storage and everything over it: ``tensors`` (objects) and ``saved`` (SavedTensor, tensor)."""
    key: tuple
    device: str
    nbytes: int
    tensors: list = field(default_factory=list)
    saved: list = field(default_factory=list)
    unmovable: str | None = None   # why it cannot move, where it cannot


@dataclass
class MoveResult:
    """What :func:`move` did: bytes moved per source device, what stayed and why, and how fast."""
    moved: dict[str, int] = field(default_factory=dict)
    tensors: int = 0
    saved: int = 0
    stayed: list[tuple[str, int, str]] = field(default_factory=list)   # (device, bytes, why)
    seconds: float = 0.0
    alloc_seconds: float = 0.0  # allocating the copies (pinned host memory is slow to allocate)
    copy_seconds: float = 0.0   # the copies alone, until every device was done
    placed: dict[tuple, tuple] = field(default_factory=dict)   # old storage key -> new (device, data_ptr)

    @property
    def moved_bytes(self) -> int:
        return sum(self.moved.values())

    @property
    def rate(self) -> float | None:
        """Bytes per second over the copies (None where nothing was copied)."""
        return self.moved_bytes / self.copy_seconds if self.copy_seconds > 0 and self.moved_bytes else None


class _Gatherer(Collector):
    """A :class:`Collector` that keeps the tensor objects and saved tensors it meets, by storage."""

    def __init__(self, torch, groups: dict[tuple, StorageGroup], **kwargs):
        super().__init__(torch, **kwargs)
        self.groups = groups
        self.unmovable: list = []      # tensors without a plain storage (sparse, wrapper subclasses)
        self._inside_unmovable = 0
        self._tensor_ids: set[int] = set()   # the tensors themselves are kept in the groups: ids stay unique
        self.graph.on_saved = self._saved

    def add_tensor(self, t, part: str, into: dict | None = None) -> None:
        try:
            plain = t.layout is self.torch.strided
        except Exception:  # a wrapper subclass that cannot say: the Collector names it unmovable
            logger.debug("a %s has no layout to read", type(t).__name__, exc_info=True)
            plain = True
        self._inside_unmovable += not plain
        try:
            super().add_tensor(t, part, into)
        finally:
            self._inside_unmovable -= not plain

    def _seen(self, t, key: tuple | None) -> None:
        if key is None:
            self.unmovable.append(t)
            return
        if id(t) in self._tensor_ids:   # reached again (a parameter through its optimizer)
            return
        self._tensor_ids.add(id(t))
        group = self._group(key, t)
        if self._inside_unmovable:
            group.unmovable = "part of a sparse tensor"
        elif _wrapped(self.torch, t):
            group.unmovable = f"a {type(t).__name__} (a tensor subclass that keeps its data elsewhere)"
        group.tensors.append(t)

    def _saved(self, saved, data) -> None:
        try:
            key = (str(data.device), data.untyped_storage().data_ptr())
        except Exception:  # no storage: left where it is, and named
            logger.debug("a saved %s has no storage to read", type(data).__name__, exc_info=True)
            return
        self._group(key, data).saved.append((saved, data))

    def _group(self, key: tuple, t) -> StorageGroup:
        group = self.groups.get(key)
        if group is None:
            storage = t.untyped_storage()
            group = self.groups[key] = StorageGroup(key, key[0], int(storage.nbytes()))
        return group


def _wrapped(torch, t) -> bool:
    """A subclass whose ``__torch_dispatch__`` decides where data lives (DTensor, a fake tensor)."""
    cls = type(t)
    return cls is not torch.Tensor and cls is not torch.nn.Parameter and \
        getattr(cls, "__torch_dispatch__", None) is not getattr(torch.Tensor, "__torch_dispatch__", None)


def gather(torch, roots: Iterable, skip_keys=frozenset(), skip_ids=frozenset(), devices=None,
           max_depth: int = 8, max_items: int = 1_000_000) -> tuple[dict[tuple, StorageGroup], list]:
    """The storages ``roots`` reach, grouped, leaving out ``skip_keys`` (storages others hold) and
    keeping only ``devices`` (None: every device); and the tensors that have no plain storage.

    Objects whose ids are in ``skip_ids`` are never entered (the notebook's namespace).
    """
    groups: dict[tuple, StorageGroup] = {}
    gatherer = _Gatherer(torch, groups, max_depth=max_depth, max_items=max_items, skip=frozenset(skip_ids))
    for root in roots:
        gatherer.walk(root)
    kept = {k: g for k, g in groups.items()
            if k not in skip_keys and (devices is None or g.device in devices) and g.device != "meta"}
    return kept, gatherer.unmovable


def move(torch, groups: dict[tuple, StorageGroup], to: str | Callable[[StorageGroup], str] = "cpu",
         pinned: bool = False, repack_saved: bool = True) -> MoveResult:
    """Copy each storage in ``groups`` to ``to`` (a device, or the device for each group) once and
    point its tensors (and, with ``repack_saved``, its saved tensors) there.

    ``pinned``: the copies live in pinned (page-locked) host memory, which moves back to a GPU at
    full speed; otherwise pageable memory, filled through two pinned buffers.

    Every copy is made and waited for before any tensor is pointed at one, and the pointing runs
    with interrupts held back: an interrupt leaves either nothing moved (the copies are dropped) or
    everything. Where a destination has no room (a GPU another process filled), the groups that did
    not fit stay, named, and the others move.
    """
    result = MoveResult()
    target = to if callable(to) else (lambda _group: to)
    start = time.perf_counter()
    planned = []
    for group in sorted(groups.values(), key=lambda g: -g.nbytes):
        why = group.unmovable or _refusal(group, repack_saved)
        if why is None:
            dest, why = _destination(torch, group, target(group), pinned)
            if why is None:
                planned.append((group, dest))
        if why is not None:
            result.stayed.append((group.device, group.nbytes, why))
    result.alloc_seconds = time.perf_counter() - start
    copies = _copy_all(torch, planned, stager=None if pinned else _Stager(torch))
    result.copy_seconds = time.perf_counter() - start - result.alloc_seconds
    with interrupts_held():
        for group, copy in copies:
            _point(torch, group, copy, result, repack_saved)
    result.seconds = time.perf_counter() - start
    return result


def _destination(torch, group: StorageGroup, to: str, pinned: bool) -> tuple[Any, str | None]:
    """Where ``group``'s copy goes, allocated: ``(tensor, None)``; ``(None, None)`` where the stager
    fills pageable memory itself; ``(None, why)`` where ``to`` has no room."""
    source_on_gpu = group.device.startswith("cuda")
    if to == "cpu" and source_on_gpu and not pinned:
        return None, None
    try:
        if to == "cpu":
            return torch.empty(group.nbytes, dtype=torch.uint8, pin_memory=pinned and source_on_gpu), None
        return torch.empty(group.nbytes, dtype=torch.uint8, device=to), None
    except torch.OutOfMemoryError:
        logger.debug("no room on %s for %d bytes", to, group.nbytes, exc_info=True)
        return None, f"{to} has no room for it now"


def _copy_all(torch, planned: list, stager) -> list:
    """Each group's storage copied into its destination; waits until every device is done."""
    copies = []
    devices = set()
    for group, dest in planned:
        source = _bytes_of(torch, group.tensors[0] if group.tensors else group.saved[0][1])
        if dest is None:
            dest = stager.to_pageable(source)
        else:
            dest.copy_(source, non_blocking=dest.is_pinned() or source.is_pinned())
        devices |= {str(t.device) for t in (source, dest) if t.device.type == "cuda"}
        copies.append((group, dest))
        del source
    for device in devices:
        torch.cuda.synchronize(device)
    return copies


def _point(torch, group: StorageGroup, copy, result: MoveResult, repack_saved: bool) -> None:
    """Point every tensor of ``group`` (and its saved tensors) at ``copy``."""
    views = [(t, _geometry(t)) for t in group.tensors]
    saved = [(s, _geometry(d)) for s, d in group.saved] if repack_saved else []
    for t, geometry in views:
        t.data = _view(torch, copy, t.dtype, geometry)
    result.saved += _repack(torch, saved, group, copy)
    result.tensors += len(views)
    result.moved[group.device] = result.moved.get(group.device, 0) + group.nbytes
    result.placed[group.key] = (str(copy.device), copy.untyped_storage().data_ptr())


@contextlib.contextmanager
def interrupts_held():
    """Hold back Ctrl-C (SIGINT) for the duration; one that came is raised at the end.

    Only in the main thread, where Python delivers signals; elsewhere nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if came:
        raise KeyboardInterrupt


def _refusal(group: StorageGroup, repack_saved: bool) -> str | None:
    # A copy onto the same device is a copy all the same (a fresh storage): callers choose what moves.
    if not group.tensors and not group.saved:
        return "no tensor of it was reached"
    if not group.tensors and not repack_saved:
        return "saved for backward by an autograd graph in flight"
    return None


def _geometry(t) -> tuple:
    return (t.dtype, t.storage_offset(), tuple(t.size()), tuple(t.stride()))


def _bytes_of(torch, t):
    """The whole storage under ``t``, as one flat uint8 tensor on its device."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


def _view(torch, flat, dtype, geometry: tuple):
    """A tensor over ``flat``'s storage with ``geometry`` (dtype, offset, size, stride)."""
    _, offset, size, stride = geometry
    return torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), offset, size, stride)


def _repack(torch, saved: list, group: StorageGroup, copy) -> int:
    """Point each saved tensor at the copy; the graph hands it back on its old device when unpacked."""
    done = 0
    device = group.device
    for item, geometry in saved:
        moved = _view(torch, copy, geometry[0], geometry)
        try:
            item.register_hooks(lambda _old, moved=moved: moved,
                                lambda packed, device=device: packed.to(device))
        except RuntimeError:  # a hook was set already (save_on_cpu): the graph keeps what it packed
            logger.debug("a saved tensor on %s keeps its hooks; it was not moved", device, exc_info=True)
            continue
        done += 1
    return done


class _Stager:
    """GPU to pageable host memory through two pinned buffers: while the GPU fills one, the CPU
    empties the other (a pageable copy from a GPU alone runs at a small part of pinned speed)."""

    def __init__(self, torch):
        self.torch = torch
        self.buffers: list = []

    def to_pageable(self, source):
        torch = self.torch
        total = source.numel()
        dest = torch.empty(total, dtype=torch.uint8)
        if total <= STAGE_BYTES // 8:   # small: one plain copy costs less than the pipeline
            dest.copy_(source)
            return dest
        if not self.buffers:
            self.buffers = [torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        stream = torch.cuda.current_stream(source.device)
        events = [torch.cuda.Event(), torch.cuda.Event()]
        pending: list = [None, None]   # (offset, length) each buffer holds, not yet copied out
        for i, offset in enumerate(range(0, total, STAGE_BYTES)):
            b = i % 2
            self._drain(dest, b, events, pending)
            length = min(STAGE_BYTES, total - offset)
            with torch.cuda.stream(stream):
                self.buffers[b][:length].copy_(source[offset:offset + length], non_blocking=True)
                events[b].record(stream)
            pending[b] = (offset, length)
        for b in (0, 1):
            self._drain(dest, b, events, pending)
        return dest

    def _drain(self, dest, b: int, events, pending) -> None:
        if pending[b] is None:
            return
        offset, length = pending[b]
        events[b].synchronize()
        dest[offset:offset + length].copy_(self.buffers[b][:length])
        pending[b] = None
