"""Make CUDA-specific placement in a cell follow the device ``%%ondevice`` chose.

A notebook written for one GPU says ``x.cuda()``, ``torch.device('cuda')``,
``device='cuda:0'`` or ``torch.cuda.FloatTensor([1., 2.])``. Run under
``%%ondevice cpu`` (or ``cuda:1``, ``meta``), the cell's code is rewritten so
that every such spelling lands on that device instead, with the right dtype,
and the factories the cell calls (``torch.zeros``, ``torch.randn``,
``nn.Linear(...)``...) get ``device=`` passed explicitly.

Why a rewrite rather than ``with torch.device(DEVICE):``: torch's
default-device context is a ``TorchFunctionMode`` that intercepts *every*
torch call, which made a loop of small ops about 80% slower on the CPU; an
explicit ``device=`` costs nothing measurable (``benchmarks/ondevice.py``).

Two parts, which change together:

* :class:`PlacementRewriter` (in :mod:`.transform`), an
  ``ast.NodeTransformer``. Rewritten calls go through one helper name,
  :data:`HELPER`, so the cell's own names are never touched; new nodes carry
  the user's line numbers.
* :class:`Placement` (here), the object the helper name is bound to.
  ``Placement(None)`` passes every call through unchanged.

Functions made in such a cell
-----------------------------
A ``%%ondevice X`` cell's code uses the helper name of X
(:func:`helper_name`: ``__gpumagic_device_cpu__``), bound for good in the
notebook to the one :func:`made_for` placement of X, so functions and classes
defined in the cell find it whenever they run. It follows where they run:

* in a plain cell, X (the device they were made for);
* inside a later ``%%ondevice Y`` cell, Y (:func:`follow` retargets every
  made-for placement while that cell runs);
* in a ``%%dataparallel`` rank or a ``%%sharedtrain`` worker, that process's
  device (:func:`follow_process`; pickled, a made-for placement arrives as
  the receiving process's own).

What "CUDA follows DEVICE" means for the rest of ``torch.cuda`` and
``torch.accelerator`` is in :mod:`.cuda_calls` (``torch.nn.parallel``'s
``replicate``/``scatter``/``parallel_apply``/``gather`` in :mod:`.parallel`); in short:

==================================  ==================  =====================
call                                DEVICE is cuda:k    DEVICE is cpu / meta
==================================  ==================  =====================
``torch.cuda.is_available()``       True                True
``torch.cuda.device_count()``       real count          1
``torch.cuda.current_device()``     k                   0
``torch.cuda.set_device(i)``        stays on k          nothing
``torch.cuda.synchronize()``        synchronises k      nothing
``with torch.cuda.device(i):``      device k            nothing
``x.is_cuda``                       on CUDA or DEVICE   on CUDA or DEVICE
``x.type()``, ``torch.typename(x)``  torch's             on DEVICE: its CUDA type
``x.pin_memory()`` / ``pin_memory=``  unchanged           skipped (no pinning)
==================================  ==================  =====================

None of these touch ``torch.cuda`` when DEVICE is not a GPU, so CUDA is never
initialised by them. All CUDA indices map to DEVICE (``cuda:1`` too): a cell
runs on one device. ``*_like`` factories follow their input, as under
torch's own default device, except that an input on another CUDA device
is followed to DEVICE. Explicit CPU placement (``device='cpu'``,
``torch.FloatTensor(...)`` without ``.cuda()``) is left alone; values that
stand for the cell's device (:mod:`.device_values`) follow it. A CUDA
spelling held as a value (``dev = torch.device('cuda')``,
``T = torch.cuda.FloatTensor``) keeps meaning CUDA (:mod:`.values`):
``x.to(dev)`` copies a CPU tensor as a GPU would, and returns a tensor the cell
put on CUDA as is (on a CPU target the cell's CUDA tensors are remembered, and
factories given a device go through ``on_cuda``/``factory``: :mod:`.placed`).
The code of ``%time``, ``%timeit`` and ``%prun`` in the cell is rewritten too
(:mod:`.magics`).

Examples
--------
In a notebook::

    %%ondevice cpu
    a = torch.cuda.FloatTensor([1., 2.])     # float32 on cpu
    model = sq.cuda()                        # sq stays usable on cpu
    next(model.parameters()).is_cuda         # True: cpu stands in for CUDA
"""
from __future__ import annotations

