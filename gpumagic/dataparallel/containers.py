"""Notebook dicts and lists holding objects, whose items a ``%%dataparallel`` cell changes.

A dict or list of plain values (``history = []``) comes back whole as a value. One that also
holds objects (``held = {"n": 1, "model": model}``, ``runs = [cfg, ...]``; a ``defaultdict`` or an
``OrderedDict`` too) cannot: a copy would replace the notebook's objects inside it; nor can one
holding lists and dicts (``logs = {"train": {"loss": []}}``), which other names may hold
(``train_loss = logs["train"]["loss"]``). Yet a plain
cell's ``held["n"] = 2``, ``runs.append(0.5)`` or ``del held["old"]`` changes it, written in the
cell or inside a notebook function the cell calls. So rank 0 takes a shallow record of each such
container the cell reaches before it runs (:func:`snapshot`), compares after (:func:`changes`), and
describes the new contents in terms of the old items (:func:`apply` rebuilds them from the
notebook's own objects, into the same container, which keeps its type and key order as rank 0's):

* an item still the object it was: the notebook's item at its old place (``("old", key)``);
* a plain value, new or changed (``held["stats"]["n"] += 1`` too): rank 0's (``("value", v)``);
* a tensor or numpy array changed in place (``held["buf"].add_(1)``): rank 0's contents, written
  into the notebook's item (``("filled", key, v)``); a new one: rank 0's, on the CPU;
* a list or dict it held, changed inside (``held["outs"]["val"].append(out)``): described the same
  way, a few levels down (their tensors compared by torch's version counter), and refilled in place
  (``("nested", key, kind, entries)``); a new list, tuple or dict holding such items (a
  ``state_dict()`` copy, a defaultdict): built anew, of its type (``("built", kind, entries)``);
* an object the notebook holds under a name of its own (``reg["aux"] = m2``): that object
  (``("name", "m2")``), holding its trained state where it trained; a layer of one
  (``reg["head"] = model.fc``): that layer (``("layer", "model", "fc")``); a model the cell made
  (``copy.deepcopy(model)``): rank 0's, whole (``("made", model)``, :mod:`.container_models`);
* another object made in the cell (``runs.append(Run(cfg, acc))``): rank 0's, pickled, holding the
  notebook's objects where it did (``("pickled", blob, their names)``, :mod:`.by_reference`).

A container that came to hold anything else (an object that cannot be pickled, or holds a module
made in the ranks), or new tensors beyond what one cell brings back, does not come back; the
cell's note names it. Lists and dicts
held as attributes of notebook objects (``self.outs.append(out.detach())``) are described the same
way (:mod:`.returnable`), and so is a notebook list or dict of plain values the cell filled with
tensors (``preds = []``, then ``preds.append(model(x))``: :func:`grown`). Cost: one pass over each
container's items before and after the cell on rank 0 (and so the lists and dicts they hold, up to
10,000 items each), copies of its plain items, and a fingerprint of each tensor or array item
(:mod:`.touched`); a longer one (a history of every step) by the identity of its items, up to
:data:`LONG_ITEMS`, its unchanged runs sent as spans (:mod:`.long_items`).

Runs in the workers (:func:`snapshot`, :func:`changes`) and in the kernel (:func:`apply`).
"""
from __future__ import annotations

import collections
import copy
import logging

from ..cell.values import equal_values, is_plain_value, same_tuple_type
from ..procs.returning import RETURN_LIMIT
from .by_reference import loaded, pickled_item, resolved
from .container_models import layer_of, made_model, model_bytes
from .long_items import LONG_ITEMS, Shallow, listed, mapped
from .touched import READ_WHOLE_BYTES, fingerprint, is_array

logger = logging.getLogger(__name__)

