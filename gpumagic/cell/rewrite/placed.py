"""Tensors a cell placed on the stand-in CUDA device, where that device is the CPU.

On a GPU, ``x.to('cuda')`` of a CPU tensor is a new tensor, and of a CUDA tensor
the tensor itself. Under ``%%ondevice cpu`` both are CPU tensors, so the move alone
cannot tell "a notebook CPU tensor" (copy, as a GPU would) from "a tensor the cell
put on CUDA" (no copy: ``y = x.cuda(); z = y.to('cuda')`` gives ``z is y``). This
module remembers the second kind, on a CPU target only (on cuda or meta the
tensor's device says it):

* the result of a move to CUDA (``.cuda()``, ``.to('cuda')``, ``.to(dev)`` with a
  CUDA ``dev``, ``.type(torch.cuda.FloatTensor)``), and the parameters and buffers of
  a module moved there;
* what a factory or ``nn`` layer makes when given a CUDA device
  (``torch.ones(2, device='cuda:0')``, ``torch.tensor(d, device=dev)``,
  ``nn.Linear(2, 2, device='cuda')``), the typed constructors
  (``torch.cuda.FloatTensor(...)``) and ``*_like`` of a remembered tensor;
* views of those (``x[:8]``, ``x.view(-1)``): their ``_base`` is remembered.

Other tensors made from them (``x + 1``, a model's output) are not: a move of one
to CUDA copies it, as it does for a tensor the notebook made (a loader's batch).

The record is a dict ``id(tensor) -> weakref.ref(tensor)``, read with
``ref() is tensor``: nothing is put on the tensor (it pickles and saves as
before), and a tensor that died and whose id was reused is not mistaken for it.
Dead entries are swept when the dict has doubled since the last sweep, which is
cheaper per tensor than a callback on each weak reference.
"""
from __future__ import annotations

from typing import Any
from weakref import ref

from .part import PlacementPart
from .values import says_cuda

__all__ = ["remember", "remembered", "remember_module", "forget_all", "bind_torch", "PlacedCalls"]

_refs: dict[int, Any] = {}    # id(tensor) -> weakref.ref(tensor)
_tensor_type: Any = None      # torch.Tensor, once a Placement has needed it (torch is imported late)
_tracing: Any = None          # (torch.compiler.is_compiling, torch._C._is_tracing): bind_torch()
_SWEEP_AT = 1024
_sweep_at = _SWEEP_AT


def _compiling() -> bool:
    """Whether torch.compile or torch.jit.trace is tracing. Dynamo's tensors are stand-ins, and a record
    of their ids a side effect it cannot replay (``fullgraph=True`` failed, else the function ran
    uncompiled); a trace must not depend on which inputs were remembered (its check runs it again on
    copies of the inputs, and ``.cuda()`` traced as a copy once and as none then failed it)."""
    # (looked up beforehand: a lookup on first use was a global dynamo guarded on, and traced again for)
    return _tracing is not None and (_tracing[0]() or _tracing[1]())


def bind_torch(torch) -> None:
    """Look up what :func:`_compiling` calls; a :class:`~.placement.Placement` does as it is made."""
    global _tracing
    _tracing = (torch.compiler.is_compiling, torch._C._is_tracing)


def remember(tensor) -> None:
    """``tensor`` is on the stand-in CUDA device (see the module notes); nothing while compiling."""
    if _compiling():
        return
    _refs[id(tensor)] = ref(tensor)
    if len(_refs) > _sweep_at:
        _sweep()


def _sweep() -> None:
    global _sweep_at
    refs = _refs
    for key, held in list(refs.items()):
        if held() is None and refs.get(key) is held:
            del refs[key]
    _sweep_at = max(_SWEEP_AT, 2 * len(refs))


def remembered(tensor) -> bool:
    """Whether ``tensor``, or the tensor it is a view of, was put on the stand-in CUDA device
    (never while compiling: a traced move copies, which a graph's result cannot tell apart)."""
    if _compiling():
        return False
    held = _refs.get(id(tensor))
    if held is not None and held() is tensor:
        return True
    base = tensor._base
    if base is None:
        return False
    held = _refs.get(id(base))
    return held is not None and held() is base


def remember_module(module) -> None:
    """A module moved to (or built on) the stand-in CUDA device: its parameters and buffers are there."""
    if _compiling():
        return
    for tensor in module.parameters():
        remember(tensor)
    for tensor in module.buffers():
        remember(tensor)


def forget_all() -> None:
    """Forget every tensor (tests)."""
    global _sweep_at
    _refs.clear()
    _sweep_at = _SWEEP_AT


