"""One pickler for everything a ``%%dataparallel`` cell sends back into the notebook: the notebook's own objects
travel by name.

Rank 0 pickles each new value (a name the cell bound, an attribute it set, the items of a list it
changed) as :func:`~gpumagic.procs.returning.pickled_for_notebook` does (every tensor detached and on the
CPU, a view by its storage, nothing that belongs to the ranks), except that:

* an object the notebook held as the cell started travels as where it held it (a ref: ``("path",
  ("cfg", ("attr", "optim")))``), so the kernel puts its own object there, holding its trained state:
  ``holder = {"net": model}`` holds the notebook's ``model``, ``runs.append(Run(cfg))`` the notebook's
  ``cfg``, ``reg["head"] = model.fc`` its layer;
* a model the cell made (``best = copy.deepcopy(model)``) travels whole, once, beside the pickle
  (``("made", key)``), wherever the cell put it;
* a class the cell defined travels as its name (``("late", "Stat")``): the kernel defines it again,
  then its instances are the notebook's ``Stat``'s.

Numbers, strings and tuples are values, never refs. Runs on rank 0 (:func:`pickled`) and in the
kernel (:func:`loaded`): no IPython.
"""
from __future__ import annotations

import io
import pickle
import sys

import cloudpickle

from ...procs.returning import RETURN_LIMIT, NotReturnable
from ...procs.returning import _Limited as Limited
from ...procs.returning import _Pickler as ReturningPickler
from ..protocol import Blob
from .paths import text
from .reach import is_array

__all__ = ["VALUES", "Room", "MadeModels", "unwrapped", "stands_alone", "pickled", "loaded", "ref_text"]

# values, not objects to share: they travel as themselves (an int a notebook name holds too is no ref)
VALUES = (str, bytes, int, float, complex, bool, type(None), tuple, frozenset, range)


class Room:
    """What is left of what one cell brings back (:data:`~gpumagic.procs.returning.RETURN_LIMIT`)."""

    def __init__(self, limit: int = RETURN_LIMIT):
        self.left = limit
        self.limit = limit

    def take(self, nbytes: int) -> None:
        self.left -= nbytes


def unwrapped(module):
    """The user's module inside DDP wrappers, torch.compile's OptimizedModule and Lightning Fabric's
    ``_FabricModule`` (``fabric.setup(model)``)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):
            module = module._orig_mod
        elif type(module).__name__ == "_FabricModule" and isinstance(
                getattr(module, "_original_module", None), torch.nn.Module):
            module = module._original_module
        else:
            return module


def stands_alone(model, notebook: set[int]) -> bool:
    """A model of its own: holding none of the notebook's modules (ids in ``notebook``; those come back in
    place) and no process-bound wrapper (DDP) inside."""
    from torch.nn.parallel import DistributedDataParallel
    return not any(id(m) in notebook or isinstance(m, DistributedDataParallel) for m in model.modules())


class MadeModels:
    """The models the cell made that come back whole, by key, as the pickler meets them."""

    def __init__(self, table: dict):
        torch = sys.modules.get("torch")
        self.models: dict[int, object] = {}
        self._cannot: dict[int, str] = {}   # id -> why a model the cell made cannot travel
        self._notebook = {id(sub) for _, obj in table.values() if torch is not None and isinstance(obj, torch.nn.Module)
                          for sub in obj.modules()}

    def key(self, obj) -> int | None:
        """``obj``'s key where it is (or wraps) a model the cell made that stands alone, whole; else None."""
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.nn.Module):
            return None
        model = unwrapped(obj)
        if isinstance(model, (torch.jit.ScriptModule, torch.fx.GraphModule)):
            return None   # (TorchScript and fx's modules pickle as programs of their own, which stay in the ranks)
        # (a copy of an fsdp model holds the ranks' shards, DTensors, or nothing, on the meta device: not one)
        whole = all(is_array(t) and t.device.type != "meta" for t in model.state_dict().values())
        if not whole or not stands_alone(model, self._notebook):
            return None
        if id(model) not in self.models:
            why = self._cannot.setdefault(id(model), _cannot_travel(model))
            if why:
                raise NotReturnable(why)
            self.models[id(model)] = model
        return id(model)


class _Sink:
    def write(self, data) -> int:
        return len(data)


class _Shapes(cloudpickle.CloudPickler):
    """Pickles a module's structure, its tensors as nothing: whether it travels, without copying its bytes."""

    def reducer_override(self, obj):
        import torch
        if isinstance(obj, torch.Tensor):
            return torch.empty, (0,)
        return super().reducer_override(obj)


def _cannot_travel(model) -> str:
    """Why a model the cell made cannot travel (it holds a lock, a file...), or "" where it can."""
    try:
        _Shapes(_Sink()).dump(model)
    except Exception as exc:  # noqa: BLE001 - anything that cannot be pickled: its reason goes in the note
        return f"{type(exc).__name__}: {exc}"
    return ""


class _ByName(ReturningPickler):
    def __init__(self, file, table: dict, made: MadeModels):
        super().__init__(file)
        self.table, self.made = table, made
        self.refs: set = set()

    def persistent_id(self, obj):
        if isinstance(obj, VALUES):
            return None
        held = self.table.get(id(obj))
        if held is not None and held[1] is obj:
            self.refs.add(held[0])
            return held[0]
        key = self.made.key(obj)
        if key is None:
            return None
        self.refs.add(("made", key))
        return ("made", key)


def pickled(value, table: dict, made: MadeModels, room: Room) -> Blob:
    """``value`` pickled by name (``table``: ``{id: (ref, object)}`` of the notebook's objects), within what
    is left in ``room``; raises :class:`~gpumagic.procs.returning.NotReturnable` with the reason."""
    sink = Limited(room.left)
    pickler = _ByName(sink, table, made)
    try:
        pickler.dump(value)
    except NotReturnable:
        raise
    except Exception as exc:  # noqa: BLE001 - anything that cannot be pickled: its reason goes in the note
        raise NotReturnable(f"{type(exc).__name__}: {exc}") from None
    data = sink.getvalue()
    room.take(len(data))
    return Blob(data, tuple(sorted(pickler.refs, key=repr)))


def ref_text(ref: tuple) -> str:
    """What the note calls a ref: ``cfg.optim``, a class's name, a model the cell made."""
    return text(ref[1]) if ref[0] == "path" else str(ref[1]) if ref[0] == "late" else "a model made in the cell"


class _Loader(pickle.Unpickler):
    def __init__(self, file, objects: dict):
        super().__init__(file)
        self.objects = objects

    def persistent_load(self, pid):
        if pid not in self.objects:
            raise pickle.UnpicklingError(f"the notebook no longer holds {ref_text(pid)}")
        return self.objects[pid]


def loaded(blob: Blob, objects: dict):
    """In the kernel: the object ``blob`` holds, with ``objects`` (``{ref: object}``) in place of its refs."""
    return _Loader(io.BytesIO(blob.data), objects).load()
