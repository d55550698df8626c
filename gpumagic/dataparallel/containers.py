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

A container that came to hold anything else (a new object: it would be a copy) does not come
back; the cell's note names it. Cost: one pass over each container's items before and after the
cell on rank 0 (containers of at most :data:`~.returnable.WATCHED_ITEMS` items), copies of its
plain items, and a fingerprint of each tensor or array item (:mod:`.touched`).

Runs in the workers (:func:`snapshot`, :func:`changes`) and in the kernel (:func:`apply`).
"""
from __future__ import annotations

import copy
import logging

from ..cell.values import detached, equal_values, is_plain_value
from .touched import fingerprint, is_array

logger = logging.getLogger(__name__)

__all__ = ["snapshot", "changes", "apply", "is_container"]

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
    if is_plain_value(item):
        try:
            return item, _PLAIN, copy.deepcopy(detached(item))
        except Exception:   # a plain value that does not copy (rare): compared by identity
            logger.debug("an item could not be copied to compare", exc_info=True)
    return item, _OBJECT, None


def snapshot(ns: dict, names: list[str]) -> dict:
    """Rank 0, as the cell starts: ``{name: (container, {key: record})}``."""
    return {n: (ns[n], {k: _record(v) for k, v in _items(ns[n])}) for n in names if n in ns}


def changes(ns: dict, before: dict) -> tuple[dict, list[str]]:
    """After the cell: ``({name: new contents}, not returned)``. New contents: a list of entries (a list)
    or a list of ``(key, entry)`` (a dict); entries as the module says."""
    back: dict = {}
    dropped: list[str] = []
    for name, (container, records) in before.items():
        if ns.get(name) is not container:
            continue   # rebound by the cell: it comes back as an assigned name
        # (plain values are compared by value: small numbers are one object wherever they are)
        by_id = {id(r[0]): k for k, r in records.items() if r[1] != _PLAIN}
        entries: list = []
        foreign: list[str] = []
        changed = len(ns[name]) != len(records)
        for key, item in _items(container):
            before_here = records.get(key)
            if is_plain_value(item) and not is_array(item):
                entry: tuple = ("value", detached(item))
                changed = changed or not (before_here is not None and before_here[1] == _PLAIN
                                          and equal_values(detached(item), before_here[2]))
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
        if not changed:
            continue
        if foreign:
            dropped.append(f"{name} (the cell changed its items, and {', '.join(foreign[:3])} now "
                           f"hold{'s' if len(foreign) == 1 else ''} an object made in the cell, which does not "
                           "come back; change it in a plain cell)")
        else:
            back[name] = entries
    return back, dropped


def apply(ns: dict, contents: dict) -> list[str]:
    """In the kernel: each notebook container takes its new contents in place (the same object, as
    other names may hold it); returns their names."""
    done = []
    for name, entries in contents.items():
        container = ns.get(name)
        if isinstance(container, list) and type(container) is list:
            container[:] = [_item(container, e) for e in entries]
        elif isinstance(container, dict) and type(container) is dict:
            new = {k: _item(container, e) for k, e in entries}
            container.clear()
            container.update(new)
        else:
            continue
        done.append(name)
    return done


def _item(container, entry):
    """The object an entry of :func:`changes` stands for, from the notebook's ``container`` as it was."""
    from .results import refill
    if entry[0] == "old":
        return container[entry[1]]
    if entry[0] == "filled":
        old = container[entry[1]]
        return old if refill(old, entry[2]) else entry[2]
    return entry[1]
