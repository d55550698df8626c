"""The one wire format for notebook values sent to workers, and back.

An object graph (the notebook values a cell reads: modules, optimizers,
loaders, functions and classes defined in the notebook) is pickled with
cloudpickle, so notebook classes and functions travel by value, except that
every dense tensor is taken out of the pickle:

* its bytes are laid end to end in one flat buffer, which travels once
  through shared memory that every local worker maps (:mod:`.bulk`); on the
  worker one host-to-device copy moves all the tensors bound for its GPU.
  That keeps shipping a ResNet-50 and its optimizer a matter of a few hundred
  milliseconds rather than seconds;
* or, where the tensor must be *shared* with the workers rather than copied
  (Hogwild's model, tensors already in shared memory, CUDA tensors under
  Hogwild), it travels by reference through torch's shared-memory reducers
  (:attr:`Packed.shared`, sent with ``multiprocessing``'s own pickler);
* or, when the receiver already holds a tensor with the same content
  (:mod:`.tensor_cache`), only its key travels.

The pickle (the *header*) also carries the source of the notebook cells that
the shipped functions were defined in, so tracebacks in a worker show their lines.

Where tensors land on the receiving side (``targets``, by ``id`` of the tensor):

* ``"rank"``: the receiver's device. Tensors on a GPU in the notebook, and the
  parameters and buffers of the modules being trained, go there.
* ``"cpu"``: the CPU (datasets and other CPU tensors stay on the CPU).
* ``"keep"``: data arrives as in the notebook (GPU -> the receiver's device,
  CPU -> CPU); a cached tensor stays where the receiver holds it. Used for
  optimizer state, which the optimizer's own ``load_state_dict`` then places
  beside its parameter.

``torch.device("cuda:k")`` values arrive as the receiver's own device, and so
do the devices that stand for an ``%%ondevice`` cell's device
(:mod:`gpumagic.cell.device_values`: the notebook's ``device`` after such a cell).

In a notebook (what a worker does with what the kernel packed)::

    packed = pack({"model": model, "loader": loader})
    obj, tensors = unpack(packed.header, packed.data(), device="cuda:1")
"""
from __future__ import annotations

import importlib
import io
import linecache
import pickle
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import cloudpickle
import torch

from ..cell.compile import is_cell
from ..cell.device_values import stands_for_cell_device
from .tensor_cache import LARGE_TENSOR_BYTES, TensorStore, fingerprint_keys, is_shippable_tensor

if TYPE_CHECKING:
    from .bulk import Outgoing

__all__ = ["Packed", "TensorSpec", "pack", "unpack", "pack_namespace", "unpack_namespace", "Unshippable",
           "LARGE_TENSOR_BYTES"]

_ALIGN = 64                   # every tensor starts on a 64-byte boundary in the buffer
_GLOBALS_KEY = "__gpumagic_globals__"

_unpacking = threading.local()   # the tensors and device of the unpack in progress


class Unshippable(ValueError):
    """Notebook values that cannot be pickled for a worker: ``problems`` lists ``(name, value, error)``."""

    def __init__(self, problems: list[tuple[str, object, Exception]]):
        self.problems = problems
        super().__init__("; ".join(f"{name} ({type(value).__name__}: {error})" for name, value, error in problems))


@dataclass
class TensorSpec:
    """How to rebuild one tensor on the other side."""
    dtype: torch.dtype
    shape: tuple
    requires_grad: bool
    param: bool
    target: str                   # "rank" | "cpu" | "keep" | "shared"
    on_gpu: bool                  # where it was on the sending side
    offset: int = -1              # in the buffer (in Packed.shared for "shared"); -1: only the key travels
    nbytes: int = 0
    key: tuple | None = None      # fingerprint key, for tensors large enough to cache
    state: dict | None = None     # a Parameter's __dict__ (attributes set on it)


@dataclass
class Packed:
    """A packed object: ``header`` (bytes), ``nbytes`` of ``buffer``, and the ``shared`` tensors."""
    header: bytes
    buffer: torch.Tensor | None
    nbytes: int
    shipped_bytes: int = 0        # tensor bytes that travel
    cached_bytes: int = 0         # tensor bytes replaced by keys the receiver holds
    keys: set = field(default_factory=set)      # fingerprint keys of the large tensors in the object
    shared: list = field(default_factory=list)  # tensors that travel by reference (torch's reducers)

    def data(self):
        """The bytes that travel: a uint8 tensor (a view of the buffer), or None."""
        if not self.nbytes or self.buffer is None:
            return None
        return self.buffer[: self.nbytes]


# ---------------------------------------------------------------- packing

def _rebuild_tensor(index: int):
    return _unpacking.tensors[index]


def _rank_device():
    return _unpacking.device


