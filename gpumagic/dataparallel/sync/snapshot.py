"""Rank 0, as the cell starts: the notebook objects the cell may change, and where the notebook holds each one.

:func:`take` walks from the names the cell reads by the rules of :mod:`.reach`, keeping of each object it
meets a shallow record to compare after the cell: a list's or dict's items (the objects, not copies), an
object's attributes, a tensor's or array's fingerprint. It also keeps where each object the notebook held
was (its path, the shortest: a name of its own first), for the by-name pickler.

Cost: one pass over the items and attributes it meets (up to :data:`~.reach.WALKED_ITEMS` items a list or
dict, :data:`~.reach.DEPTH` levels down), a list of a long one's items, and a fingerprint of each tensor
(its bytes up to :data:`~.reach.READ_WHOLE_BYTES`, else its version counter). Runs on rank 0: no IPython.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol import Watch
from .paths import MISSING, follow
from .pickler import VALUES
from .reach import COMPARED_ITEMS, DEPTH, KINDS, READ_WHOLE_BYTES, children, fingerprint, is_array, is_watched

__all__ = ["Seen", "Snapshot", "take", "items_of", "last_item", "path_of"]


@dataclass
class Seen:
    """One object rank 0 compares after the cell."""
    path: tuple
    obj: Any
    kind: str                       # "items" (a list or dict), "long" (too long to compare), "attrs", "array"
    before: Any                     # items: (keys or None, values); long: (length, last item); attrs: a dict
                                    # copy; array: its fingerprint
    public: bool = False            # attrs: every public attribute comes back (a watched object)
    assigned: frozenset = frozenset()   # attrs: those the cell's code sets
    read_whole: int = READ_WHOLE_BYTES  # array: bytes up to which it is read, not judged by its version
    filled: bool = False            # array: the cell sets its items: sent whatever its fingerprint says


@dataclass
class Snapshot:
    """What :func:`take` keeps."""
    seen: dict[int, Seen] = field(default_factory=dict)
    table: dict[int, tuple] = field(default_factory=dict)    # id -> (ref, object): the notebook's objects
    names: dict = field(default_factory=dict)                # the namespace's bindings as the cell started


def items_of(container) -> tuple:
    """``(keys or None, values)`` of a list or dict: the objects themselves, to compare by identity."""
    if isinstance(container, dict):
        return list(container), list(container.values())
    return None, list(container)


def last_item(container) -> tuple:
    """A list's last item, or a dict's last ``(key, value)``, as a tuple (empty for an empty one)."""
    if not container:
        return ()
    return next(reversed(container.items())) if isinstance(container, dict) else (container[-1],)


def _record(path: tuple, value, depth: int, via_attr: bool, filled: bool) -> Seen | None:
    if type(value) in KINDS:
        if len(value) > COMPARED_ITEMS:
            return Seen(path, value, "long", (len(value), last_item(value)))
        return Seen(path, value, "items", items_of(value))
    if is_watched(value):
        return Seen(path, value, "attrs", dict(vars(value)), public=True)
    if is_array(value):
        # a name's tensor, a list's item and an attribute: their bytes; deeper items, by their version
        read_whole = READ_WHOLE_BYTES if via_attr or depth <= 1 else 0
        key = fingerprint(value, read_whole)
        if key is not None or filled:
            return Seen(path, value, "array", key, read_whole=read_whole, filled=filled)
    return None


def path_of(dotted: str) -> tuple:
    """``"cfg.optim"`` as a path."""
    root, *attrs = dotted.split(".")
    return (root, *(("attr", a) for a in attrs))


def take(ns: dict, watch: Watch, known: dict | None = None) -> Snapshot:
    """The snapshot of ``ns`` for the cell ``watch`` describes; ``known``: ``{id: (ref, object)}`` of objects
    the strategy names itself (a trained module inside its wrapper, its layers)."""
    snap = Snapshot(names=dict(ns))
    # the notebook's names first: the shortest way to an object is a name of its own
    for name, value in ns.items():
        if not name.startswith("__") and not isinstance(value, VALUES):
            snap.table.setdefault(id(value), (("path", (name,)), value))
    snap.table.update(known or {})
    frontier: list[tuple[tuple, Any, bool]] = [((root,), ns[root], False) for root in watch.roots if root in ns]
    for depth in range(DEPTH + 1):
        below: list[tuple[tuple, Any, bool]] = []
        for path, value, via_attr in frontier:
            if id(value) in snap.seen or isinstance(value, VALUES):
                continue
            record = _record(path, value, depth, via_attr, filled=len(path) == 1 and path[0] in watch.filled)
            if record is not None:
                snap.seen[id(value)] = record
            snap.table.setdefault(id(value), (("path", path), value))
            if depth < DEPTH and record is not None and record.kind in ("items", "attrs"):
                below += [((*path, step), child, step[0] == "attr") for step, child in children(value)]
        frontier = below
    _assigned_attributes(ns, watch, snap)
    return snap


def _assigned_attributes(ns: dict, watch: Watch, snap: Snapshot) -> None:
    """The objects whose attributes the cell's code sets (``args.epochs = 3``, ``del holder.cache``), whatever
    their class: those attributes come back."""
    for dotted, attrs in watch.set_attributes:
        path = path_of(dotted)
        obj = follow(ns, path)
        if obj is MISSING or not isinstance(getattr(obj, "__dict__", None), dict):
            continue
        seen = snap.seen.get(id(obj))
        if seen is None or seen.kind != "attrs":
            seen = snap.seen[id(obj)] = Seen(path, obj, "attrs", dict(vars(obj)))
            snap.table.setdefault(id(obj), (("path", path), obj))
        seen.assigned = seen.assigned | frozenset(attrs)

