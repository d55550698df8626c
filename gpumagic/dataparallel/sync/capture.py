"""Rank 0, after the cell: what it changed in the notebook, as :class:`~gpumagic.dataparallel.protocol.Changes`.

Against the :class:`~.snapshot.Snapshot` taken as the cell started:

* a tensor or array whose fingerprint changed (``buf.add_(1)``, ``preds[i] = ...``, in a notebook function
  too): its contents, for the notebook's own object (``fills``);
* a list or dict whose items are no longer the objects they were (an append, a key set, moved or
  deleted, in the cell or in a function it calls): its items from the first one that changed, pickled by
  name (``refills``: an append sends the new item, not the history; a change in the middle of a long one
  sends everything after it);
* an object's attribute that is no longer the object it was, added or deleted (``attributes``);
* the names the cell bound (``names``) and deleted.

What cannot come back (it cannot be pickled, holds a module made in the ranks, or is larger than what a
cell brings back) is named in the note with the reason, and the notebook's object is left as it was.

Runs on rank 0: no IPython.
"""
from __future__ import annotations

import logging
import operator
import types

from ...cell.definitions import definitions
from ...cell.values import detached, is_plain_value
from ...procs.returning import NotReturnable
from ..protocol import Changes, Refill, RemoteRepr, Watch
from .paths import MISSING, owner_text, text
from .pickler import MadeModels, Room, pickled, unwrapped
from .reach import COMPARED_ITEMS, fingerprint
from .snapshot import Seen, Snapshot, items_of, last_item

logger = logging.getLogger(__name__)

__all__ = ["capture", "prefix"]

_DEFINED = (types.FunctionType, type, types.ModuleType)


def prefix(before: tuple, now: tuple) -> int:
    """How many leading items of ``now`` (``(keys or None, values)``) are those of ``before``: the same objects,
    under the same keys. (Compared in C: an append to a list of a million floats costs milliseconds.)"""
    (keys_a, a), (keys_b, b) = before, now
    n = _run(map(operator.is_, a, b), min(len(a), len(b)))
    return n if keys_a is None else _run(map(operator.eq, keys_a[:n], keys_b[:n]), n)


def _run(same, limit: int) -> int:
    try:
        return operator.indexOf(same, False)
    except ValueError:   # (no item differs)
        return limit