def _stand_in(token):
    """What the receiver holds for ``token`` (an object the sender did not ship: see ``stand_ins``)."""
    try:
        return _unpacking.stand_ins[token]
    except (KeyError, TypeError):
        raise RuntimeError(f"this worker does not hold {token!r}, which the kernel did not ship; run the cell "
                           "again (the kernel will ship it)") from None


def _identity(x):
    return x


_DYNAMIC = "<dynamic-code>"


def _named_code(code: types.CodeType, filename: str) -> types.CodeType:
    return code.replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file, packer: _Packer):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._packer = packer

    def reducer_override(self, obj):
        token = self._packer.stand_in(obj)
        if token is not None:
            return _stand_in, (token,)
        if isinstance(obj, torch.Tensor):
            if self._packer.shares(obj) or is_shippable_tensor(obj):
                return _rebuild_tensor, (self._packer.add(obj),)
            if obj.device.type not in ("cpu", "meta"):
                # Sparse, quantized, subclasses: torch's own pickling, from a CPU copy.
                return _identity, (obj.detach().cpu(),)
        elif isinstance(obj, torch.device) and (obj.type == "cuda" or stands_for_cell_device(obj)):
            return _rank_device, ()
        elif isinstance(obj, types.FunctionType):
            context = _compile_context(obj)
            if context is not None:
                # torch.compile(fn) (``@torch.compile def step(): opt.step()``): its wrapper holds
                # dynamo's thread state, which cannot travel; the plain function is compiled again in
                # the worker by the same context (backend, mode, fullgraph), as a compiled module is
                return context, (obj._torchdynamo_orig_callable,)
            self._packer.filenames.add(obj.__code__.co_filename)
        elif isinstance(obj, types.CodeType) and obj.co_filename != _DYNAMIC:
            # cloudpickle 3 names all code it ships "<dynamic-code>": keep the cell's name, which
            # the worker's tracebacks show (with the source sent along) and the kernel maps to In[n].
            return _named_code, (obj.replace(co_filename=_DYNAMIC), obj.co_filename)
        elif isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType \
                and sys.modules.get(obj.__name__) is obj:
            # Module subclasses (torch.classes, torch.ops) miss cloudpickle's by-type table;
            # a function using ``self.classes`` next to ``torch`` makes it pickle torch.classes.
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def _compile_context(fn: types.FunctionType):
    """The ``torch.compile`` context that wrapped ``fn``, where ``fn`` is such a wrapper; else None."""
    if getattr(fn, "_torchdynamo_orig_callable", None) is None or not fn.__closure__:
        return None
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimize = getattr(eval_frame, "OptimizeContext", None)
    if optimize is None:
        return None
    for cell in fn.__closure__:
        try:
            value = cell.cell_contents
        except ValueError:   # (an empty cell)
            continue
        if type(value) is optimize:
            return value
    return None


class _Packer:
    def __init__(self, targets: dict[int, str], share: Callable[[torch.Tensor], bool] | None,
                 stand_ins: dict[int, tuple] | None = None,
                 stand_in_for: Callable[[object], tuple | None] | None = None):
        self.targets = targets
        self.stand_ins = stand_ins or {}
        self.stand_in_for = stand_in_for
        self.share = share
        self.tensors: list[torch.Tensor] = []
        self.specs: list[TensorSpec] = []
        self.shared: list[torch.Tensor] = []
        self.filenames: set[str] = set()

    def stand_in(self, obj) -> tuple | None:
        token = self.stand_ins.get(id(obj))
        if token is None and self.stand_in_for is not None:
            token = self.stand_in_for(obj)
        return token

    def shares(self, t: torch.Tensor) -> bool:
        return self.share is not None and self.share(t)

    def add(self, t: torch.Tensor) -> int:
        on_gpu = t.device.type == "cuda"
        shared = self.shares(t)
        target = "shared" if shared else self.targets.get(id(t)) or ("rank" if on_gpu else "cpu")
        state = dict(t.__dict__) if isinstance(t, torch.nn.Parameter) and t.__dict__ else None
        spec = TensorSpec(dtype=t.dtype, shape=tuple(t.shape), requires_grad=t.requires_grad,
                          param=isinstance(t, torch.nn.Parameter), target=target, on_gpu=on_gpu,
                          nbytes=0 if shared else t.numel() * t.element_size(), state=state)
        if shared:
            spec.offset = len(self.shared)
            self.shared.append(t)
        self.tensors.append(t)
        self.specs.append(spec)
        return len(self.specs) - 1


def _cell_sources(filenames: set[str]) -> dict[str, str]:
    """The notebook cells among ``filenames`` (from linecache), so workers can show their lines."""
    out = {}
    for name in filenames:
        entry = linecache.cache.get(name)
        if entry is not None and len(entry) >= 3 and is_cell(name):
            out[name] = "".join(entry[2])
    return out