__all__ = ["snapshot", "changes", "apply", "is_container", "holds_containers", "records_of", "describe", "rebuilt",
           "made_in_cell", "array_bytes", "Room", "grown", "planned", "refill_all", "same_value", "kind_of",
           "is_listlike", "detached_typed",
           "tensors_mapped", "same_dict_type", "held_inside", "item_at", "LONG_ITEMS", "is_list_or_dict",
           "compared_items"]

_PLAIN, _ARRAY, _OBJECT, _NESTED, _LONG = "plain", "array", "object", "nested", "long"
# What is compared item by item: refilled in place, its type (and a defaultdict's default_factory) kept.
# (Other dict subclasses, a ModelOutput or an EasyDict, may refuse or redefine ``clear``/``update``.)
_KINDS = (list, dict, collections.defaultdict, collections.OrderedDict)
# Lists and dicts held in a compared one are compared inside too, this many levels down.
_DEPTH = 3


def is_container(value, limit: int) -> bool:
    """A list or dict (a defaultdict, an OrderedDict) of at most ``limit`` items that holds more than
    plain values."""
    return type(value) in _KINDS and len(value) <= limit and not is_plain_value(value)


def is_list_or_dict(value, limit: int | None = None) -> bool:
    """A list or dict whose items rank 0 can compare (of at most ``limit`` items)."""
    return type(value) in _KINDS and (limit is None or len(value) <= limit)


def holds_containers(value, limit: int) -> bool:
    """A list or dict of at most ``limit`` items holding a list or dict (``logs = {"train": {"loss": []}}``),
    which other names may hold too (``train_loss = logs["train"]["loss"]``): compared item by item, so those
    stay the notebook's objects, refilled in place, rather than a copy of it coming back whole."""
    return type(value) in _KINDS and len(value) <= limit and any(
        type(v) in _KINDS for v in (value.values() if isinstance(value, dict) else value))


def _items(container) -> list:
    return list(container.items() if isinstance(container, dict) else enumerate(container))


def kind_of(container):
    """How the kernel makes ``container`` again (:func:`rebuilt`): its type's name (``"list"``, ``"tuple"``,
    ``"dict"``, ``"OrderedDict"``), or ``("defaultdict", its default factory)``."""
    if type(container) is collections.defaultdict:
        return ("defaultdict", container.default_factory)
    return type(container).__name__


def is_listlike(kind) -> bool:
    """Whether a :func:`kind_of` answer stands for a list or tuple (items by index), not a dict."""
    return kind in ("list", "tuple")


def _made(kind, items):
    """``items`` (a list or a dict) as the :func:`kind_of` ``kind`` they were on rank 0."""
    if kind == "tuple":
        return tuple(items)
    if kind == "OrderedDict":
        return collections.OrderedDict(items)
    if isinstance(kind, tuple):
        return collections.defaultdict(kind[1], items)
    return items


def same_dict_type(original: dict, items: dict) -> dict:
    """``items`` as a dict of ``original``'s type where that is a defaultdict (its factory kept) or an
    OrderedDict, as a plain cell leaves it; else a dict."""
    return _made(kind_of(original), items) if type(original) in _KINDS else items


def detached_typed(value):
    """:func:`~gpumagic.cell.values.detached`, where defaultdicts and OrderedDicts stay what they are
    (``history = defaultdict(list)`` in the cell: the next cell's ``history["new"].append`` works)."""
    import torch
    return tensors_mapped(value, torch.Tensor.detach)


def tensors_mapped(value, fn):
    """``value`` with ``fn`` applied to each tensor in it, through dicts (of their type), lists and tuples."""
    import torch
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return same_dict_type(value, {k: tensors_mapped(v, fn) for k, v in value.items()})
    if isinstance(value, list):
        return [tensors_mapped(v, fn) for v in value]
    if isinstance(value, tuple):
        return same_tuple_type(value, [tensors_mapped(v, fn) for v in value])
    return value


