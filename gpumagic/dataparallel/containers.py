"""Notebook dicts and lists holding objects, whose items a ``%%dataparallel`` cell changes.

A dict or list of plain values (``history = []``) comes back whole as a value. One that also
holds objects (``held = {"n": 1, "model": model}``, ``runs = [cfg, ...]``) cannot: a copy would
replace the notebook's objects inside it. Yet a plain cell's ``held["n"] = 2``,
``runs.append(0.5)`` or ``del held["old"]`` changes it, written in the cell or inside a notebook
function the cell calls. So rank 0 takes a shallow record of each such container the cell reaches
before it runs (:func:`snapshot`), compares after (:func:`changes`), and describes the new
contents in terms of the old items (:func:`apply` rebuilds them from the notebook's own objects):

* an item still the object it was: the notebook's item at its old place (``("old", key)``);
* a plain value, new or changed (``held["stats"]["n"] += 1`` too): rank 0's (``("value", v)``);
* a tensor or numpy array changed in place (``held["buf"].add_(1)``): rank 0's contents, written
  into the notebook's item (``("filled", key, v)``); a new one: rank 0's, on the CPU.

A container that came to hold anything else (a new object: it would be a copy), or new tensors
beyond what one cell brings back, does not come back; the cell's note names it. Lists and dicts
held as attributes of notebook objects (``self.outs.append(out.detach())``) are described the same
way (:mod:`.returnable`), and so is a notebook list of plain values the cell filled with tensors
(``preds = []``, then ``preds.append(model(x))``: :func:`grown`). Cost: one pass over each
container's items before and after the cell on rank 0 (containers of at most
:data:`~.returnable.WATCHED_ITEMS` items), copies of its plain items, and a fingerprint of each
tensor or array item (:mod:`.touched`).

Runs in the workers (:func:`snapshot`, :func:`changes`) and in the kernel (:func:`apply`).
"""
from __future__ import annotations

import copy
import logging

from ..cell.values import detached, equal_values, is_plain_value
from ..procs.returning import RETURN_LIMIT
from .touched import fingerprint, is_array

logger = logging.getLogger(__name__)

__all__ = ["snapshot", "changes", "apply", "is_container", "records_of", "describe", "rebuilt", "made_in_cell",
           "array_bytes", "Room", "grown", "planned", "refill_all"]

_PLAIN, _ARRAY, _OBJECT = "plain", "array", "object"


def is_container(value, limit: int) -> bool:
    """A dict or list (exactly) of at most ``limit`` items that holds more than plain values."""
    return type(value) in (dict, list) and len(value) <= limit and not is_plain_value(value)


def _items(container) -> list:
    return list(container.items() if isinstance(container, dict) else enumerate(container))


def _record(item):
    """What is kept of one item to compare: the object, and a copy (plain) or a fingerprint (array)."""
    if is_array(item):
        return item, _ARRAY, fingerprint(item)
    if not _large(item) and is_plain_value(item):
        try:
            return item, _PLAIN, copy.deepcopy(detached(item))
        except Exception:   # a plain value that does not copy (rare): compared by identity
            logger.debug("an item could not be copied to compare", exc_info=True)
    return item, _OBJECT, None


# A plain item with more than this many items (a history of a million losses, a vocabulary) is not
# copied to compare, each cell, on the way to the first step: it is compared by identity, so a change
# inside it is missed, as for the attributes of notebook objects (returnable.py).
_COPIED_ITEMS = 10_000


def _large(value) -> bool:
    return isinstance(value, (list, tuple, dict)) and len(value) > _COPIED_ITEMS


def snapshot(ns: dict, names: list[str]) -> dict:
    """Rank 0, as the cell starts: ``{name: (container, {key: record})}``."""
    return {n: (ns[n], records_of(ns[n])) for n in names if n in ns}


def changes(ns: dict, before: dict, room: Room | None = None,
            described: set[int] | None = None) -> tuple[dict, list[str]]:
    """After the cell: ``({name: new contents}, not returned)``. New contents: a list of entries (a list)
    or a list of ``(key, entry)`` (a dict); entries as the module says. ``room``: the bytes of tensors
    they may bring back, shared with the cell's other containers. ``described``: ids of containers
    already described (as an attribute's, or under another name: ``b = a``), skipped; those described
    here are added."""
    room = room or Room()
    described = set() if described is None else described
    back: dict = {}
    dropped: list[str] = []
    for name, (container, records) in before.items():
        if ns.get(name) is not container:
            continue   # rebound by the cell: it comes back as an assigned name
        if id(container) in described:
            continue   # one container under two names comes back once (the kernel refills it once)
        described.add(id(container))
        entries, changed, foreign = describe(container, records)
        if not changed:
            continue
        why = f"{made_in_cell(foreign)}, so {name} is left as it was; change it in a plain cell" if foreign else None
        _bring_back(name, container, entries, why, room, back, dropped)
    return back, dropped


def grown(ns: dict, names: list[str], room: Room) -> tuple[dict, list[str]]:
    """After the cell: notebook lists and dicts of plain values as it started (``outs = []``) that the cell
    filled with tensors or arrays in place (``outs.append(model(x).detach())``), as :func:`changes`
    answers; those holding other objects are named."""
    back: dict = {}
    dropped: list[str] = []
    for name in names:
        container = ns[name]
        entries, _, foreign = describe(container, {})
        why = (f"holds objects that are not plain values, tensors or arrays, so {name} is left as it was"
               if foreign else None)
        _bring_back(name, container, entries, why, room, back, dropped)
    return back, dropped