def pack(obj, *, targets: dict[int, str] | None = None, held: set | frozenset = frozenset(),
         scratch: Outgoing | None = None, min_cache_bytes: int = LARGE_TENSOR_BYTES, fingerprint: bool = True,
         share: Callable[[torch.Tensor], bool] | None = None, sources: dict[str, str] | None = None,
         stand_ins: dict[int, tuple] | None = None,
         stand_in_for: Callable[[object], tuple | None] | None = None) -> Packed:
    """Pack ``obj`` for :func:`unpack` on the other side.

    ``targets`` maps ``id(tensor)`` to ``"rank"``, ``"cpu"`` or ``"keep"``;
    ``share(tensor)`` says which tensors travel by reference instead;
    ``held`` is the set of fingerprint keys every receiver's store holds.
    The buffer is ``scratch.get(n)`` (a :class:`~.bulk.Outgoing`) when given,
    valid until its next use. ``sources`` adds cell sources to those found.
    ``stand_ins`` maps ``id(obj)`` to a token: the object does not travel, the
    receiver puts in what it holds under that token (``unpack``'s ``stand_ins``);
    ``stand_in_for(obj)`` gives such a token for objects found while packing (or None).
    """
    packer = _Packer(targets or {}, share, stand_ins, stand_in_for)
    f = io.BytesIO()
    _Pickler(f, packer).dump(obj)
    payload = f.getvalue()

    specs = packer.specs
    large = [i for i, s in enumerate(specs) if fingerprint and s.target != "shared" and s.nbytes >= min_cache_bytes]
    keys = fingerprint_keys([packer.tensors[i] for i in large]) if large else []
    cached_bytes = 0
    for i, key in zip(large, keys):
        specs[i].key = key
        if key in held:
            cached_bytes += specs[i].nbytes

    # Bytes bound for the worker's GPU first (so that it copies them in one piece), and the
    # tensors of each notebook GPU side by side (so that each is read back in one piece).
    travel = [i for i, s in enumerate(specs) if s.target != "shared" and (s.key is None or s.key not in held)]
    travel.sort(key=lambda i: (not _lands_on_device(specs[i]), not specs[i].on_gpu,
                               packer.tensors[i].device.index or 0))
    offset = 0
    for i in travel:
        specs[i].offset = offset
        offset += -(-specs[i].nbytes // _ALIGN) * _ALIGN
    total = offset
    buffer = None
    if total:
        buffer = scratch.get(total) if scratch is not None else torch.empty(total, dtype=torch.uint8)
        _fill(buffer, [(packer.tensors[i], specs[i]) for i in travel])
    cell_sources = {**_cell_sources(packer.filenames), **(sources or {})}
    header = pickle.dumps((payload, specs, cell_sources), protocol=pickle.HIGHEST_PROTOCOL)
    return Packed(header=header, buffer=buffer, nbytes=total, shipped_bytes=sum(specs[i].nbytes for i in travel),
                  cached_bytes=cached_bytes, keys=set(keys), shared=packer.shared)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


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
        contiguous = all(b[1].offset == a[1].offset + _padded(a[1].nbytes) for a, b in zip(group, group[1:]))
        if not contiguous:
            for t, spec in group:
                buffer[spec.offset: spec.offset + spec.nbytes].copy_(_bytes_of(t))
            continue
        pieces = []
        for t, spec in group:
            pieces.append(_bytes_of(t))
            pad = _padded(spec.nbytes) - spec.nbytes
            if pad and spec is not group[-1][1]:
                pieces.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        buffer[start:end].copy_(flat)


# ---------------------------------------------------------------- unpacking

def unpack(header: bytes, buffer: torch.Tensor | None, *, device: torch.device | str = "cpu",
           store: TensorStore | None = None, views_from: float = float("inf"), shared: list | None = None,
           stand_ins: dict | None = None):
    """Rebuild the object packed by :func:`pack`; returns ``(obj, tensors)``.

    ``device`` is where ``"rank"`` tensors go; ``tensors`` lists every tensor
    rebuilt, in packing order; ``shared`` is :attr:`Packed.shared` as it
    arrived; ``stand_ins`` maps the sender's tokens to the objects this side
    holds in their place. CPU tensors of ``views_from`` bytes or more stay views of
    ``buffer`` (shared by every worker mapping it) instead of being copied out;
    only callers that keep ``buffer`` alive and unchanged may ask for that.
    Cell sources in the header are registered with linecache.
    """
    from ..cell.compile import register_source
    device = torch.device(device)
    payload, specs, cell_sources = pickle.loads(header)
    for name, source in cell_sources.items():
        if name not in linecache.cache:
            register_source(name, source)
    on_device: dict = {}
    if buffer is not None and device.type == "cuda":
        # One host-to-device copy for everything bound for this GPU.
        ranked = [s for s in specs if s.offset >= 0 and s.target != "shared" and _lands_on_device(s)]
        if ranked:
            start = min(s.offset for s in ranked)
            end = max(s.offset + s.nbytes for s in ranked)
            on_device = {"start": start, "flat": buffer[start:end].to(device, non_blocking=False)}
    tensors = [_materialize(spec, buffer, device, store, on_device, views_from, shared) for spec in specs]
    _unpacking.tensors, _unpacking.device, _unpacking.stand_ins = tensors, device, stand_ins
    try:
        obj = pickle.loads(payload)
    finally:
        _unpacking.tensors = _unpacking.device = _unpacking.stand_ins = None
    return obj, tensors


def _lands_on_device(spec: TensorSpec) -> bool:
    return spec.target == "rank" or (spec.target == "keep" and spec.on_gpu)


def _materialize(spec: TensorSpec, buffer, device, store, on_device, views_from, shared) -> torch.Tensor:
    if spec.target == "shared":
        t = shared[spec.offset]
        if spec.state and isinstance(t, torch.nn.Parameter):
            t.__dict__.update(spec.state)
        return t
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
        keep_view = dest.type == "cpu" and spec.nbytes >= views_from and not spec.requires_grad
        if not keep_view:
            t = t.to(dest, copy=True)
    if spec.param:
        p = torch.nn.Parameter(t, requires_grad=spec.requires_grad)
        if spec.state:
            p.__dict__.update(spec.state)
        return p
    if spec.requires_grad and t.is_floating_point():
        t.requires_grad_(True)
    return t


# ---------------------------------------------------------------- notebook namespaces

def pack_namespace(values: dict, namespace: dict, *, droppable=(), **kwargs) -> tuple[Packed, list[str]]:
    """Pack notebook ``values`` so that functions defined in ``namespace`` find them as globals.

    Functions and classes from the notebook read their globals from one dict
    in the worker, the one :func:`unpack_namespace` returns, so a notebook
    function that reads ``loader`` sees the worker's (sharded) ``loader``.
    Values that cannot be pickled are left out where their name is in
    ``droppable`` (the cell makes its own); otherwise :class:`Unshippable`
    names them. Returns the packed object and the names left out.
    Other keyword arguments go to :func:`pack`.
    """
    anchor = types.FunctionType(compile("None", "<gpumagic>", "eval"), namespace)
    try:
        return pack({_GLOBALS_KEY: anchor, "values": values}, **kwargs), []
    except Exception as exc:  # noqa: BLE001 - find which values fail, below
        first = exc
    problems, dropped = [], []
    for name, value in values.items():
        try:
            pack(value, fingerprint=False, share=kwargs.get("share"), stand_ins=kwargs.get("stand_ins"),
                 stand_in_for=kwargs.get("stand_in_for"))
        except Exception as exc:  # noqa: BLE001 - reported by name, or dropped where the cell makes its own
            if name in droppable:
                dropped.append(name)
            else:
                problems.append((name, value, exc))
    if problems or not dropped:
        raise Unshippable(problems or [("the cell's values", values, first)])
    kept = {n: v for n, v in values.items() if n not in dropped}
    return pack({_GLOBALS_KEY: anchor, "values": kept}, **kwargs), dropped


def unpack_namespace(header: bytes, buffer, **kwargs) -> tuple[dict, list]:
    """The worker's side of :func:`pack_namespace`: ``(namespace, tensors)``.

    The namespace is the globals dict of the shipped notebook functions, with
    the values in it; other keyword arguments go to :func:`unpack`.
    """
    obj, tensors = unpack(header, buffer, **kwargs)
    namespace = obj[_GLOBALS_KEY].__globals__
    namespace.update(obj["values"])
    _rewrap_scheduled_optimizers(obj["values"].values())
    return namespace, tensors


def _rewrap_scheduled_optimizers(values) -> None:
    """Give back the ``step`` wrapper an LR scheduler puts on its optimizer.

    An optimizer pickles without it (``Optimizer.__getstate__`` keeps only its
    state), and the scheduler's first ``step()`` would then warn that
    ``optimizer.step()`` "has been overridden". The wrapper is torch's: it
    marks the optimizer as stepped and calls the class's own ``step``.
    """
    import functools
    import weakref

    import torch
    for value in values:
        if not isinstance(value, torch.optim.lr_scheduler.LRScheduler):
            continue
        opt = value.optimizer
        if hasattr(opt.step, "_wrapped_by_lr_sched"):
            continue
        func = type(opt).step
        opt_ref = weakref.ref(opt)

        def wrapper(*args, _func=func, _opt_ref=opt_ref, **kwargs):
            opt = _opt_ref()
            opt._opt_called = True
            return _func.__get__(opt, opt.__class__)(*args, **kwargs)

        wrapper = functools.wraps(func)(wrapper)
        wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        opt.step = wrapper  # type: ignore[method-assign]