def _record(item, depth: int):
    """What is kept of one item to compare: the object, and a copy (plain), a fingerprint (array) or
    the records of its own items (a list or dict holding objects)."""
    if is_array(item):
        return item, _ARRAY, fingerprint(item, _read_whole(depth))
    # (one holding lists and dicts, plain or not, item by item: those it holds stay the notebook's)
    if depth < _DEPTH and (is_container(item, _COPIED_ITEMS) or holds_containers(item, _COPIED_ITEMS)):
        return item, _NESTED, records_of(item, depth + 1)
    if not _large(item) and is_plain_value(item):
        try:
            return item, _PLAIN, copy.deepcopy(detached_typed(item))
        except Exception:   # a plain value that does not copy (rare): compared by identity
            logger.debug("an item could not be copied to compare", exc_info=True)
    if is_list_or_dict(item, LONG_ITEMS):
        return item, _LONG, Shallow(item)
    return item, _OBJECT, None


# A plain item with more than this many items (a history of a million losses, a vocabulary) is not
# copied to compare, each cell, on the way to the first step: its items are compared by identity
# (:class:`~.long_items.Shallow`), so a change inside one of them (a list it holds, appended to) is missed.
_COPIED_ITEMS = 10_000


def compared_items(container):
    """What rank 0 keeps of a list or dict to compare after the cell (:func:`describe`): its items' records,
    or, past 10,000 items, their references (:class:`~.long_items.Shallow`)."""
    return Shallow(container) if len(container) > _COPIED_ITEMS else records_of(container)


def _read_whole(depth: int) -> int:
    """Tensors held in a compared container are fingerprinted by their bytes (up to 16 MiB, as
    :mod:`.touched` does); those held a level down or more (a dict's list of a thousand outputs), by
    torch's version counter alone, not read each cell on the way to the first step."""
    return READ_WHOLE_BYTES if depth == 0 else 0


def _large(value) -> bool:
    return isinstance(value, (list, tuple, dict)) and len(value) > _COPIED_ITEMS


def same_value(a, b) -> bool:
    """``equal_values``, and dicts in the same key order (``d["a"] = d.pop("a")`` moves a key; ``==``
    does not see it), looked for in lists of up to 10,000 items."""
    return equal_values(a, b) and _same_order(a, b)


def _same_order(a, b) -> bool:
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_order(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)) and not _large(a):
        return all(_same_order(x, y) for x, y in zip(a, b))
    return True


def snapshot(ns: dict, names: list[str]) -> dict:
    """Rank 0, as the cell starts: ``{name: (container, {key: record})}`` (a long one's record: its items,
    compared by identity)."""
    return {n: (ns[n], compared_items(ns[n])) for n in names if n in ns}


def changes(ns: dict, before: dict, room: Room | None = None, described: set[int] | None = None,
            named: dict | None = None) -> tuple[dict, list[str]]:
    """After the cell: ``({name: new contents}, not returned)``. New contents: a list of entries (a list)
    or a list of ``(key, entry)`` (a dict); entries as the module says. ``room``: the bytes of tensors
    they may bring back, shared with the cell's other containers. ``described``: ids of containers
    already described (as an attribute's, or under another name: ``b = a``), skipped; those described
    here are added. ``named``: ``{id: (name, object)}`` of the notebook's objects as the cell started."""
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
        entries, changed, foreign = describe(container, records, named)
        if not changed:
            continue
        why = f"{made_in_cell(foreign)}, so {name} is left as it was; change it in a plain cell" if foreign else None
        _bring_back(name, container, entries, why, room, back, dropped)
    return back, dropped


def grown(ns: dict, names: list[str], room: Room, named: dict | None = None) -> tuple[dict, list[str]]:
    """After the cell: notebook lists and dicts of plain values as it started (``outs = []``) that the cell
    filled with tensors or arrays in place (``outs.append(model(x).detach())``), as :func:`changes`
    answers; those holding other objects are named."""
    back: dict = {}
    dropped: list[str] = []
    for name in names:
        container = ns[name]
        entries, _, foreign = describe(container, {}, named)
        why = (f"holds objects made in the cell that cannot come back (they cannot be pickled, or hold what "
               f"stays in the ranks), so {name} is left as it was" if foreign else None)
        _bring_back(name, container, entries, why, room, back, dropped)
    return back, dropped