import builtins
import contextlib
import numbers
import re
from collections.abc import Iterator

from ..device_values import set_process_device, stand_in, stands_for_cell_device
from .cuda_calls import CudaCalls
from .methods import LoadMap, MethodCalls
from .parallel import ParallelCalls
from .placed import PlacedCalls, bind_torch, remember, remembered
from .transform import (
    HELPER,
    LEGACY_TYPES,
    PlacementRewriter,
    is_cuda_name,
    is_cuda_type_name,
    lookup,
    rewrite_placement,
)
from .values import TypedTensor, said_cuda, says_cuda

__all__ = ["HELPER", "LEGACY_TYPES", "PlacementRewriter", "Placement", "rewrite_placement", "passthrough",
           "install_passthrough", "modules_on", "helper_name", "made_for", "follow", "follow_process"]


class Placement(PlacedCalls, MethodCalls, CudaCalls, ParallelCalls):
    """Where rewritten code puts things: ``Placement('cuda:1')``, or ``Placement(None)`` to pass through.

    Every method mirrors one CUDA spelling; with a target it lands on the
    target, without one it does exactly what the original code did.
    ``made_for`` is the device of the cell whose code uses it (see :func:`made_for`).
    """

    __slots__ = ("target", "cuda_target", "said_cuda", "_torch", "_kind", "_types", "made_for")

    def __init__(self, target=None) -> None:
        import torch
        bind_torch(torch)
        self._torch = torch
        self.made_for: str | None = None
        self._types: dict[str, TypedTensor] = {}
        self._aim(target)

    def _aim(self, target) -> None:
        if target is None:
            self.target = self.said_cuda = None
            self.cuda_target = "cuda"   # what ``.cuda()`` means without a target
            self._kind = None
            return
        device = self._torch.device(target)
        if device.type == "cuda" and device.index is None:
            raise ValueError("Placement needs an indexed CUDA device, e.g. 'cuda:0'")
        # The one object that stands for the device, so that values made from it keep following.
        self.target = self.cuda_target = stand_in(device)
        # What a CUDA spelling gives: the same device, remembered as asked for as CUDA (see ``to``).
        self.said_cuda = said_cuda(device)
        self._kind = device.type

    def __repr__(self):
        return f"Placement({str(self.target) if self.target is not None else None!r})"

    def __reduce__(self):
        # Functions from a cell may be pickled into other processes. A made-for placement arrives
        # as the receiver's own (which follows the worker's device); any other passes through.
        if self.made_for is not None:
            return (made_for, (self.made_for,))
        return (passthrough, ())

    # -- devices -------------------------------------------------------------
    def map(self, device):
        """A CUDA device (``'cuda'``, ``'cuda:1'``, ``1``, ``torch.device('cuda')``) -> the target."""
        __tracebackhide__ = True
        target = self.target
        if target is None or device is None:
            return device
        if isinstance(device, self._torch.device):
            return target if device.type == "cuda" or stands_for_cell_device(device) else device
        if isinstance(device, str):
            return target if is_cuda_name(device) or stands_for_cell_device(device) else device
        if isinstance(device, int) and not isinstance(device, bool):
            return target
        if isinstance(device, dict):  # torch.load(map_location={'cuda:1': 'cuda:0'})
            return LoadMap(device, target, self.map)
        return device

    def device(self, *args, **kwargs):
        """``torch.device(...)``."""
        __tracebackhide__ = True
        made = self._torch.device(*args, **kwargs)
        if self.target is not None:
            if made.type == "cuda" or (args and says_cuda(args[0])):
                return self.said_cuda
            if args and stands_for_cell_device(args[0]):
                return self.target
        return made

    # -- moving ---------------------------------------------------------------
    def cuda(self, obj, *args, **kwargs):
        """``obj.cuda(...)``: tensors, modules (in place) and storages go to the target."""
        __tracebackhide__ = True
        torch = self._torch
        if self.target is None:
            return obj.cuda(*args, **kwargs)
        if isinstance(obj, torch.Tensor):
            non_blocking = kwargs.get("non_blocking", args[1] if len(args) > 1 else False)
            extra = {}
            if kwargs.get("memory_format") is not None:
                extra["memory_format"] = kwargs["memory_format"]
            return self._to_cuda(obj, self.target, non_blocking=bool(non_blocking), **extra)
        if isinstance(obj, torch.nn.Module) or (isinstance(obj, super) and isinstance(obj.__self__, torch.nn.Module)):
            return self._module_cuda(obj, args, kwargs)   # its class may define its own cuda
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            return self._storage_cuda(obj, args, kwargs)
        to = getattr(obj, "to", None)
        if callable(to):
            return to(self.target)
        return obj.cuda(*args, **kwargs)

    def to(self, obj, *args, **kwargs):
        """``obj.to(...)``: CUDA devices among the arguments become the target.

        Asked for a CUDA device as written (``'cuda'``, ``torch.device('cuda')``, a device made from
        one in the cell, a tensor the cell put there), a CPU tensor on a CPU target is copied, as a
        GPU would make a new tensor, unless the cell put it on CUDA (:mod:`.placed`): then
        it is returned as is, as torch's ``.to(own device)`` does; so is it for a value that holds
        the cell's device after a cell (``'cpu'``). Modules move in place, as in torch.
        """
        __tracebackhide__ = True
        torch = self._torch
        if self.target is None:
            return obj.to(*args, **kwargs)
        is_tensor = isinstance(obj, torch.Tensor)
        is_torch = is_tensor or isinstance(obj, torch.nn.Module)
        asked_cuda = False
        if args:
            first = args[0]
            if isinstance(first, torch.Tensor):
                if is_torch and first.device.type == "cuda" and first.device != self.target:
                    # ``to(other)`` means other's device and dtype.
                    args = (self.target, first.dtype, *args[1:])
                    asked_cuda = True
                elif is_torch and self._kind == "cpu" and remembered(first):
                    asked_cuda = True
            elif isinstance(first, int) and not isinstance(first, bool):
                if is_torch:
                    args = (self.target, *args[1:])
                    asked_cuda = True
            else:
                asked_cuda = says_cuda(first)
                args = (self.map(first), *args[1:])
        if "device" in kwargs:
            asked_cuda = asked_cuda or says_cuda(kwargs["device"])
            kwargs["device"] = self.map(kwargs["device"])
        if asked_cuda and is_torch:
            return self._to_cuda(obj, *args, **kwargs)
        return obj.to(*args, **kwargs)

    def retype(self, obj, kind):
        """``x.type(torch.cuda.HalfTensor)``, ``x.type('torch.cuda.HalfTensor')``, ``x.type(T)`` (any ``T``)."""
        __tracebackhide__ = True
        if isinstance(kind, TypedTensor):
            return kind.convert(obj)
        if isinstance(kind, str):
            name = kind
        else:
            name = f"{getattr(kind, '__module__', '')}.{getattr(kind, '__name__', '')}"
        if self.target is None or not is_cuda_type_name(name):
            return obj.type(kind)
        dtype = getattr(lookup(name.replace("torch.cuda.", "torch.", 1)), "dtype", None)
        return self._to_cuda(obj, self.target, dtype)

    def tensor_type(self, cls):
        """A bare ``torch.cuda.FloatTensor`` (``T = torch.cuda.FloatTensor``, ``isinstance(x, ...)``).

        The class itself where it works (a CUDA target, or none); elsewhere a :class:`TypedTensor`
        that builds its tensors where this helper is aimed.
        """
        if isinstance(cls, TypedTensor):
            cls = cls._cls
        if self.target is None or self._kind == "cuda" or not isinstance(cls, type) \
                or not is_cuda_type_name(f"{cls.__module__}.{cls.__name__}"):
            return cls   # a name the rewrite took for a CUDA type but that holds something else now
        made = self._types.get(cls.__name__)
        if made is None:
            made = self._types[cls.__name__] = TypedTensor(self, cls)
        return made

    # -- making ---------------------------------------------------------------
    def legacy(self, cls, *args, **kwargs):
        """``torch.cuda.FloatTensor(...)`` and ``torch.FloatTensor(..., device=d)``."""
        __tracebackhide__ = True
        if self.target is None:
            return cls(*args, **kwargs)
        device = self.target
        cuda = getattr(cls, "is_cuda", None) is True
        if "device" in kwargs:
            asked = kwargs.pop("device")
            wanted = self.map(asked)
            if wanted is not None and not cuda:
                device, cuda = wanted, says_cuda(asked)
        if kwargs:
            return cls(*args, **kwargs)  # let torch report the unexpected keyword
        made = self._legacy_new(cls, device, args)
        return self._typed_on_cuda(made, args) if cuda else made

    def legacy_cuda(self, cls, *args):
        """``torch.FloatTensor(...).cuda()`` in one step."""
        __tracebackhide__ = True
        if self.target is None:
            return cls(*args).cuda()
        return self._typed_on_cuda(self._legacy_new(cls, self.target, args), args)

    def _legacy_new(self, cls, device, args):
        __tracebackhide__ = True
        torch = self._torch
        dtype = getattr(cls, "dtype", None)
        if not isinstance(dtype, torch.dtype):  # torch.Tensor: the default dtype
            dtype = torch.get_default_dtype()
        if not args:
            return torch.empty(0, dtype=dtype, device=device)
        if len(args) == 1 and isinstance(args[0], torch.Size):
            return torch.empty(args[0], dtype=dtype, device=device)
        if all(isinstance(a, numbers.Integral) and not isinstance(a, (bool, torch.Tensor)) for a in args):
            return torch.empty(tuple(int(a) for a in args), dtype=dtype, device=device)
        if len(args) == 1:
            data = args[0]
            if isinstance(data, torch.Tensor):
                return data.to(device=device, dtype=dtype)
            return torch.tensor(data, dtype=dtype, device=device)
        return cls(*args)  # torch's own error for a malformed call

    def like(self, fn, *args, **kwargs):
        """``torch.zeros_like(x)``: follows x, unless x is on another CUDA device."""
        __tracebackhide__ = True
        if self.target is not None and args:
            first = args[0]
            if isinstance(first, self._torch.Tensor):
                if first.device.type == "cuda" and first.device != self.target:
                    kwargs["device"] = self.target
                    return self.on_cuda(fn(*args, **kwargs))
                if self._kind == "cpu" and remembered(first):   # like a tensor the cell put on CUDA
                    made = fn(*args, **kwargs)
                    remember(made)
                    return made
        return fn(*args, **kwargs)

    def pin_memory(self, obj):
        """``x.pin_memory()``: pinning needs CUDA; elsewhere the tensor is returned as is."""
        __tracebackhide__ = True
        if self.target is None or self._kind == "cuda":
            return obj.pin_memory()
        return obj

    def pin(self, flag):
        """``pin_memory=flag``."""
        return flag if self.target is None or self._kind == "cuda" else False

    def is_cuda(self, obj) -> bool:
        """``x.is_cuda``: true on CUDA or on the target."""
        __tracebackhide__ = True
        if self.target is None:
            return obj.is_cuda
        return bool(getattr(obj, "is_cuda", False)) or getattr(obj, "device", None) == self.target


