"""``.cuda()`` where torch's own method is not the one called, and ``cuda``/``to`` taken as values.

Part of :class:`~gpumagic.cell.rewrite.helper.Placement`:

* a module whose class defines its own ``cuda`` (to move tensors it keeps
  outside its parameters and buffers) has that method run, as on a GPU: on
  ``cuda:k`` with CUDA indices meaning k; on another device when the method
  was rewritten (defined in a ``%%ondevice`` cell: its ``super().cuda()``
  follows the device) or comes from a plain notebook cell (compiled again
  through the rewrite: :mod:`.own`). One from a library would reach
  CUDA itself, so there the module's parameters and buffers move, as torch's
  ``cuda`` would move them;
* a storage (``torch.load(f, map_location=lambda s, loc: s.cuda())``) goes to the device, and so does
  one saved on a GPU, loaded by a ``torch.load(f)`` that gives no ``map_location`` (as on a GPU);
  a dict ``map_location`` (``{'cuda:1': 'cuda:0'}``) sends every CUDA location to the device, the ones it
  lists (to CUDA) and the ones it leaves out alike (:class:`LoadMap`);
* ``torch.set_default_tensor_type(torch.cuda.FloatTensor)`` makes DEVICE the default device for the cell;
* ``getattr(x, 'cuda')``, ``torch.Tensor.cuda`` and ``x.cuda`` not called at
  once (``map(torch.Tensor.cuda, batch)``) give a callable that goes through
  the placement like a written ``x.cuda()``.
"""
from __future__ import annotations

import functools
import logging

from .own import rebuilt
from .part import PlacementPart
from .transform import is_cuda_name, is_cuda_type_name, lookup
from .values import TypedTensor

__all__ = ["MethodCalls", "LoadMap", "rewritten"]

logger = logging.getLogger(__name__)

_HELPER_PREFIX = "__gpumagic_device"
_METHODS = ("cuda", "to")


