"""CUDA spellings a cell holds as values, on a device without CUDA.

Two kinds of value outlive the call that made them, so the call's rewrite
alone cannot keep their meaning:

* a device the user asked for as CUDA (``dev = torch.device('cuda')``,
  ``torch.accelerator.current_accelerator()``): :func:`said_cuda` gives the
  cell's device, but as an object that remembers it was asked for as CUDA, so
  that ``x.to(dev)`` of a CPU tensor copies on a CPU target as it would on a GPU
  (:meth:`~.placement.Placement.to`). It still stands for the cell's device
  (:mod:`.device_values`): it follows later cells, settles and ships to workers.
* a typed-tensor class (``Tensor = torch.cuda.FloatTensor``, ``x.type(dtype)``,
  ``isinstance(t, torch.cuda.LongTensor)``): on cpu, meta or mps,
  :class:`TypedTensor` stands in for it. Calling it builds a tensor of its dtype
  where the cell's code runs now, like ``torch.cuda.FloatTensor(...)`` written
  as a call; on a CUDA target the real class is used.
"""
from __future__ import annotations

from typing import Any

from .. import device_values
from ..device_values import DeviceName

__all__ = ["said_cuda", "says_cuda", "said_cuda_name", "TypedTensor"]

_said: dict[str, Any] = {}       # device name -> the torch.device object a CUDA spelling gives there
_said_ids: set[int] = set()      # their ids (the objects live as long as this module)
_SAID = "_gpumagic_said_cuda"    # marks a DeviceName made from a CUDA spelling


def said_cuda(device):
    """The cell's device ``device`` as a CUDA spelling gives it: equal to it, and marked as asked for as CUDA."""
    name = str(device)
    made = _said.get(name)
    if made is None:
        import torch
        made = _said[name] = torch.device(name)
        _said_ids.add(id(made))
        # One of the objects that stand for the cell's device (device_values keeps them by id).
        device_values._stand_in_ids.add(id(made))
    return made


def said_cuda_name(name: str) -> DeviceName:
    """A :class:`DeviceName` for ``name`` that a CUDA spelling gave (``current_accelerator().type``)."""
    made = DeviceName(name)
    setattr(made, _SAID, True)
    return made


def says_cuda(value) -> bool:
    """Whether ``value`` names CUDA as the user wrote it: ``'cuda:0'``, ``0``, a CUDA ``torch.device``,
    or a value :func:`said_cuda` / :func:`said_cuda_name` gave. A value that only stands for the cell's
    device (``'cpu'`` after a cell) does not."""
    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:") or getattr(value, _SAID, False)
    if isinstance(value, int):
        return not isinstance(value, bool)
    return id(value) in _said_ids or getattr(value, "type", None) == "cuda"


class TypedTensor:
    """``torch.cuda.FloatTensor`` held as a value, where the device is not CUDA.

    ``T(2, 3)``, ``T([1., 2.])`` and ``x.type(T)`` give tensors of ``T.dtype``
    on the device the helper is aimed at now; ``isinstance(t, T)`` is true for
    a tensor of that dtype there (or on CUDA). Pickled, it arrives as the
    receiver's own.
    """

    __slots__ = ("_placement", "_cls", "dtype", "__name__")
    is_cuda = True   # as the class it stands for says

    def __init__(self, placement, cls):
        self._placement = placement
        self._cls = cls
        self.dtype = cls.dtype
        self.__name__ = cls.__name__

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True
        return self._placement.legacy(self._cls, *args, **kwargs)

    def convert(self, tensor):
        """``tensor.type(T)``."""
        __tracebackhide__ = True
        target = self._placement.target
        return tensor.type(self._cls) if target is None else self._placement._to_cuda(tensor, target, self.dtype)

    def __instancecheck__(self, obj) -> bool:
        import torch
        if not isinstance(obj, torch.Tensor) or obj.dtype != self.dtype:
            return False
        return obj.is_cuda or obj.device == self._placement.target

    def __reduce__(self):
        return _typed_tensor, (self._placement, self.__name__)

    def __repr__(self):
        return f"<stand-in for torch.cuda.{self.__name__} on {self._placement.target}>"


def _typed_tensor(placement, name: str):
    import torch
    return placement.tensor_type(getattr(torch.cuda, name))