_PASSTHROUGH: Placement | None = None


def passthrough() -> Placement:
    """The shared pass-through helper, installed in ``builtins`` (see the module notes)."""
    global _PASSTHROUGH
    if _PASSTHROUGH is None:
        _PASSTHROUGH = Placement(None)
    install_passthrough()
    return _PASSTHROUGH


def install_passthrough(name: str = HELPER) -> None:
    """Make ``name`` resolve to the pass-through helper where no cell binds it.

    Functions defined in a rewritten cell look the helper up as a global when
    they are called; after the cell the notebook no longer binds it, and the
    lookup falls through to ``builtins``.
    """
    global _PASSTHROUGH
    if _PASSTHROUGH is None:
        _PASSTHROUGH = Placement(None)
    if getattr(builtins, name, None) is not _PASSTHROUGH:
        setattr(builtins, name, _PASSTHROUGH)


# -- placements of functions made in a cell ------------------------------------------------

_made: dict[str, Placement] = {}    # device a cell ran on -> the placement its code uses
_followed: list = []                 # devices of the %%ondevice cells running now, innermost last
_process_target: str | None = None  # a worker's device (follow_process)


def helper_name(device) -> str:
    """The helper name the code of a cell on ``device`` uses: ``__gpumagic_device_cuda_1__``."""
    return "__gpumagic_device_" + re.sub(r"\W", "_", str(device)) + "__"


