"""Ship Python objects that hold tensors between the kernel and worker processes.

An object graph (the notebook values a cell reads: modules, optimizers,
loaders, functions and classes defined in the notebook) is pickled with
cloudpickle, except that every dense tensor is taken out of the pickle and
its bytes are laid end to end in one flat buffer. The pickle (the *header*)
and the buffer travel separately: the buffer is written once into shared
memory that every local worker maps (:mod:`gpumagic.bulk`), and on the
worker one host-to-device copy moves all the tensors bound for its GPU. That
is what keeps shipping a ResNet-50 and its optimizer a matter of a few
hundred milliseconds rather than seconds.

Tensors of ``min_cache_bytes`` or more are also *fingerprinted* (a 64-bit,
position-weighted sum of their bits, the same on CPU and GPU). A worker keeps
the large tensors of its last cell in a :class:`TensorStore` keyed by
fingerprint; when the kernel ships a tensor whose fingerprint every worker
holds, only the key travels. After a cell the notebook's model holds rank
0's trained weights, and the workers hold the same bytes, so the next cell
ships no weights at all. Because the key is the content, a tensor changed in
the notebook in any way (``p.data.normal_()`` included) is shipped again.

Where tensors land on the worker (``target``):

* ``"rank"``: the worker's device. Tensors on a GPU in the notebook, and the
  parameters and buffers of the modules being trained, go there.
* ``"cpu"``: the CPU (datasets and other CPU tensors stay on the CPU).
* ``"keep"``: data arrives as in the notebook (GPU -> rank device, CPU -> CPU);
  a cached tensor stays where the worker holds it. Used for optimizer state,
  which the optimizer's own ``load_state_dict`` then places beside its
  parameter.

``torch.device("cuda:k")`` values arrive as the worker's own device.
"""
from __future__ import annotations

import importlib
import io
import pickle
import sys
import threading
import types
from dataclasses import dataclass, field

import cloudpickle
import torch

__all__ = ["Packed", "pack", "unpack", "fingerprint_keys", "TensorStore", "Scratch", "MIN_CACHE_BYTES"]

MIN_CACHE_BYTES = 1 << 20     # smaller tensors always travel; fingerprinting them costs more than it saves
_ALIGN = 64                   # every tensor starts on a 64-byte boundary in the buffer

_unpacking = threading.local()   # the tensors and device of the unpack in progress


@dataclass
class TensorSpec:
    """How to rebuild one tensor on the other side."""
    dtype: torch.dtype
    shape: tuple
    requires_grad: bool
    param: bool
    target: str                   # "rank" | "cpu" | "keep"
    on_gpu: bool                  # where it was on the sending side
    offset: int = -1              # in the buffer; -1 when only the key travels
    nbytes: int = 0
    key: tuple | None = None      # fingerprint key, for tensors large enough to cache
    state: dict | None = None     # a Parameter's __dict__ (attributes set on it)


@dataclass
class Packed:
    """A packed object: ``header`` (bytes) plus ``nbytes`` of ``buffer`` (CPU uint8 tensor or None)."""
    header: bytes
    buffer: torch.Tensor | None
    nbytes: int
    shipped_bytes: int = 0        # tensor bytes that travel
    cached_bytes: int = 0         # tensor bytes replaced by keys the receiver holds
    keys: set = field(default_factory=set)   # fingerprint keys of the large tensors in the object

    def data(self):
        """The bytes that travel: a uint8 tensor (a view of the buffer), or None."""
        if not self.nbytes:
            return None
        return self.buffer[: self.nbytes]


