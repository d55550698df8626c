"""What a ``%%dataparallel`` cell bound or changed, besides models and plain values, that may come back.

Two kinds, both collected on rank 0 (:mod:`.rank_state`) and applied by :mod:`.results`:

* **objects the cell assigned** (``preds = trainer.predict(test)``, a numpy array, a dataclass, a
  tensor): they come back pickled, every tensor detached and on the CPU, unless they hold what
  belongs to the ranks (a module, an optimizer, a DataLoader, a framework's trainer) or are larger
  than :data:`RETURN_LIMIT`; then the note names them with the reason;
* **attributes set on the notebook's objects** (``args.num_train_epochs = 1`` in the cell, or a
  callback of a class defined in the notebook appending to ``self.losses``): their new plain
  values are set on the notebook's objects, as after a plain cell.

In a notebook::

    %%dataparallel
    result = trainer.train()
    preds = trainer.predict(test_ds)        # PredictionOutput of numpy arrays: comes back
    loss_logger.losses                      # appended to by a callback: the notebook's list has them
"""
from __future__ import annotations

import copy
import io
import pickle

import cloudpickle

from ..cell.values import is_plain_value

__all__ = ["RETURN_LIMIT", "NotReturnable", "pickled_for_notebook", "attribute_snapshot", "changed_attributes"]

RETURN_LIMIT = 256 * 2**20   # bytes of pickled objects one cell brings back, all together

# (package root, class name): framework objects bound to the ranks' processes.
_PROCESS_BOUND = {("transformers", "Trainer"), ("accelerate", "Accelerator"), ("lightning", "Trainer"),
                  ("pytorch_lightning", "Trainer"), ("lightning", "Fabric"), ("lightning_fabric", "Fabric"),
                  ("torch", "ProcessGroup")}
_MISSING = object()


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
        return f"a torch.nn.Module ({type(obj).__name__})"
    if isinstance(obj, torch.optim.Optimizer):
        return f"an optimizer ({type(obj).__name__})"
    if isinstance(obj, torch.utils.data.DataLoader):
        return "a DataLoader"
    for cls in type(obj).__mro__:
        if (cls.__module__.split(".")[0], cls.__name__) in _PROCESS_BOUND:
            return f"a {cls.__name__}"
    return None


def attribute_snapshot(ns: dict, watched: list[str], assigned: dict[str, list[str]]) -> dict:
    """Rank 0, as the cell starts: copies of the public plain attributes of the ``watched`` objects
    (instances of the notebook's classes) and of the attributes the cell assigns (``assigned``)."""
    snapshot: dict = {}
    for name in dict.fromkeys([*watched, *assigned]):
        obj = ns.get(name)
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            continue
        kept = {k: copy.deepcopy(v) for k, v in attrs.items()
                if name in watched and not k.startswith("_") and is_plain_value(v)}
        for k in assigned.get(name, []):
            kept[k] = copy.deepcopy(attrs.get(k, _MISSING))
        snapshot[name] = kept
    return snapshot


def changed_attributes(ns: dict, snapshot: dict, watched: list[str]) -> tuple[dict, list[str]]:
    """After the cell: ``({name: {attr: new plain value}}, not returned)`` against ``snapshot``."""
    changed: dict = {}
    dropped: list[str] = []
    for name, before in snapshot.items():
        attrs = getattr(ns.get(name), "__dict__", None)
        if not isinstance(attrs, dict):
            continue
        keys = list(before)
        if name in watched:
            keys += [k for k in attrs if k not in before and not k.startswith("_") and is_plain_value(attrs[k])]
        for k in keys:
            now = attrs.get(k, _MISSING)
            if now is _MISSING or _same(now, before.get(k, _MISSING)):
                continue
            if is_plain_value(now):
                changed.setdefault(name, {})[k] = copy.deepcopy(now)
            else:
                dropped.append(f"{name}.{k} (not a plain value)")
    return changed, dropped


def _same(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == raises (a tensor of several elements): changed
        return False