def _now_for(device: str):
    if _followed:
        return _followed[-1]
    return _process_target if _process_target is not None else device


def made_for(device) -> Placement:
    """The placement used by code made in a cell on ``device``: one per device, aimed where it runs now.

    Examples
    --------
    ::

        helper = made_for("cpu")
        helper.target                  # device(type='cpu'), in a plain cell
        with follow("meta"):
            helper.target              # device(type='meta'), while a %%ondevice meta cell runs
    """
    name = str(device)
    placement = _made.get(name)
    if placement is None:
        placement = Placement(name)
        placement.made_for = name
        _made[name] = placement
        if _now_for(name) != name:
            placement._aim(_now_for(name))
    return placement


def _aim_all() -> None:
    for name, placement in _made.items():
        placement._aim(_now_for(name))


@contextlib.contextmanager
def follow(device) -> Iterator[None]:
    """While active, code made in any ``%%ondevice`` cell places things on ``device``."""
    _followed.append(str(device))
    _aim_all()
    try:
        yield
    finally:
        _followed.pop()
        _aim_all()


def follow_process(device) -> None:
    """This process is a worker on ``device``: code made in ``%%ondevice`` cells, and values that
    stand for a cell's device, mean ``device`` here (None: back to each cell's own device)."""
    global _process_target
    _process_target = None if device is None else str(device)
    set_process_device(device)
    _aim_all()