def _bring_back(name: str, container, entries: list, why: str | None, room: Room, back: dict,
                dropped: list[str]) -> None:
    """``entries`` into ``back`` where nothing stops them (``why``) and their tensors fit in ``room``;
    else the reason into ``dropped``."""
    if why is None and room.take(array_bytes(entries, type(container))):
        back[name] = entries
    else:
        dropped.append(f"{name} ({why or f'{room.too_large}, so {name} is left as it was'})")


class Room:
    """What is left of the bytes of tensors and arrays one cell's containers bring back
    (:data:`~gpumagic.procs.returning.RETURN_LIMIT`, as for the objects it binds)."""

    def __init__(self, limit: int = RETURN_LIMIT):
        self.left = limit
        self.too_large = f"its tensors are larger than the {limit >> 20} MB a cell brings back; save them from the cell"

    def take(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit; taken from what is left where they do."""
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


def records_of(container) -> dict:
    """``{key: record}`` of a dict's or list's items, to compare after the cell (:func:`describe`)."""
    return {k: _record(v) for k, v in _items(container)}


def describe(container, records: dict) -> tuple[list, bool, list[str]]:
    """``container``'s contents in terms of the items ``records`` kept (``{}``: a container new to the
    notebook): ``(entries, changed, keys holding an object made in the cell)``; entries as the module
    says, ``(key, entry)`` for a dict."""
    # (plain values are compared by value: small numbers are one object wherever they are)
    by_id = {id(r[0]): k for k, r in records.items() if r[1] != _PLAIN}
    entries: list = []
    foreign: list[str] = []
    changed = len(container) != len(records)
    for key, item in _items(container):
        before_here = records.get(key)
        if before_here is not None and before_here[1] == _OBJECT and item is before_here[0]:
            # the same object at the same place (a model, a large plain list): nothing to walk
            entries.append(("old", key) if isinstance(container, list) else (key, ("old", key)))
            continue
        if is_plain_value(item) and not is_array(item):
            unchanged = before_here is not None and before_here[1] == _PLAIN and \
                equal_values(detached(item), before_here[2])
            entry: tuple = ("value", detached(item))
            if before_here is not None and item is before_here[0] and isinstance(item, (list, dict)):
                # the notebook's own list or dict (``held["hist"] is hist``): kept, refilled where changed,
                # so other names holding it see the change and its type (a defaultdict) stays
                entry = ("old", key) if unchanged else ("filled", key, detached(item))
            changed = changed or not unchanged
        elif id(item) in by_id:
            old_key = by_id[id(item)]
            changed = changed or old_key != key
            if records[old_key][1] == _ARRAY and fingerprint(item) != records[old_key][2]:
                entry, changed = ("filled", old_key, detached(item)), True
            else:
                entry = ("old", old_key)
        elif is_array(item) and fingerprint(item) is not None:
            entry, changed = ("value", detached(item)), True
        else:
            changed = True
            foreign.append(repr(key))
            continue
        entries.append(entry if isinstance(container, list) else (key, entry))
    return entries, changed, foreign


def made_in_cell(keys: list[str]) -> str:
    """The note's words for a container whose ``keys`` hold objects made in the cell."""
    return (f"the cell changed its items, and {', '.join(keys[:3])}{' and more' if len(keys) > 3 else ''} now "
            f"hold{'s' if len(keys) == 1 else ''} an object made in the cell, which does not come back")


def array_bytes(entries: list, kind: type) -> int:
    """Bytes of the tensors and arrays rank 0 sends for a ``kind`` (list or dict) of ``entries``: new
    ones, and contents filled into the notebook's."""
    plain = entries if issubclass(kind, list) else [e for _, e in entries]
    return sum(e[-1].nbytes for e in plain if e[0] in ("value", "filled") and is_array(e[-1]))


def rebuilt(old, kind: type, entries: list):
    """A new ``kind`` (list or dict) of ``entries``, their old items taken from the notebook's ``old``."""
    if kind is list:
        return [_item(old, e) for e in entries]
    return {k: _item(old, e) for k, e in entries}


def apply(ns: dict, contents: dict) -> list[str]:
    """In the kernel: each notebook container takes its new contents in place (the same object, as
    other names may hold it); returns their names."""
    plans: dict = {}
    done = planned(ns, contents, plans)
    refill_all(plans)
    return done


def planned(ns: dict, contents: dict, plans: dict) -> list[str]:
    """In the kernel, before any container is refilled: each named container's new contents, built from
    the notebook's objects as they still are, into ``plans`` (``{id(container): (container, new)}``; a
    container reached under two names is built once, the first one winning); returns their names."""
    done = []
    for name, entries in contents.items():
        container = ns.get(name)
        if not isinstance(container, (list, dict)):
            continue
        if id(container) not in plans:   # (a defaultdict's new items: refilled into it, so it stays one)
            plans[id(container)] = (container, rebuilt(container, list if isinstance(container, list) else dict,
                                                        entries))
        done.append(name)
    return done


def refill_all(plans: dict) -> None:
    """Each container of :func:`planned`'s ``plans`` takes its new contents."""
    for container, new in plans.values():
        refill_container(container, new)


def refill_container(container, new) -> None:
    """The notebook's list or dict takes ``new``'s items, staying the same object."""
    if isinstance(container, list):
        container[:] = new
    else:
        container.clear()
        container.update(new)


def _item(container, entry):
    """The object an entry of :func:`changes` stands for, from the notebook's ``container`` as it was."""
    from .results import refill
    if entry[0] == "old":
        return container[entry[1]]
    if entry[0] == "filled":
        old = container[entry[1]]
        return old if refill(old, entry[2]) else entry[2]
    return entry[1]