class _Capture:
    """One cell's capture on rank 0: what it compares, the room left, the models the cell made."""

    def __init__(self, snap: Snapshot, ns: dict, watch: Watch, tree, loop_targets: frozenset):
        self.snap, self.ns, self.loop_targets = snap, ns, loop_targets
        self.changes = Changes()
        self.room = Room()
        # the classes the cell defined travel by name: the kernel defines them again (``stats = [Stat(...)]``)
        definable = definitions(tree) if tree is not None else {}
        for name in watch.assigned:
            value = ns.get(name)
            if isinstance(value, type) and name in definable:
                snap.table[id(value)] = (("late", name), value)
        self.made = MadeModels(snap.table)

    def blob(self, value):
        return pickled(value, self.snap.table, self.made, self.room)

    def note(self, entry: str) -> None:
        self.changes.not_returned.append(entry)

    # ---- in place
    def array(self, seen: Seen) -> None:
        if seen.filled or fingerprint(seen.obj, seen.read_whole) != seen.before:
            self.changes.fills[seen.path] = detached(seen.obj)

    def items(self, seen: Seen) -> None:
        now = items_of(seen.obj)
        keys, values = seen.before
        if len(now[1]) == len(values) and prefix(seen.before, now) == len(values):
            return
        keep = prefix(seen.before, now)
        tail = now[1][keep:] if now[0] is None else list(zip(now[0][keep:], now[1][keep:]))
        try:
            self.changes.refills[seen.path] = Refill(keep, self.blob(tail))
        except NotReturnable as exc:
            self.note(f"{owner_text(seen.path)} ({self._why_items(seen, tail, keep, exc)}, so {text(seen.path)} is "
                      "left as it was; change it in a plain cell)")

    def _why_items(self, seen: Seen, tail: list, keep: int, exc: NotReturnable) -> str:
        """Why a list's or dict's new items cannot come back: the first item that cannot, where one alone cannot
        (an object made in the cell that holds what stays in the ranks); else the reason (their size)."""
        if str(exc).startswith("larger than"):
            return str(exc)
        for i, item in enumerate(tail):
            key, value = (keep + i, item) if isinstance(seen.obj, list) else item
            try:
                pickled(value, self.snap.table, self.made, Room())
            except NotReturnable:
                return (f"the cell changed its items, and {_inner(seen.path, key)} now holds an object made in the "
                        f"cell, which does not come back ({exc})")
        return str(exc)

    def long(self, seen: Seen) -> None:
        size, last = seen.before
        now = last_item(seen.obj)
        if len(seen.obj) != size or len(now) != len(last) or any(x is not y for x, y in zip(now, last)):
            self.note(f"{text(seen.path)} (a {type(seen.obj).__name__} of {size:,} items, longer than the "
                      f"{COMPARED_ITEMS:,} rank 0 compares, so the cell's changes to it stay in the ranks; change it "
                      "in a plain cell, or keep a shorter one)")

    def together(self, entries: dict, late_apart: bool = False) -> tuple[dict, dict]:
        """``entries`` (``{key: value}``) pickled as one ``{key: value}`` blob, so that what they share stays one
        object in the notebook. Where that fails, each is tried alone to find those that cannot come back, and the
        rest go together; ``late_apart``: those holding a class the cell defines go in a blob of their own (the
        kernel loads it once it has defined the class). Returns ``({key: blob}, {key: why not})``."""
        if not entries:
            return {}, {}
        try:
            blob = self.blob(entries)
            if len(entries) == 1 or not (late_apart and any(ref[0] == "late" for ref in blob.refs)):
                return dict.fromkeys(entries, blob), {}
            self.room.take(-len(blob.data))   # (given back: pickled again, apart)
        except NotReturnable:
            logger.debug("what cannot come back is looked for one by one", exc_info=True)
        failed, late = {}, set()
        for key, value in entries.items():
            try:   # (a trial: its bytes are not taken from what the cell brings back)
                refs = pickled({key: value}, self.snap.table, self.made, Room(self.room.left)).refs
                late |= {key} if any(ref[0] == "late" for ref in refs) else set()
            except NotReturnable as exc:
                failed[key] = exc
        out: dict = {}
        for part in ({k: v for k, v in entries.items() if k not in failed and k not in late},
                     {k: v for k, v in entries.items() if k in late}):
            try:
                out.update(dict.fromkeys(part, self.blob(part)) if part else {})
            except NotReturnable as exc:   # (together they are larger than what is left)
                failed.update(dict.fromkeys(part, exc))
        return out, failed

    def attrs(self, seen: Seen) -> None:
        now = getattr(seen.obj, "__dict__", None)
        if not isinstance(now, dict):
            return
        before = seen.before
        wanted = [k for k in dict.fromkeys([*before, *now]) if seen.public and not k.startswith("_")]
        changed = {}
        for k in dict.fromkeys([*wanted, *seen.assigned]):
            old, new = before.get(k, MISSING), now.get(k, MISSING)
            if new is MISSING and old is not MISSING:
                self.changes.deleted_attributes.setdefault(seen.path, []).append(k)
            elif new is not old and new is not MISSING:
                changed[k] = new
        blobs, failed = self.together(changed)
        if blobs:
            self.changes.attributes[seen.path] = blobs
        for k, exc in failed.items():
            self.note(f"{text(seen.path)}.{k} ({_attribute_reason(exc)})")

    # ---- names
    def name(self, name: str) -> object:
        """What comes back of a name the cell bound (:data:`MISSING`: nothing, or only its note)."""
        value = self.ns[name]
        if value is self.snap.names.get(name, MISSING):
            return MISSING   # still the object it was: its changes come back in place
        held = self.snap.table.get(id(value))
        if isinstance(value, _DEFINED) and (held is None or held[1] is not value or held[0][0] == "late"):
            self.changes.defined.append(name)   # (a name bound to the notebook's own function is that function)
            return MISSING
        if name in self.loop_targets and not is_plain_value(value):
            return MISSING   # a loop's batch: it stays in the ranks
        if _wraps_the_notebooks(value, self.snap.table, self.made):
            self.note(f"{name} (wraps the notebook's modules, which got its weights)")
            return MISSING
        return value

    def value(self, value):
        """The last expression's value, for the kernel to show: a blob, or its repr where it cannot travel."""
        if value is None:
            return None
        try:
            return self.blob(value)
        except NotReturnable:
            logger.debug("the last expression cannot travel", exc_info=True)
            try:
                return RemoteRepr(repr(value))
            except Exception as exc:  # noqa: BLE001 - its repr raised too: say so
                return RemoteRepr(f"<{type(value).__name__}: its repr raised {type(exc).__name__}>")


def _inner(path: tuple, key) -> str:
    """Where ``key`` of the list or dict at ``path`` is, inside what the note names (:func:`~.paths.owner_text`):
    ``'outs'['val'][3]`` for ``held['outs']['val']``'s item 3."""
    cut = next((i for i, (kind, _) in enumerate(path[1:], 1) if kind == "item"), len(path))
    keys = [k for _, k in path[cut:]] + [key]
    return repr(keys[0]) + "".join(f"[{k!r}]" for k in keys[1:])


def _attribute_reason(exc: NotReturnable) -> str:
    said = str(exc)
    return said if said.startswith("larger than") else "cannot be pickled, or holds what stays in the ranks"


def _wraps_the_notebooks(value, table: dict, made: MadeModels) -> bool:
    """A module the cell bound that is neither the notebook's (or inside its wrapper) nor a model of its own."""
    import torch
    if not isinstance(value, torch.nn.Module):
        return False
    held = table.get(id(unwrapped(value)))
    if held is not None and held[1] is unwrapped(value):
        return False
    try:
        return made.key(value) is None
    except NotReturnable:   # a model of its own that cannot travel: its pickling says why
        return False


def capture(snap: Snapshot, ns: dict, watch: Watch, *, tree=None, loop_targets=(), answered=frozenset(),
            trained=frozenset(), value=None) -> tuple[Changes, object]:
    """What the cell changed (``answered``: names the strategy brings back itself; ``trained``: the modules,
    optimizers and loaders, which it loads in place); and its last expression's value, ready to travel."""
    work = _Capture(snap, ns, watch, tree, frozenset(loop_targets))
    skip = set(answered) | set(trained)
    bound = {name: work.name(name) for name in watch.assigned if name in ns and name not in skip}
    work.changes.names, failed = work.together({n: v for n, v in bound.items() if v is not MISSING}, late_apart=True)
    for name, exc in failed.items():
        work.note(f"{name} ({exc})")
    compare = {"array": work.array, "items": work.items, "long": work.long, "attrs": work.attrs}
    for seen in list(snap.seen.values()):
        compare[seen.kind](seen)
    work.changes.deleted = [n for n in watch.deleted if n not in ns]
    shown = work.value(value)
    work.changes.made = dict(work.made.models)
    return work.changes, shown