def rewritten(function) -> bool:
    """Whether ``function`` (or a method) was compiled from code the placement rewrite changed."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        code = stack.pop()
        if any(name.startswith(_HELPER_PREFIX) for name in code.co_names):
            return True
        stack.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return False


class MethodCalls(PlacementPart):
    """The methods of a :class:`~gpumagic.cell.rewrite.helper.Placement` for modules' own ``cuda``, storages
    and ``cuda``/``to`` taken as values."""


    def cuda(self, obj, *args, **kwargs):  # Placement's
        raise NotImplementedError

    def to(self, obj, *args, **kwargs):  # Placement's
        raise NotImplementedError

    def _to_cuda(self, obj, *args, **kwargs):  # PlacedCalls'
        raise NotImplementedError

    def _module_cuda(self, obj, args, kwargs):
        """``model.cuda(...)`` and ``super().cuda(...)`` inside a module's own ``cuda``."""
        __tracebackhide__ = True
        torch = self._torch
        module = obj.__self__ if isinstance(obj, super) else obj
        own = getattr(obj, "cuda", None)
        if getattr(own, "__func__", torch.nn.Module.cuda) is not torch.nn.Module.cuda:
            if self._kind == "cuda":
                args, kwargs = self._cuda_index(args, kwargs)
                with torch.cuda.device(self.target):   # ``.cuda()`` without an index means the current device
                    return own(*args, **kwargs)
            if rewritten(own):
                return own(*args, **kwargs)
            again = rebuilt(own, self)   # a class from a plain notebook cell: its method, following the device
            if again is not None:
                return again(*args, **kwargs)
            # Its code would reach CUDA, which this device is standing in for.
            logger.debug("%s.cuda is not rewritten code; its parameters and buffers move to %s instead",
                         type(module).__qualname__, self.target)
        return self._to_cuda(module, self.target)

    def base_cuda(self, obj, *args, **kwargs):
        """``nn.Module.cuda(model)``: torch's method, not the class's own (which it is often called from)."""
        __tracebackhide__ = True
        torch = self._torch
        if self.target is None:
            return torch.nn.Module.cuda(obj, *args, **kwargs)
        if isinstance(obj, torch.nn.Module):
            return self._to_cuda(obj, self.target)
        return self.cuda(obj, *args, **kwargs)

    def _cuda_index(self, args, kwargs):
        """A module's own ``cuda(device)`` on ``cuda:k``: every CUDA index or device means k."""
        def one(device):
            if isinstance(device, int) and not isinstance(device, bool):
                return self.target.index
            return self.map(device)
        if args:
            args = (one(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs = {**kwargs, "device": one(kwargs["device"])}
        return args, kwargs

    def _storage_cuda(self, storage, args, kwargs):
        """``storage.cuda(...)`` (a ``map_location`` function): the storage on the device."""
        __tracebackhide__ = True
        torch = self._torch
        if self._kind == "cuda":
            non_blocking = kwargs.get("non_blocking", args[1] if len(args) > 1 else False)
            return storage.cuda(self.target.index, non_blocking=non_blocking)
        if self._kind == "meta":   # torch has no meta device module to copy with; a meta storage holds no data
            if isinstance(storage, torch.TypedStorage):
                return torch.TypedStorage(storage.size(), dtype=storage.dtype, device="meta")
            return torch.UntypedStorage(storage.nbytes(), device="meta")
        return storage.to(device=self.target)

    @property
    def load_location(self):
        """``map_location`` for a ``torch.load`` that gives none: storages saved on a GPU come to DEVICE."""
        return None if self.target is None else self._restore

    def _restore(self, storage, location: str):
        __tracebackhide__ = True
        if location.startswith("cuda"):
            return self._storage_cuda(storage, (), {})
        return None   # torch restores it where it was saved

    def default_tensor_type(self, fn, kind):
        """``torch.set_default_tensor_type(torch.cuda.FloatTensor)``: its dtype becomes the default, and DEVICE
        torch's default device, which is put back after the cell as any default device set in it is."""
        __tracebackhide__ = True
        cls = kind._cls if isinstance(kind, TypedTensor) else kind
        name = cls if isinstance(cls, str) else f"{getattr(cls, '__module__', '')}.{getattr(cls, '__name__', '')}"
        if self.target is None or not is_cuda_type_name(name):
            return fn(cls)
        fn(lookup(name.replace("torch.cuda.", "torch.", 1)))   # the dtype, with torch's own checks and warning
        self._torch.set_default_device(self.target)
        return None

    def method(self, obj, name, *default):
        """``getattr(obj, 'cuda')``, ``torch.Tensor.cuda``, a bare ``x.cuda``: a callable through this placement.

        Anything other than a torch tensor, module or storage (or their classes) gets its attribute as is.
        """
        found = getattr(obj, name, *default)
        torch = self._torch
        if self.target is None or name not in _METHODS or not callable(found):
            return found
        kinds = (torch.Tensor, torch.nn.Module, torch.UntypedStorage, torch.TypedStorage)
        call = self.cuda if name == "cuda" else self.to
        if isinstance(obj, type) and issubclass(obj, kinds):
            if found is torch.nn.Module.cuda:
                return _Unbound(self.base_cuda, found)
            if found in (torch.Tensor.cuda, torch.Tensor.to, torch.nn.Module.to):
                return _Unbound(call, found)
            return found   # a class's own method, called as written
        if isinstance(obj, kinds) or (isinstance(obj, super) and isinstance(obj.__self__, torch.nn.Module)):
            return functools.partial(call, obj)
        return found


class LoadMap(dict):
    """``torch.load``'s dict ``map_location`` on DEVICE: every CUDA location is DEVICE, as every CUDA index is.

    ``{'cuda:1': 'cuda:0'}`` on a GPU leaves ``cuda:0`` where it was; here ``cuda:0`` is no device torch can
    restore to (``cpu``: "Attempting to deserialize object on a CUDA device"), so a location the dict leaves
    out comes to DEVICE too. A location it sends elsewhere (``{'cuda:0': 'cpu'}``) goes there. torch looks
    locations up with ``get`` (storages, and tensors rebuilt apart from theirs), so it stays a dict.
    """

    __slots__ = ("_device",)

    def __init__(self, mapping: dict, target, map_device) -> None:
        self._device = str(target)
        # Values torch reads as location strings: a CUDA one (or one standing for the cell's device) is DEVICE's.
        super().__init__({key: self._device if map_device(value) is target else value
                          for key, value in mapping.items()})

    def get(self, key, default=None):
        if key in self:
            return self[key]
        if is_cuda_name(key) or getattr(key, "type", None) == "cuda":
            return self._device
        return default


class _Unbound:
    """``torch.Tensor.cuda`` as a value: called with the object first, as the unbound method is."""

    __slots__ = ("_call", "__wrapped__")

    def __init__(self, call, original) -> None:
        self._call = call
        self.__wrapped__ = original

    def __call__(self, obj, *args, **kwargs):
        __tracebackhide__ = True
        return self._call(obj, *args, **kwargs)

    def __get__(self, obj, owner=None):   # kept as a class attribute, it binds as the original does
        return self if obj is None else functools.partial(self._call, obj)

    def __repr__(self) -> str:
        return repr(self.__wrapped__)
