"""What a worker sends back into the notebook, pickled: tensors detached and on the CPU, and no
object that belongs to the worker's process.

:func:`pickled_for_notebook` serves what a ``%%dataparallel`` cell binds (rank 0's
predictions, a dataclass of metrics) and the calls a worker makes on a notebook's
logger (:mod:`.relays`). An object holding a module, an optimizer, a DataLoader or a
framework's trainer stays in the worker: :class:`NotReturnable` says which.

Runs in the workers::

    blob = pickled_for_notebook({"preds": preds, "acc": acc})   # the kernel: pickle.loads(blob)
"""
from __future__ import annotations

import io
import pickle

import cloudpickle

__all__ = ["RETURN_LIMIT", "NotReturnable", "pickled_for_notebook", "smaller_as_view"]

RETURN_LIMIT = 256 * 2**20   # bytes of pickled objects one cell brings back, all together

# (package root, class name): framework objects bound to the ranks' processes.
_PROCESS_BOUND = {("transformers", "Trainer"), ("accelerate", "Accelerator"), ("lightning", "Trainer"),
                  ("pytorch_lightning", "Trainer"), ("lightning", "Fabric"), ("lightning_fabric", "Fabric"),
                  ("torch", "ProcessGroup"), ("tqdm", "tqdm")}
# how the note names some of them
_CALLED = {"tqdm": "a tqdm progress bar"}


class NotReturnable(Exception):
    """Why an object cannot come back to the notebook."""


def pickled_for_notebook(value, limit: int = RETURN_LIMIT) -> bytes:
    """``value`` pickled for the kernel, its tensors detached and on the CPU; raises
    :class:`NotReturnable` naming what it holds that cannot come back, or its size."""
    sink = _Limited(limit)
    try:
        _Pickler(sink).dump(value)
    except NotReturnable:
        raise
    except Exception as exc:  # noqa: BLE001 - anything that cannot be pickled: its reason goes in the note
        raise NotReturnable(f"{type(exc).__name__}: {exc}") from None
    return sink.getvalue()


class _Limited(io.BytesIO):
    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def left(self) -> int:
        return self.limit - self.tell()

    def write(self, b) -> int:
        if memoryview(b).nbytes > self.left():   # (protocol 5 writes PickleBuffers too)
            raise self.too_large()
        return super().write(b)

    def too_large(self) -> NotReturnable:
        return NotReturnable(f"larger than the {self.limit >> 20} MB a cell brings back; save it from the cell")


class _Pickler(cloudpickle.CloudPickler):
    def __init__(self, file, *args, **kwargs):
        super().__init__(file, *args, **kwargs)
        self._sink = file

    def reducer_override(self, obj):
        import torch
        if isinstance(obj, torch.Tensor):
            cpu = _on_cpu(obj.detach(), self._sink)
            if type(cpu) is not torch.Tensor:
                raise NotReturnable(f"holds a {type(obj).__name__}")
            if isinstance(obj, torch.nn.Parameter):   # stays a Parameter (its data is reduced as above)
                return torch.nn.Parameter(cpu, requires_grad=obj.requires_grad).__reduce_ex__(
                    pickle.HIGHEST_PROTOCOL)
            return cpu.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        kind = _process_bound(obj)
        if kind is not None:
            raise NotReturnable(f"holds {kind}, which stays in the ranks")
        return super().reducer_override(obj)


def smaller_as_view(value) -> bool:
    """Whether ``value`` is a tensor whose storage holds fewer bytes than its elements (an expanded mask):
    it comes back as a view of a copy of that storage (:func:`pickled_for_notebook`), not densely."""
    import torch
    return (type(value) is torch.Tensor and value.layout == torch.strided and not value.is_meta
            and value.untyped_storage().nbytes() < value.numel() * value.element_size())


def _on_cpu(t, sink):
    """A copy of ``t`` on the CPU (not a view of the rank's), as small as it can be: a view whose storage
    is smaller than its elements (``torch.ones(1).expand(n, n)``, a mask) as the same view of a copy of
    that storage; any other as its elements. Judged before anything is copied: where even the smaller
    copy would not fit in what is left to bring back, :class:`NotReturnable` (a dense copy of an
    expanded view can be many times the rank's memory)."""
    import torch
    if t.layout != torch.strided or t.is_meta or t.is_quantized or t.is_nested:
        return t.to("cpu", copy=t.device.type == "cpu")   # (what cannot come back says so as it pickles)
    dense = t.numel() * t.element_size()
    storage = t.untyped_storage().nbytes()
    if isinstance(sink, _Limited) and min(dense, storage) > sink.left():
        raise sink.too_large()
    if not smaller_as_view(t):
        return t.to("cpu", copy=t.device.type == "cpu")
    own = t.untyped_storage().clone() if t.device.type == "cpu" else t.untyped_storage().cpu()
    return torch.empty(0, dtype=t.dtype).set_(own, t.storage_offset(), t.size(), t.stride())


def _process_bound(obj) -> str | None:
    import torch
    if isinstance(obj, type):
        return None
    if isinstance(obj, torch.nn.Module):
        inner = obj.module if isinstance(obj, torch.nn.parallel.DistributedDataParallel) else obj
        return f"a torch.nn.Module ({type(inner).__name__})"
    if isinstance(obj, torch.optim.Optimizer):
        return f"an optimizer ({type(obj).__name__})"
    if isinstance(obj, torch.utils.data.DataLoader):
        return "a DataLoader"
    for cls in type(obj).__mro__:
        if (cls.__module__.split(".")[0], cls.__name__) in _PROCESS_BOUND:
            return _CALLED.get(cls.__name__) or f"{'an' if cls.__name__[0] in 'AEIOU' else 'a'} {cls.__name__}"
    return None
