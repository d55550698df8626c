"""What a ``%%dataparallel`` cell bound or changed, besides models and plain values, that may come back.

Two kinds, both collected on rank 0 (:mod:`.rank_state`) and applied by :mod:`.results`:

* **objects the cell assigned** (``preds = trainer.predict(test)``, a numpy array, a dataclass, a
  tensor): they come back pickled, every tensor detached and on the CPU, the notebook's own objects
  and the models the cell made in them by name (``holder = {"net": model}``: :mod:`.by_reference`),
  unless they hold what else belongs to the ranks (a module, an optimizer, a DataLoader, a
  framework's trainer made there) or are larger than :data:`~gpumagic.procs.returning.RETURN_LIMIT`;
  then the note names them with the reason;
* **attributes set on the notebook's objects** (``args.num_train_epochs = 1`` in the cell, and
  deeper, ``cfg.optim.lr = 0.1``; on instances of classes defined in the notebook and on namespaces
  (``argparse.Namespace``, ``SimpleNamespace``), and on such objects they hold, any public attribute
  that changed, as a callback appending to ``self.losses`` or a notebook function setting
  ``args.epochs``): their new plain values are set on the notebook's objects, as after a plain cell
  (one set to a notebook object is that object, :class:`HeldByName`; to another object the cell made,
  rank 0's, pickled, :class:`PickledObject`), and those the cell deleted (``del cfg.name``) are
  deleted there; lists and dicts of tensors
  (``self.outs.append(model(x).detach())``) take rank 0's tensors, on the CPU (:mod:`.containers`),
  lists and dicts of more than 10,000 items (a history of every step) what changed in them, compared by
  identity (:mod:`.long_items`), and torch Datasets (a DataModule's ``self.train_set``) come back
  pickled, holding the notebook's own datasets and tensors where they did (:mod:`.by_reference`);
* **names bound to the notebook's own objects** (``alias = args``): bound to the same object.

In a notebook::

    %%dataparallel
    result = trainer.train()
    preds = trainer.predict(test_ds)        # PredictionOutput of numpy arrays: comes back
    loss_logger.losses                      # appended to by a callback: the notebook's list has them
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..cell.values import detached, is_plain_value
from ..procs.returning import smaller_as_view
from .by_reference import pickled_item
from .container_models import made_model, model_bytes
from .containers import (
    Room,
    array_bytes,
    compared_items,
    describe,
    detached_typed,
    holds_containers,
    is_container,
    is_list_or_dict,
    kind_of,
    made_in_cell,
    same_value,
)
from .long_items import LONG_ITEMS, TooLong
from .touched import fingerprint, is_array

__all__ = ["HeldByName", "PickledObject", "attribute_snapshot", "changed_attributes", "deleted_attributes",
           "is_watched", "watched_paths", "follow_path", "WATCHED_ITEMS", "AttributeChanges", "is_compared",
           "attribute_items"]

_MISSING = object()
# A watched attribute holding a longer list or dict (a history of every step) is not copied to compare: too slow;
# its items are compared by identity, up to :data:`~.long_items.LONG_ITEMS` (:mod:`.long_items`).
WATCHED_ITEMS = 10_000


def is_watched(value) -> bool:
    """Whether every public attribute of ``value`` that a cell changes comes back (not only those the
    cell's own code assigns): instances of the notebook's classes, and plain namespaces."""
    import argparse
    import types
    cls = type(value)
    return isinstance(getattr(value, "__dict__", None), dict) and (
        cls.__module__ == "__main__" or cls in (argparse.Namespace, types.SimpleNamespace))


def watched_paths(ns: dict, names: list[str], depth: int = 3) -> list[str]:
    """``names`` that are :func:`is_watched`, and the dotted paths of watched objects they hold
    (``cfg.optim`` of ``cfg = SimpleNamespace(optim=SimpleNamespace(lr=0.1))``), ``depth`` levels
    down; each object once."""
    seen: set[int] = set()
    paths: list[str] = []
    frontier = [(n, ns.get(n)) for n in names]
    for _ in range(depth):
        nxt = []
        for path, value in frontier:
            if id(value) in seen or not is_watched(value):
                continue
            seen.add(id(value))
            paths.append(path)
            nxt += [(f"{path}.{k}", v) for k, v in vars(value).items() if not k.startswith("_")]
        frontier = nxt
    return paths


def is_compared(value) -> bool:
    """Whether rank 0 compares a watched object's attribute holding ``value`` (:func:`attribute_snapshot`):
    tensors and arrays, plain values, and lists and dicts, up to a million items."""
    return is_array(value) or _small(value) and is_plain_value(value) or is_list_or_dict(value, LONG_ITEMS)


def follow_path(ns: dict, path: str):
    """The object ``path`` (``"cfg.optim"``) names in ``ns``; None where a step is missing."""
    root, *attrs = path.split(".")
    value = ns.get(root)
    for attr in attrs:
        value = getattr(value, attr, None)
    return value


def attribute_snapshot(ns: dict, watched: list[str], assigned: dict[str, list[str]]) -> dict:
    """Rank 0, as the cell starts: ``{path: (copies of attributes, names of all its attributes)}`` for the
    ``watched`` objects (their public plain attributes, lists and dicts, long ones by the identity of their
    items, and fingerprints of their tensors and arrays: one pass over each one's bytes, up to 256 MB each)
    and for the attributes the cell assigns (``assigned``); paths as :func:`follow_path` reads them."""
    snapshot: dict = {}
    for name in dict.fromkeys([*watched, *assigned]):
        attrs = getattr(follow_path(ns, name), "__dict__", None)
        if not isinstance(attrs, dict):
            continue
        kept: dict = {}
        if name in watched:
            for k, v in attrs.items():
                if k.startswith("_"):
                    continue
                if is_array(v):   # (0-d tensors too: changed in place or rebound, each as it happened)
                    kept[k] = _Array(v)
                elif holds_containers(v, WATCHED_ITEMS):   # (self.history["val"]: its lists stay the notebook's)
                    kept[k] = _Items(v)
                elif _small(v) and is_plain_value(v):
                    kept[k] = _copied(v)
                elif is_list_or_dict(v):   # (self.outs holding tensors, self.losses of every step: items compared)
                    kept[k] = _listed(v)
        for k in assigned.get(name, []):
            v = attrs.get(k, _MISSING)
            # a plain value is copied to compare; another is compared by identity (copying may fail)
            kept[k] = _Array(v) if is_array(v) else _Items(v) if holds_containers(v, WATCHED_ITEMS) else \
                _copied(v) if _small(v) and is_plain_value(v) else _listed(v) if is_list_or_dict(v) else _Held(v)
        # (all its attributes, held: a list bound anew is told from the same list refilled)
        snapshot[name] = (kept, dict(attrs))
    return snapshot


@dataclass(frozen=True)
class HeldByName:
    """An attribute the cell set to one of the notebook's objects or to a model it made (``tracker.model =
    model``): in the notebook, the object of that name (:func:`changed_attributes`)."""
    name: str


@dataclass(frozen=True)
class PickledObject:
    """An attribute the cell set to an object it made (``args.split = Split(...)``): rank 0's, pickled,
    holding the notebook's objects where it did, by their names (:mod:`.by_reference`)."""
    blob: bytes
    paths: tuple


@dataclass
class AttributeChanges:
    """What the cell changed on the notebook's objects, ``{path: {attribute: ...}}`` each, and what cannot
    come back (``dropped``: the note's entries)."""
    changed: dict = field(default_factory=dict)    # new plain values, tensors and arrays bound anew, models made
    filled: dict = field(default_factory=dict)     # contents of tensors and arrays changed in place
    items: dict = field(default_factory=dict)      # lists and dicts of tensors: (same object, kind, entries)
    datasets: dict = field(default_factory=dict)   # torch Datasets set on them (rank 0's objects)
    dropped: list = field(default_factory=list)
    described: set = field(default_factory=set)    # ids of the lists and dicts in ``items`` refilled in place
    kept: dict = field(default_factory=dict)       # {path: [attribute]}: lists and dicts in ``changed`` that
    # are still the notebook's own object (refilled there); others were bound anew (set, as other names
    # holding the old one keep it: ``run1 = tr.losses``, then ``tr.losses = []`` in the cell)


def changed_attributes(ns: dict, snapshot: dict, watched: list[str], room: Room | None = None,
                       named: dict | None = None) -> AttributeChanges:
    """After the cell, against ``snapshot``: new values are plain values, and tensors and arrays (rank 0's,
    bound anew); contents are those of tensors and arrays the cell changed in place (``self.buf.add_(1)``,
    ``self.preds[i] = ...``), which the notebook's own take; lists and dicts holding tensors
    (``self.outs.append(out)``) are described by :func:`~.containers.describe` within ``room``, the
    notebook's ``named`` objects by name."""
    room = room or Room()
    out = AttributeChanges()
    for name, (before, present) in snapshot.items():
        attrs = getattr(follow_path(ns, name), "__dict__", None)
        if not isinstance(attrs, dict):
            continue
        keys = list(before)
        if name in watched:   # public attributes the cell added
            keys += [k for k in attrs if k not in present and k not in before and not k.startswith("_")]
        for k in keys:
            now = attrs.get(k, _MISSING)
            was = before.get(k, _MISSING)
            if isinstance(was, _Array) and now is was.value:
                if was.changed():
                    out.filled.setdefault(name, {})[k] = detached(now)
                continue
            if isinstance(was, TooLong) and now is was.value:   # (past a million items: named where changed)
                if was.changed():
                    out.dropped.append(was.note(f"{name}.{k}"))
                continue
            if isinstance(was, _Items) and now is was.value or is_container(now, LONG_ITEMS):
                _describe_items(out, room, name, k, now, was, present.get(k, _MISSING), named)
                continue
            if now is _MISSING or _same(now, was):
                continue
            if smaller_as_view(now) and (blob := pickled_item(now, named or {})) is not None:
                # (an expanded mask: the view of its small storage, judged by that, rather than its elements)
                if room.take(len(blob[0])):
                    out.changed.setdefault(name, {})[k] = PickledObject(blob[0], tuple(blob[1]))
                else:
                    out.dropped.append(f"{name}.{k} ({room.too_large})")
            elif is_array(now) and fingerprint(now) is not None:
                out.changed.setdefault(name, {})[k] = detached(now)
            elif is_plain_value(now):
                out.changed.setdefault(name, {})[k] = _copied(now)
                if isinstance(now, (list, dict)) and now is present.get(k, _MISSING):
                    out.kept.setdefault(name, []).append(k)
            elif (held := (named or {}).get(id(now))) is not None and held[1] is now:
                out.changed.setdefault(name, {})[k] = HeldByName(held[0])   # (tracker.model = model)
            elif _is_dataset(now):   # (a DataModule's setup(): self.train_set, self.val_set = random_split(...))
                out.datasets.setdefault(name, {})[k] = now
            elif (model := made_model(now, named or {})) is not None:   # (self.best_model = copy.deepcopy(model))
                if room.take(model_bytes(model)):
                    out.changed.setdefault(name, {})[k] = model
                else:
                    out.dropped.append(f"{name}.{k} ({room.too_large})")
            elif not is_array(now) and (blob := pickled_item(now, named or {})) is not None:   # (args.split = Split())
                if room.take(len(blob[0])):
                    out.changed.setdefault(name, {})[k] = PickledObject(blob[0], tuple(blob[1]))
                else:
                    out.dropped.append(f"{name}.{k} ({room.too_large})")
            else:
                out.dropped.append(f"{name}.{k} (cannot be pickled, or holds what stays in the ranks)"
                                   if not is_array(now) else
                                   f"{name}.{k} (an array too large to bring back, or of a kind not compared)")
    return out


def _describe_items(out: AttributeChanges, room: Room, name: str, k: str, now, was, held, named) -> None:
    """A list or dict attribute holding tensors or objects: its new contents, in terms of the items it
    held as the cell started (where it was such a container), or the note's entry."""
    records = was.records if isinstance(was, _Items) else {}
    entries, changed, foreign = describe(now, records, named)
    if not changed and now is held:
        return
    if foreign and records:
        out.dropped.append(f"{name}.{k} ({made_in_cell(foreign)}; change it in a plain cell)")
    elif foreign:
        out.dropped.append(f"{name}.{k} (holds objects made in the cell that cannot come back: they cannot be "
                           "pickled, or hold what stays in the ranks)")
    elif not room.take(array_bytes(entries, kind_of(now))):
        out.dropped.append(f"{name}.{k} ({room.too_large})")
    else:
        out.items.setdefault(name, {})[k] = (now is held, kind_of(now), entries)
        if now is held:
            out.described.add(id(now))   # (a notebook name holding it too is not described again)


def attribute_items(snapshot: dict) -> dict:
    """The lists and dicts of :func:`attribute_snapshot` compared item by item, as
    :func:`~.containers.snapshot` answers: ``{"tracker.history": (the list or dict, its records)}``."""
    return {f"{name}.{k}": (v.value, v.records) for name, (kept, _) in snapshot.items() for k, v in kept.items()
            if isinstance(v, _Items)}


def deleted_attributes(ns: dict, snapshot: dict, watched: list[str]) -> dict[str, list[str]]:
    """After the cell: ``{name: [attr, ...]}`` that the cell deleted (``del cfg.name``): those it names in a
    ``del`` (in ``snapshot``'s copies) and the public ones of ``watched`` objects, gone since ``snapshot``."""
    gone: dict[str, list[str]] = {}
    for name, (before, present) in snapshot.items():
        attrs = getattr(follow_path(ns, name), "__dict__", None)
        if not isinstance(attrs, dict):
            continue
        missing = [k for k in present if k not in attrs and (k in before or name in watched and not k.startswith("_"))]
        if missing:
            gone[name] = missing
    return gone


class _Array:
    """A tensor or array attribute as the cell started: the object, and its contents' fingerprint (None
    where not compared: too large, or of a kind torch has no dtype for)."""

    def __init__(self, value):
        self.value = value
        self.key = fingerprint(value)

    def changed(self) -> bool:
        return self.key is not None and fingerprint(self.value) != self.key

    def __eq__(self, other):
        return other is self.value


class _Items:
    """A list or dict attribute holding more than plain values, or a long one: the object, and its items'
    records (:func:`~.containers.compared_items`)."""

    def __init__(self, value):
        self.value = value
        self.records = compared_items(value)

    def __eq__(self, other):
        return other is self.value


class _Held:
    """An attribute's value as the cell started, compared by identity."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return other is self.value


def _listed(value):
    """What is kept of a list or dict attribute to compare: its items, or past :data:`~.long_items.LONG_ITEMS`
    items, its length (:class:`~.long_items.TooLong`), for the note."""
    return _Items(value) if len(value) <= LONG_ITEMS else TooLong(value)


def _copied(value):
    """A copy of a plain value; its tensors detached (a loss with its graph cannot be copied)."""
    return copy.deepcopy(detached_typed(value))


def _is_dataset(value) -> bool:
    import torch
    return isinstance(value, torch.utils.data.Dataset)


def _small(value) -> bool:
    return not (isinstance(value, (list, tuple, dict)) and len(value) > WATCHED_ITEMS)


def _same(a, b) -> bool:
    return b == a if isinstance(b, (_Held, TooLong)) else same_value(a, b)