def _shares_memory(made, src) -> bool:
    """Whether ``made`` (from ``torch.as_tensor(src, ...)``) uses ``src``'s memory."""
    import torch
    if isinstance(src, torch.Tensor):
        if made is src:
            return True
        if made.device != src.device or src.device.type == "meta":
            return False
        return made.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    interface = getattr(src, "__array_interface__", None)   # numpy shares with as_tensor/asarray
    return isinstance(interface, dict) and made.data_ptr() == interface.get("data", (None,))[0]


class PlacedCalls(PlacementPart):
    """The methods of a :class:`~.placement.Placement` that move or make things on the stand-in CUDA device.

    ``on_cuda(made)`` and ``factory(fn, *args, device=..., **kwargs)`` are what the rewrite
    calls for factories and ``nn`` layers given a device; the others serve ``Placement``'s
    ``cuda``, ``to``, ``type`` and typed constructors.
    """

    __slots__ = ()
    said_cuda: Any

    def on_cuda(self, made):
        """``torch.ones(2, device='cuda:0')`` (``device=`` already the target): remembered on a CPU target."""
        if self._kind == "cpu" and not _compiling():
            if type(made) is _tensor_type:   # remember(made), inlined: factories run in tight loops
                _refs[id(made)] = ref(made)
                if len(_refs) > _sweep_at:
                    _sweep()
            else:
                self._remember(made)
        return made

    def factory(self, fn, /, *args, **kwargs):
        """``fn(*args, device=dev, **kwargs)`` with a device held in a value: it goes to the target if it
        stands for CUDA or the cell's device, and what it makes is remembered if ``dev`` said CUDA."""
        __tracebackhide__ = True
        target = self.target
        if target is None or "device" not in kwargs:
            return fn(*args, **kwargs)
        device = kwargs["device"]
        if device is self.said_cuda:    # ``dev = torch.device('cuda')`` in the cell: the common case
            kwargs["device"] = target
        else:
            mapped = self.map(device)
            if mapped is device:        # not a CUDA device (``x.device``, ``'cpu'``): as written
                return fn(*args, **kwargs)
            kwargs["device"] = mapped
            if not says_cuda(device):   # a value that stands for the cell's device
                return fn(*args, **kwargs)
        made = fn(*args, **kwargs)
        if self._kind != "cpu":
            return made
        return self._made_on_cuda(made, args[0] if args else None)

    def _made_on_cuda(self, made, src):
        """``made`` by a CUDA spelling from ``src`` (``torch.as_tensor(src, device='cuda')``): on a GPU
        it is new unless ``src`` was on CUDA already, so a CPU tensor or array it shares is copied."""
        torch = self._torch
        if isinstance(made, torch.Tensor) and src is not None and not isinstance(src, (int, float, list, tuple)) \
                and not (isinstance(src, torch.Tensor) and remembered(src)) and _shares_memory(made, src):
            made = made.clone()
        self._remember(made)
        return made

    def _typed_on_cuda(self, made, args):
        """What a typed constructor made (``torch.cuda.FloatTensor(t)``): of one CPU tensor, a copy, as on a GPU."""
        if self._kind != "cpu":
            return made
        return self._made_on_cuda(made, args[0] if len(args) == 1 else None)

    def _remember(self, made) -> None:
        global _tensor_type
        torch = self._torch
        _tensor_type = torch.Tensor
        if isinstance(made, torch.Tensor):
            remember(made)
        elif isinstance(made, torch.nn.Module):
            remember_module(made)

    def _to_cuda(self, obj, *args, **kwargs):
        """``obj.to(*args, **kwargs)`` where the arguments name the (stand-in) CUDA device.

        On a CPU target a tensor the cell did not put there is copied, as a GPU copies a CPU
        tensor, and one it did is returned as is (a new one only for another dtype or layout);
        the result is remembered. Elsewhere torch's ``to`` decides.
        """
        __tracebackhide__ = True
        if self._kind != "cpu":
            return obj.to(*args, **kwargs)
        torch = self._torch
        if isinstance(obj, torch.Tensor):
            # ``copy=False`` too: on a GPU a CPU tensor is copied whatever it says.
            if not kwargs.get("copy") and len(args) < 4 and obj.device.type == "cpu" and not remembered(obj):
                kwargs["copy"] = True
            made = obj.to(*args, **kwargs)
            if made is not obj:
                remember(made)
            return made
        made = obj.to(*args, **kwargs)
        if isinstance(made, torch.nn.Module):
            remember_module(made)
        return made
