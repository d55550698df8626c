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

__all__ = ["RETURN_LIMIT", "NotReturnable", "pickled_for_notebook"]

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

    def write(self, b) -> int:
        if self.tell() + memoryview(b).nbytes > self.limit:   # (protocol 5 writes PickleBuffers too)
            raise NotReturnable(f"larger than the {self.limit >> 20} MB a cell brings back; save it from the cell")
        return super().write(b)


class _Pickler(cloudpickle.CloudPickler):
    def reducer_override(self, obj):
        import torch
        if isinstance(obj, torch.Tensor):
            cpu = obj.detach().to("cpu", copy=obj.device.type == "cpu")   # a copy: not a view of the rank's
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