def _bring_back(name: str, container, entries: list, why: str | None, room: Room, back: dict,
                dropped: list[str]) -> None:
    """``entries`` into ``back`` where nothing stops them (``why``) and their tensors fit in ``room``;
    else the reason into ``dropped``."""
    if why is None and room.take(array_bytes(entries, kind_of(container))):
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


def records_of(container, depth: int = 0) -> dict:
    """``{key: record}`` of a dict's or list's items, to compare after the cell (:func:`describe`)."""
    return {k: _record(v, depth) for k, v in _items(container)}


def describe(container, records: dict, named: dict | None = None) -> tuple[list, bool, list[str]]:
    """``container``'s contents in terms of the items ``records`` kept (``{}``: a container new to the
    notebook; a :class:`~.long_items.Shallow`: a long one) and of the notebook's ``named`` objects (as
    :func:`changes`): ``(entries, changed, where an object made in the cell is held)``; entries as the
    module says, ``(key, entry)`` for a dict."""
    entries, changed, foreign = _described(container, records, named or {}, 0)
    return entries, changed, [repr(p[0]) + "".join(f"[{k!r}]" for k in p[1:]) for p in foreign]


def _described(container, records, named: dict, depth: int, items: list | None = None) -> tuple[list, bool, list]:
    """:func:`describe` a level down (``depth``); ``items``: the ``(key, item)`` to describe, where not all."""
    if isinstance(records, Shallow):   # (a long one: the items between its unchanged head and tail, by identity)
        return records.described(container, lambda old, new: _described(
            container, {k: (v, _OBJECT, None) for k, v in old.items()}, named, depth, new)[::2])
    # (plain values are compared by value: small numbers are one object wherever they are; their
    # lists and dicts are objects of their own)
    by_id = {id(r[0]): k for k, r in records.items() if r[1] != _PLAIN or type(r[0]) in _KINDS}
    entries: list = []
    foreign: list[tuple] = []
    # (a key moved to the end, ``d["a"] = d.pop("a")``: the notebook's dict takes rank 0's order)
    changed = items is not None or len(container) != len(records) or \
        isinstance(container, dict) and list(container) != list(records)
    for key, item in _items(container) if items is None else items:
        here = records.get(key)
        plain = is_plain_value(item) and not is_array(item)
        # (numbers and strings are values, not objects of the notebook's to share)
        name = _name_of(item, named) if not plain or type(item) in _KINDS else None
        if here is not None and item is here[0] and (here[1] != _PLAIN or type(item) in _KINDS):
            entry, moved, bad = _kept(key, item, here, named, depth)
        elif id(item) in by_id:   # moved from another place in it
            old_key = by_id[id(item)]
            entry, _, bad = _kept(old_key, item, records[old_key], named, depth)
            moved = True
        elif name is not None:
            entry, moved, bad = ("name", name), True, []
        elif plain:
            unchanged = here is not None and here[1] == _PLAIN and same_value(detached_typed(item), here[2])
            entry, moved, bad = ("value", detached_typed(item)), not unchanged, []
        elif is_array(item) and fingerprint(item, 0) is not None:   # (one it can send: the check, not the bytes)
            entry, moved, bad = ("value", detached_typed(item)), True, []
        elif type(item) in (*_KINDS, tuple) and depth < _DEPTH and len(item) <= _COPIED_ITEMS:
            # a list, tuple or dict made in the cell (a state_dict() copy is an OrderedDict): built anew
            inner, _, bad = _described(item, {}, named, depth + 1)
            entry, moved = ("built", kind_of(item), inner), True
        elif (layer := layer_of(item, named)) is not None:   # (reg["head"] = model.fc: the notebook's layer)
            entry, moved, bad = ("layer", *layer), True, []
        elif (model := made_model(item, named)) is not None:   # (best["model"] = copy.deepcopy(model))
            entry, moved, bad = ("made", model), True, []
        elif (blob := pickled_item(item, named)) is not None:   # (runs.append(Run(cfg, acc)): rank 0's)
            entry, moved, bad = ("pickled", *blob), True, []
        else:
            entry, moved, bad = None, True, [()]
        changed = changed or moved
        if bad:
            foreign += [(key, *p) for p in bad]
        else:
            entries.append(entry if isinstance(container, (list, tuple)) else (key, entry))
    return entries, changed, foreign