@contextlib.contextmanager
def modules_on(target) -> Iterator[None]:
    """While active, parameters and buffers registered on any ``nn.Module`` move to ``target``.

    This places modules built by code the rewrite cannot see (a class
    defined in an earlier cell, a library's model) without a default-device
    context, so small ops pay nothing. Parameters that arrive twice (tied
    weights) stay one parameter. A no-op on torch without the global
    registration hooks.
    """
    import torch
    from torch.nn.modules import module as module_mod
    register_param = getattr(module_mod, "register_module_parameter_registration_hook", None)
    register_buffer = getattr(module_mod, "register_module_buffer_registration_hook", None)
    if register_param is None or register_buffer is None:
        yield
        return
    target = torch.device(target)
    moved: dict[int, tuple] = {}   # id(original) -> (original kept alive, replacement)

    def on_parameter(module, name, param):
        if param is None or type(param) is not torch.nn.Parameter or param.device == target:
            return None
        hit = moved.get(id(param))
        if hit is not None:
            return hit[1]
        new = torch.nn.Parameter(param.detach().to(target), requires_grad=param.requires_grad)
        moved[id(param)] = (param, new)
        return new

    def on_buffer(module, name, buffer):
        if not isinstance(buffer, torch.Tensor) or buffer.device == target:
            return None
        hit = moved.get(id(buffer))
        if hit is not None:
            return hit[1]
        new = buffer.to(target)
        moved[id(buffer)] = (buffer, new)
        return new

    handles = [register_param(on_parameter), register_buffer(on_buffer)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        moved.clear()
