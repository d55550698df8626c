"""Objects rank 0 sends back that hold the notebook's own datasets and tensors: those travel by name.

A LightningDataModule's ``setup()`` (Lightning's MNIST pattern) splits a dataset:
``self.train_set, self.val_set = random_split(full, [55000, 5000])``. After a plain cell each
``Subset.dataset`` is the notebook's ``full``; a plain copy would give the notebook a second ``full``
(twice the memory, and changes to one not seen by the other). So rank 0 pickles such objects with
the notebook's datasets and tensors replaced by where the notebook holds them (``"full"``,
``"dm.ds"``: :func:`notebook_objects`), and the kernel puts its own objects back in their places
(:func:`loaded`), read before the cell's results change any name.

Runs in the workers (:func:`notebook_objects`, :func:`pickled`) and in the kernel (:func:`loaded`).
"""
from __future__ import annotations

import io
import logging
import pickle

from ..procs.returning import RETURN_LIMIT, NotReturnable
from ..procs.returning import _Limited as Limited
from ..procs.returning import _Pickler as ReturningPickler
from .touched import is_array

logger = logging.getLogger(__name__)

__all__ = ["notebook_objects", "pickled", "pickled_item", "loaded", "resolved"]


def _by_reference(value) -> bool:
    """What travels by name: datasets and plain tensors and arrays (numbers and strings are values)."""
    import torch
    return isinstance(value, torch.utils.data.Dataset) or is_array(value)


def notebook_objects(ns: dict, assigned: list[str], attributes: dict) -> dict[int, tuple[str, object]]:
    """Rank 0, as the cell starts: ``{id: (path, object)}`` for the datasets and tensors bound to the
    notebook's names the cell does not bind, and held by the notebook objects it watches
    (``attributes``: :func:`~.returnable.attribute_snapshot`'s ``{path: (kept, all attributes)}``)."""
    found: dict[int, tuple[str, object]] = {}
    for path, (_, attrs) in attributes.items():
        for k, v in attrs.items():
            if _by_reference(v) and not k.startswith("_"):
                found.setdefault(id(v), (f"{path}.{k}", v))
    skip = set(assigned)
    for name, v in ns.items():   # (a name of its own comes first: the shorter way to it)
        if not name.startswith("_") and name not in skip and _by_reference(v):
            found[id(v)] = (name, v)
    return found


# values, not objects to share: they travel as themselves
_VALUES = (str, bytes, int, float, complex, bool, type(None), tuple, frozenset)


class _Pickler(ReturningPickler):
    def __init__(self, file, refs: dict):
        super().__init__(file)
        self.refs = refs

        self.used: set[str] = set()

    def persistent_id(self, obj):
        if isinstance(obj, _VALUES):   # (an int a notebook name holds too is a value, not that name's object)
            return None
        held = self.refs.get(id(obj))
        if held is None or held[1] is not obj:
            return None
        self.used.add(held[0])
        return held[0]


def pickled(value, refs: dict[int, tuple[str, object]], limit: int = RETURN_LIMIT) -> tuple[bytes, list[str]]:
    """``value`` pickled for the kernel as :func:`~gpumagic.procs.returning.pickled_for_notebook` pickles
    it, the notebook's objects among ``refs`` by their paths; and those paths. Raises
    :class:`NotReturnable` with the reason."""
    sink = Limited(limit)
    pickler = _Pickler(sink, refs)
    try:
        pickler.dump(value)
    except NotReturnable:
        raise
    except Exception as exc:  # noqa: BLE001 - anything that cannot be pickled: its reason goes in the note
        raise NotReturnable(f"{type(exc).__name__}: {exc}") from None
    return sink.getvalue(), sorted(pickler.used)


def pickled_item(value, refs: dict[int, tuple[str, object]]) -> tuple[bytes, list[str]] | None:
    """:func:`pickled`, or None where ``value`` cannot come back (an item of a notebook list the cell
    appended to: ``runs.append(Run(cfg, acc))``, which is then named in the note)."""
    try:
        return pickled(value, refs)
    except NotReturnable:
        logger.debug("a %s cannot come back", type(value).__name__, exc_info=True)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, objects: dict):
        super().__init__(file)
        self.objects = objects

    def persistent_load(self, pid):
        if pid not in self.objects:
            raise pickle.UnpicklingError(f"the notebook no longer holds {pid}")
        return self.objects[pid]


def resolved(paths: list[str], ns: dict) -> dict:
    """In the kernel, before the cell's results bind anything: ``{path: object}`` for the ``paths`` a
    blob names, as the notebook holds them now (as rank 0 held them when the cell started)."""
    # (imported here: returnable and containers read this module)
    from .returnable import follow_path
    found = {}
    for path in paths:
        value = follow_path(ns, path)
        if value is not None:
            found[path] = value
    return found


def loaded(blob: bytes, objects: dict):
    """The object ``blob`` holds, with the notebook's ``objects`` (:func:`resolved`) in their places."""
    return _Unpickler(io.BytesIO(blob), objects).load()