def _kept(key, item, record: tuple, named: dict, depth: int) -> tuple:
    """``(entry, changed, made in the cell)`` for ``item``, the object ``record`` kept at ``key``."""
    kind, kept = record[1], record[2]
    if kind == _OBJECT:   # (a model): nothing to walk
        return ("old", key), False, []
    if kind == _ARRAY:
        return (("filled", key, detached_typed(item)), True, []) if fingerprint(item, _read_whole(depth)) != kept \
            else (("old", key), False, [])
    if kind == _PLAIN and is_plain_value(item):
        # the notebook's own list or dict (``held["hist"] is hist``): kept, refilled where changed,
        # so other names holding it see the change and its type (a defaultdict) stays
        return (("old", key), False, []) if same_value(detached_typed(item), kept) else \
            (("filled", key, detached_typed(item)), True, [])
    # a list or dict holding objects, or one of plain values that came to hold tensors (compared to its copy)
    records = kept if kind in (_NESTED, _LONG) else records_of(kept, depth + 1)
    inner, changed, bad = _described(item, records, named, depth + 1)
    if bad or not changed:
        return ("old", key), bad != [], bad
    return ("nested", key, kind_of(item), inner), True, []


def held_inside(before: dict) -> dict:
    """``{id: (where, keys, object)}`` of the lists and dicts held inside the containers of ``before``
    (``{where: (container, records)}``, as :func:`snapshot` answers) as the cell started, a few levels down:
    a name the cell binds to one (``hv = history["val"]``) is the notebook's object at ``keys`` there."""
    found: dict = {}

    def walk(where: str, keys: tuple, records: dict) -> None:
        for k, (item, kind, kept) in records.items():
            if type(item) in _KINDS and id(item) not in found:
                found[id(item)] = (where, (*keys, k), item)
            if kind == _NESTED:
                walk(where, (*keys, k), kept)
    for where, (_, records) in before.items():
        if isinstance(records, dict):
            walk(where, (), records)
    return found


def item_at(container, keys: tuple):
    """The item ``container[k0][k1]...`` for ``keys``; None where one is missing."""
    for k in keys:
        if isinstance(container, dict):   # (not ``[k]``: a defaultdict would make the item)
            if k not in container:
                return None
            container = container[k]
        elif isinstance(container, (list, tuple)) and isinstance(k, int) and -len(container) <= k < len(container):
            container = container[k]
        else:
            return None
    return container


def _name_of(item, named: dict) -> str | None:
    """The notebook's name for ``item`` as the cell started, if it had one."""
    held = named.get(id(item))
    return held[0] if held is not None and held[1] is item else None


def made_in_cell(keys: list[str]) -> str:
    """The note's words for a container whose ``keys`` hold objects made in the cell."""
    return (f"the cell changed its items, and {', '.join(keys[:3])}{' and more' if len(keys) > 3 else ''} now "
            f"hold{'s' if len(keys) == 1 else ''} an object made in the cell, which does not come back")


def array_bytes(entries: list, kind) -> int:
    """Bytes of the tensors and arrays rank 0 sends for a ``kind`` (:func:`kind_of`) of ``entries``: new
    ones, and contents filled into the notebook's."""
    total = 0
    for e in entries if is_listlike(kind) else [e for _, e in entries]:
        if e[0] in ("value", "filled") and is_array(e[-1]):
            total += e[-1].nbytes
        elif e[0] == "made":
            total += model_bytes(e[1])
        elif e[0] == "pickled":
            total += len(e[1])
        elif e[0] in ("nested", "built"):
            total += array_bytes(e[-1], e[-2])
    return total