class Scratch:
    """A CPU byte buffer reused between transfers (first-touch page faults cost more than copies)."""

    def __init__(self):
        self._buf = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            # Grow with headroom so that a slightly larger next cell does not reallocate.
            self._buf = torch.empty(int(nbytes * 1.25) + 4096, dtype=torch.uint8)
        return self._buf[:nbytes]

    def release(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    @property
    def capacity(self) -> int:
        return self._buf.numel()


# ---------------------------------------------------------------- fingerprints

_COLS = 1021   # a prime: rows of this many 8-byte words get one weight each, columns another


def _fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 tensor on ``t``'s device: a position-weighted sum of ``t``'s bits.

    The bytes are read as a matrix of 8-byte words, ``_COLS`` to a row; each
    column and each row has its own odd weight. Integer arithmetic wraps
    identically on every device and in any summation order, so CPU and GPU
    agree on the value; on the CPU ``mv`` makes it one pass over memory.
    """
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.storage_offset() % 8:
        b = b.clone()
    n = b.numel()
    row_bytes = 8 * _COLS
    full = n // row_bytes * row_bytes
    device = b.device
    cols = torch.arange(_COLS, device=device, dtype=torch.int64) * 2 + 1
    parts = []
    if full:
        parts.append(b[:full].view(torch.int64).view(-1, _COLS))
    if n > full:
        tail = torch.zeros(row_bytes, dtype=torch.uint8, device=device)
        tail[: n - full] = b[full:]
        parts.append(tail.view(torch.int64).view(1, _COLS))
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=device)
    cpu = device.type == "cpu"
    rows = torch.cat([torch.mv(x, cols) if cpu else (x * cols).sum(1) for x in parts])
    weights = torch.arange(rows.numel(), device=device, dtype=torch.int64) * 2654435761 + 97
    total = torch.dot(rows, weights) if cpu else (rows * weights).sum()
    return total + n


def fingerprint_keys(tensors: list[torch.Tensor]) -> list[tuple]:
    """``(dtype, shape, fingerprint)`` for each tensor; one host sync per device."""
    keys: list[tuple | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for device, idx in by_device.items():
        values = torch.stack([_fingerprint_tensor(tensors[i]) for i in idx]).tolist()
        for i, v in zip(idx, values):
            keys[i] = (str(tensors[i].dtype), tuple(tensors[i].shape), int(v))
    return keys  # type: ignore[return-value]


def _is_shippable_tensor(obj) -> bool:
    return (type(obj) in (torch.Tensor, torch.nn.Parameter)
            and obj.layout == torch.strided and not obj.is_quantized
            and obj.device.type in ("cpu", "cuda") and not obj.is_nested)


# ---------------------------------------------------------------- packing

def _rebuild_tensor(index: int):
    return _unpacking.tensors[index]


def _rank_device():
    return _unpacking.device


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file, packer: "_Packer"):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._packer = packer

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            if _is_shippable_tensor(obj):
                return _rebuild_tensor, (self._packer.add(obj),)
            if obj.device.type not in ("cpu", "meta"):
                # Sparse, quantized, subclasses: torch's own pickling, from a CPU copy.
                return _identity, (obj.detach().cpu(),)
        elif isinstance(obj, torch.device) and obj.type == "cuda":
            return _rank_device, ()
        elif isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType \
                and sys.modules.get(obj.__name__) is obj:
            # Module subclasses (torch.classes, torch.ops) miss cloudpickle's by-type table;
            # a function using ``self.classes`` next to ``torch`` makes it pickle torch.classes.
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def _identity(x):
    return x


class _Packer:
    def __init__(self, targets: dict[int, str], held: set, min_cache_bytes: int, fingerprint: bool):
        self.targets = targets
        self.held = held
        self.min_cache_bytes = min_cache_bytes
        self.fingerprint = fingerprint
        self.tensors: list[torch.Tensor] = []
        self.specs: list[TensorSpec] = []

    def add(self, t: torch.Tensor) -> int:
        on_gpu = t.device.type == "cuda"
        target = self.targets.get(id(t)) or ("rank" if on_gpu else "cpu")
        state = None
        if isinstance(t, torch.nn.Parameter) and t.__dict__:
            state = dict(t.__dict__)
        spec = TensorSpec(dtype=t.dtype, shape=tuple(t.shape), requires_grad=t.requires_grad,
                          param=isinstance(t, torch.nn.Parameter), target=target, on_gpu=on_gpu,
                          nbytes=t.numel() * t.element_size(), state=state)
        self.tensors.append(t)
        self.specs.append(spec)
        return len(self.specs) - 1


def pack(obj, *, targets: dict[int, str] | None = None, held: set | frozenset = frozenset(),
         scratch: Scratch | None = None, min_cache_bytes: int = MIN_CACHE_BYTES,
         fingerprint: bool = True) -> Packed:
    """Pack ``obj`` for :func:`unpack` on the other side.

    ``targets`` maps ``id(tensor)`` to ``"rank"``, ``"cpu"`` or ``"keep"``;
    ``held`` is the set of fingerprint keys every receiver's store holds.
    The buffer is ``scratch``'s memory when given (valid until its next use).
    """
    packer = _Packer(targets or {}, set(held), min_cache_bytes, fingerprint)
    f = io.BytesIO()
    _Pickler(f, packer).dump(obj)
    payload = f.getvalue()

    large = [i for i, s in enumerate(packer.specs) if fingerprint and s.nbytes >= min_cache_bytes]
    keys = fingerprint_keys([packer.tensors[i] for i in large]) if large else []
    cached_bytes = 0
    for i, key in zip(large, keys):
        packer.specs[i].key = key
        if key in packer.held:
            cached_bytes += packer.specs[i].nbytes

    # Lay out the bytes that travel: GPU tensors grouped per device (one copy each), then CPU ones.
    travel = [i for i, s in enumerate(packer.specs) if s.key is None or s.key not in packer.held]
    # Bytes bound for the worker's GPU first (so that it copies them in one piece), and the
    # tensors of each notebook GPU side by side (so that each is read back in one piece).
    travel.sort(key=lambda i: (not _lands_on_device(packer.specs[i]), not packer.specs[i].on_gpu,
                               packer.tensors[i].device.index or 0))
    offset = 0
    for i in travel:
        packer.specs[i].offset = offset
        offset += -(-packer.specs[i].nbytes // _ALIGN) * _ALIGN
    total = offset
    buffer = (scratch.get(total) if scratch is not None else torch.empty(total, dtype=torch.uint8)) if total else None
    if total:
        _fill(buffer, [(packer.tensors[i], packer.specs[i]) for i in travel])
    header = pickle.dumps((payload, packer.specs), protocol=pickle.HIGHEST_PROTOCOL)
    return Packed(header=header, buffer=buffer, nbytes=total,
                  shipped_bytes=sum(packer.specs[i].nbytes for i in travel),
                  cached_bytes=cached_bytes, keys={k for k in keys})


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _fill(buffer: torch.Tensor, items: list) -> None:
    gpu: dict[torch.device, list] = {}
    for t, spec in items:
        if t.device.type == "cuda":
            gpu.setdefault(t.device, []).append((t, spec))
        elif spec.nbytes:
            buffer[spec.offset: spec.offset + spec.nbytes].copy_(_bytes_of(t))
    for device, group in gpu.items():
        # One device-to-host copy per GPU: concatenate on the device, padding to the layout.
        group.sort(key=lambda ts: ts[1].offset)
        start = group[0][1].offset
        end = group[-1][1].offset + group[-1][1].nbytes
        contiguous = all(b[1].offset == a[1].offset + -(-a[1].nbytes // _ALIGN) * _ALIGN
                         for a, b in zip(group, group[1:]))
        if contiguous:
            pieces = []
            for t, spec in group:
                pieces.append(_bytes_of(t))
                pad = -(-spec.nbytes // _ALIGN) * _ALIGN - spec.nbytes
                if pad and spec is not group[-1][1]:
                    pieces.append(torch.zeros(pad, dtype=torch.uint8, device=device))
            flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            buffer[start:end].copy_(flat)
        else:
            for t, spec in group:
                buffer[spec.offset: spec.offset + spec.nbytes].copy_(_bytes_of(t))


# ---------------------------------------------------------------- unpacking

class TensorStore:
    """The large tensors a worker kept from its last cell, by fingerprint key."""

    def __init__(self, min_cache_bytes: int = MIN_CACHE_BYTES):
        self.min_cache_bytes = min_cache_bytes
        self._items: dict[tuple, torch.Tensor] = {}
        self._handed: set = set()

    def __contains__(self, key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        seen, total = set(), 0
        for t in self._items.values():
            ptr = (t.device, t.untyped_storage().data_ptr())
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total

    def take(self, key: tuple) -> torch.Tensor:
        """The held tensor for ``key``; the second taker of one key gets a copy (no aliasing)."""
        t = self._items[key]
        if key in self._handed:
            return t.detach().clone()
        self._handed.add(key)
        return t

    def rebuild(self, tensors) -> set:
        """Hold exactly the large tensors among ``tensors`` (their current contents); returns the keys."""
        unique, seen = [], set()
        for t in tensors:
            if isinstance(t, torch.Tensor) and _is_shippable_tensor(t) and id(t) not in seen \
                    and t.numel() * t.element_size() >= self.min_cache_bytes:
                seen.add(id(t))
                unique.append(t)
        keys = fingerprint_keys(unique) if unique else []
        self._items = dict(zip(keys, unique))
        self._handed = set()
        return set(self._items)

    def clear(self) -> None:
        self._items = {}
        self._handed = set()


def unpack(header: bytes, buffer: torch.Tensor | None, *, device: torch.device | str = "cpu",
           store: TensorStore | None = None, copy: bool = True):
    """Rebuild the object packed by :func:`pack`; returns ``(obj, tensors)``.

    ``device`` is where ``"rank"`` tensors go; ``tensors`` lists every tensor
    rebuilt, in packing order. With ``copy=False`` CPU tensors are views of
    ``buffer`` (only for callers that copy them out before its next use).
    """
    device = torch.device(device)
    payload, specs = pickle.loads(header)
    on_device = {}
    if buffer is not None and device.type == "cuda":
        # One host-to-device copy for everything bound for this GPU.
        ranked = [s for s in specs if s.offset >= 0 and _lands_on_device(s)]
        if ranked:
            start = min(s.offset for s in ranked)
            end = max(s.offset + s.nbytes for s in ranked)
            on_device = {"start": start, "flat": buffer[start:end].to(device, non_blocking=False)}
    tensors = []
    for spec in specs:
        tensors.append(_materialize(spec, buffer, device, store, on_device, copy))
    _unpacking.tensors, _unpacking.device = tensors, device
    try:
        obj = pickle.loads(payload)
    finally:
        _unpacking.tensors = _unpacking.device = None
    return obj, tensors


def _lands_on_device(spec: TensorSpec) -> bool:
    return spec.target == "rank" or (spec.target == "keep" and spec.on_gpu)


def _materialize(spec: TensorSpec, buffer, device, store, on_device, copy) -> torch.Tensor:
    dest = device if _lands_on_device(spec) else torch.device("cpu")
    if spec.offset < 0:
        if store is None or spec.key not in store:
            raise RuntimeError("a tensor the kernel expected this worker to hold is gone; "
                               "run the cell again (the kernel will ship it)")
        t = store.take(spec.key)
        if spec.target != "keep" and t.device != dest:
            t = t.to(dest)
        t = t.detach()
    elif dest.type == "cuda" and on_device:
        start = spec.offset - on_device["start"]
        raw = on_device["flat"][start: start + spec.nbytes]
        t = raw.view(spec.dtype).view(spec.shape).clone()
    else:
        raw = buffer[spec.offset: spec.offset + spec.nbytes] if spec.nbytes else torch.empty(0, dtype=torch.uint8)
        t = raw.view(spec.dtype).view(spec.shape)
        if copy or dest.type != "cpu":
            t = t.to(dest, copy=True)
    if spec.param:
        p = torch.nn.Parameter(t, requires_grad=spec.requires_grad)
        if spec.state:
            p.__dict__.update(spec.state)
        return p
    if spec.requires_grad and t.is_floating_point():
        t.requires_grad_(True)
    return t