def rebuilt(old, kind, entries: list, plans: dict, ns: dict | None = None):
    """A new ``kind`` (:func:`kind_of`) of ``entries``, their old items taken from the notebook's ``old``,
    its objects by name from ``ns``; lists and dicts it held changed inside are planned into ``plans``."""
    def item(e):
        return _item(old, e, plans, ns)
    return _made(kind, listed(old, entries, item) if is_listlike(kind) else mapped(old, entries, item))


def apply(ns: dict, contents: dict) -> list[str]:
    """In the kernel: each notebook container takes its new contents in place (the same object, as
    other names may hold it); returns their names."""
    plans: dict = {}
    done = planned(ns, contents, plans)
    refill_all(plans)
    return done


def planned(ns: dict, contents: dict, plans: dict) -> list[str]:
    """In the kernel, before any container is refilled or name bound: each named container's new contents,
    built from the notebook's objects as they still are, into ``plans`` (``{id(container): (container,
    new)}``; a container reached under two names is built once, the first one winning); returns their
    names."""
    done = []
    for name, entries in contents.items():
        container = ns.get(name)
        if not isinstance(container, (list, dict)):
            continue
        if id(container) not in plans:   # (a defaultdict's new items: refilled into it, so it stays one)
            plans[id(container)] = (container, rebuilt(container, "list" if isinstance(container, list) else "dict",
                                                        entries, plans, ns))
        done.append(name)
    return done


def refill_all(plans: dict) -> None:
    """Each container of :func:`planned`'s ``plans`` takes its new contents."""
    for container, new in plans.values():
        refill_container(container, new)


def refill_container(container, new) -> None:
    """The notebook's list or dict takes ``new``'s items (and key order), staying the same object."""
    if isinstance(container, list):
        container[:] = new
    else:
        container.clear()
        container.update(new)


def _item(container, entry, plans: dict, ns: dict | None):
    """The object an entry of :func:`changes` stands for, from the notebook's ``container`` as it was."""
    from .results import refill
    tag = entry[0]
    if tag == "value":
        return entry[1]
    if tag == "old":
        return container[entry[1]]
    if tag == "filled":
        old = container[entry[1]]
        return old if refill(old, entry[2]) else entry[2]
    if tag == "name":
        return (ns or {}).get(entry[1])
    if tag == "pickled":   # (holding the notebook's objects where it did)
        return loaded(entry[1], resolved(entry[2], ns or {}))
    if tag == "made":   # (its tensors are views of a buffer the next cell reuses: a copy)
        return copy.deepcopy(entry[1])
    if tag == "layer":
        try:
            return (ns or {})[entry[1]].get_submodule(entry[2])
        except (KeyError, AttributeError):   # (it had that layer on rank 0, and took rank 0's layers: not expected)
            logger.debug("%s has no layer %s: None in its place", entry[1], entry[2], exc_info=True)
            return None
    if tag == "built":
        return rebuilt(None, entry[-2], entry[-1], plans, ns)
    if tag == "nested":
        inner = container[entry[1]]
        kind = "list" if is_listlike(entry[-2]) else "dict"   # (refilled: the notebook's keeps its type)
        if not isinstance(inner, list if kind == "list" else dict):   # (rank 0 compared this object: not expected)
            logger.debug("a %s held at %r is not a %s: left as it was", type(inner).__name__, entry[1], kind)
            return inner
        if id(inner) not in plans:
            plans[id(inner)] = (inner, None)   # (held in itself: built once)
            plans[id(inner)] = (inner, rebuilt(inner, kind, entry[-1], plans, ns))
        return inner
    raise ValueError(f"an entry of an unknown kind: {tag!r}")
