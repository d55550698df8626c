"""What rank 0 sends back after a ``%%dataparallel`` cell: the worker's side of :mod:`.results`.

:func:`rank0_state` collects the trained modules' and optimizers' state, what the
cell set on the modules besides their tensors, stateful objects (schedulers), the
plain values the cell bound, models the cell built (whole), and its last
expression; :func:`pack_state` packs it for the kernel, every tensor on the CPU.
Values that cannot travel are named, never silently dropped.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import logging
import types

from ..cell.definitions import definitions
from ..cell.module_settings import module_settings
from ..cell.values import detached, is_plain_value
from ..procs.returning import RETURN_LIMIT, NotReturnable
from ..procs.torch_settings import changed, current
from ..procs.wire import pack
from .by_reference import pickled
from .containers import Room, detached_typed, held_inside, item_at
from .containers import changes as container_changes
from .containers import grown as grown_containers
from .results import NotebookName
from .returnable import attribute_items, changed_attributes, deleted_attributes, follow_path
from .scripting import scripted_results
from .touched import changed as changed_arrays

logger = logging.getLogger(__name__)

__all__ = ["rank0_state", "pack_state", "RemoteRepr", "unwrapped", "stands_alone"]


class RemoteRepr:
    """Rank 0's last expression when it cannot travel: shown by its repr."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text


def rank0_state(ns: dict, meta: dict, inner: dict, opts: dict, value) -> dict:
    import torch
    state: dict = {
        "modules": {n: m.state_dict() for n, m in inner.items()},
        # eval(), attributes, requires_grad (an FSDP module answers with the notebook's qualified names)
        "settings": {n: module_settings(m) for n, m in inner.items()},
        # a loader's own generator (passed on to the split loader) advanced as it would in one process
        "generators": {n: ns[n].generator.get_state() for n in meta["loaders"] if ns[n].generator is not None},
        "optimizers": {n: o.state_dict() for n, o in opts.items()},
        "stateful": _stateful_states(ns, meta["stateful"]),
        "values": {},
        "objects": {},      # other objects the cell assigned, pickled (returnable.py)
        "attributes": {},   # attributes of the notebook's objects the cell changed
        "assigned": meta["assigned"],
        # torch's settings the cell changed (torch.set_default_dtype...): the kernel takes them
        "torch_settings": changed({k: v for k, v in meta["flags"].items() if k != "compile_settings"}, current()),
        "deleted": [n for n in meta.get("deleted", []) if n not in ns],   # ``del tmp`` ran
        "not_returned": [],
        "made": {},
        "value": _last_value(value, ns, inner, opts),
        # Functions, classes and modules the cell bound: the kernel runs their statements again.
        "defined": [n for n in meta["assigned"] if isinstance(ns.get(n), (types.FunctionType, type, types.ModuleType))],
    }
    trained = set(meta["modules"]) | set(meta["optimizers"]) | set(meta["loaders"])
    state["aliases"] = _aliases(ns, meta)
    # names the cell left on the notebook's own object (``ev = ev or Evaluator(model)``): where that
    # object cannot come back, the notebook's stays bound to it (run._unbind_not_returned)
    before = meta.get("objects_before", {})
    state["still_bound"] = [n for n in meta["assigned"] if n in ns and before.get(id(ns[n]), (None, None))[0] == n
                            and before[id(ns[n])][1] is ns[n]]
    # torch.jit.script(model) in the cell: the kernel scripts the notebook's model again
    state["scripted"], traced = scripted_results(ns, meta["return_names"], meta.get("scripted", {}))
    state["not_returned"] += list(traced.values())
    # the notebook's objects by name (``reg["aux"] = m2`` puts the notebook's m2 there, or its DDP wrapper);
    # not those of names the cell binds (``x += 1`` on a tensor: the kernel's x would not have the change)
    bound = set(meta["assigned"])
    named = {i: held for i, held in {**before, **{id(m): (n, m) for n, m in inner.items()}}.items()
             if held[0] not in bound}
    # what an object the cell binds holds of them (``holder = {"net": model}``) travels by name
    by_name = dict(named)
    # and so do the classes the kernel defines again (``stats = [Stat(...)]`` holds the notebook's Stat)
    definable = definitions(meta["tree"]) if "tree" in meta else {}
    by_name.update({id(ns[n]): (n, ns[n]) for n in state["defined"] if isinstance(ns.get(n), type) and n in definable})
    kept, watched, attributes_before = _watched_after(meta, state["still_bound"])
    grew: list[str] = []
    objects: list[tuple[str, object]] = []   # pickled below, once the models the cell made are known
    for n in meta["return_names"]:
        if n not in ns or n in state["aliases"] or n in state["scripted"] or n in traced \
                or n in meta.get("containers", ()):   # (compared item by item: containers.changes)
            continue
        v = ns[n]
        if is_plain_value(v) and (n in meta["loop_targets"] or not _holds_notebook_tuples(v)) \
                or n in meta.get("filled", ()):
            # (a tensor the cell set items of: filled in place)
            state["values"][n] = detached_typed(v)   # (a defaultdict stays one)
        elif n in meta["assigned"] and n not in trained and n not in meta["loop_targets"] \
                and not isinstance(v, (types.ModuleType, type, types.FunctionType)) and n not in kept:
            model = unwrapped(v) if isinstance(v, torch.nn.Module) else None
            if model is not None and stands_alone(model, inner):
                state["made"][n] = model   # a model the cell built: it comes back whole
            elif model is not None:
                state["not_returned"].append(f"{n} (wraps the notebook's modules, which got its weights)")
            else:
                objects.append((n, v))
        elif n not in meta["assigned"] and isinstance(v, (list, dict)):   # (a defaultdict too: refilled, kept)
            grew.append(n)   # a notebook list of plain values the cell appended tensors to (containers.grown)
    # a model the cell made travels once, under its name: what holds it (``results = {"model": best_model}``,
    # ``log["best"] = best_model``) holds that one in the notebook, not a copy of its own
    made = {i: (n, m) for n, model in state["made"].items() for i, m in ((id(model), model), (id(ns[n]), ns[n]))}
    by_name.update(made)
    named = {**named, **made}
    for n, v in objects:
        _add_object(state, n, v, by_name)
    for n in changed_arrays(ns, meta.get("arrays_before", {})):   # (set by a function the cell called)
        state["values"][n] = detached(ns[n])
    # tensors in lists and dicts, and datasets, share what one cell brings back with the objects above
    room = Room(RETURN_LIMIT - sum(len(b) for b, _ in state["objects"].values()))
    attributes = changed_attributes(ns, attributes_before, watched, room, named)
    state["attributes"], state["attributes_filled"] = attributes.changed, attributes.filled
    state["attribute_items"], state["attributes_kept"] = attributes.items, attributes.kept
    # the notebook's dicts and lists holding objects, whose items the cell or its functions changed
    state["containers"], not_back = container_changes(ns, meta.get("containers_before", {}), room,
                                                         attributes.described, named)
    state["not_returned"] += not_back
    filled_lists, not_back = grown_containers(ns, grew, room, named)
    state["containers"].update(filled_lists)
    state["not_returned"] += not_back
    state["attribute_objects"] = _datasets(state, attributes.datasets, meta.get("notebook_objects", {}), room)
    # ``del cfg.name``: deleted on the notebook's object too, as a plain cell would
    state["attributes_deleted"] = deleted_attributes(ns, attributes_before, watched)
    state["not_returned"] += attributes.dropped
    return state


def _watched_after(meta: dict, still_bound: list[str]) -> tuple[set, list, dict]:
    """``(kept, watched, their attributes as the cell started)``. A name the cell bound that it left on the
    notebook's watched object (``ev = ev or Evaluator(model)``) is ``kept``: that object stays bound, as after
    a plain cell, its changes coming back as attributes; one it bound to another object is no longer
    watched (what its name holds now comes back as a value)."""
    watched = meta.get("watched", [])
    kept = set(still_bound) & set(meta.get("watched_if_kept", ())) & set(watched)
    rebound = set(meta.get("watched_if_kept", ())) - set(still_bound)
    return (kept, [p for p in watched if p.split(".")[0] not in rebound],
            {p: v for p, v in meta.get("attributes_before", {}).items() if p.split(".")[0] not in rebound})


def _datasets(state: dict, datasets: dict, refs: dict, room: Room) -> tuple | None:
    """The torch Datasets the cell set on the notebook's objects (``{path: {attribute: dataset}}``),
    pickled together (two Subsets of one dataset share it), the notebook's own datasets and tensors by
    name; ``(blob, paths, their paths)``, or None with the note naming them where they cannot come back."""
    if not datasets:
        return None
    try:
        blob, paths = pickled(datasets, refs, limit=room.left)
    except NotReturnable as exc:
        state["not_returned"] += [f"{name}.{k} ({type(v).__name__}: {exc})" for name, attrs in datasets.items()
                                  for k, v in attrs.items()]
        return None
    room.take(len(blob))
    return blob, paths, [f"{name}.{k}" for name, attrs in datasets.items() for k in attrs]


def _aliases(ns: dict, meta: dict) -> dict:
    """``{name: other}`` where the cell bound ``name`` to the object the notebook's ``other`` held as the
    cell started (``alias = args``): the kernel binds it to the notebook's own object, as a plain cell
    would, instead of a copy. Numbers and strings are values, not objects to share. ``other`` is
    ``(container, keys)`` for a list or dict a compared container (or a notebook object's attribute, as
    ``"tracker.history"``) held at ``keys`` and still holds there (``hv = history["val"]``): the notebook's,
    which takes the cell's changes in place."""
    before = meta.get("objects_before", {})
    inside = held_inside({**attribute_items(meta.get("attributes_before", {})), **meta.get("containers_before", {})})
    aliases: dict = {}
    for n in meta["assigned"]:
        v = ns.get(n)
        held = before.get(id(v))
        if held is not None and held[1] is v and held[0] != n and \
                not isinstance(v, (str, bytes, int, float, complex, bool, type(None), tuple)):
            aliases[n] = held[0]
        elif id(v) in inside and inside[id(v)][2] is v:
            where, keys, _ = inside[id(v)]
            if item_at(follow_path(ns, where), keys) is v:
                aliases[n] = (where, keys)
    return aliases


def _holds_notebook_tuples(value, depth: int = 0) -> bool:
    """Whether a plain value holds instances of the notebook's namedtuples (``Out(loss, step)``): those
    travel as objects, their class by name (:func:`_add_object`), so that they are of the notebook's class."""
    if isinstance(value, tuple) and type(value).__module__ == "__main__":
        return True
    if depth >= 4 or not isinstance(value, (list, tuple, dict)):
        return False
    items = value.values() if isinstance(value, dict) else value
    return any(_holds_notebook_tuples(v, depth + 1) for v in items)


def _add_object(state: dict, name: str, value, by_name: dict) -> None:
    """An object the cell assigned, pickled with the notebook's objects it holds by their names
    (``(blob, names)``: :mod:`.by_reference`), within what one cell brings back; else named with why."""
    room = RETURN_LIMIT - sum(len(b) for b, _ in state["objects"].values())
    try:
        state["objects"][name] = pickled(value, by_name, limit=room)
    except NotReturnable as exc:
        state["not_returned"].append(f"{name} ({exc})")


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


def stands_alone(model, inner: dict) -> bool:
    """A model of its own: not a framework's wrapper around the notebook's modules (those come back
    in place) and holding no process-bound wrapper (DDP) inside."""
    from torch.nn.parallel import DistributedDataParallel
    mine = {id(m) for m in inner.values()}
    return not any(id(m) in mine or isinstance(m, DistributedDataParallel) for m in model.modules())


def pack_state(state: dict, scratch):
    """Pack rank 0's state; a model made in the cell that cannot travel is named instead."""
    try:
        return pack(state, targets=_all_cpu(state), fingerprint=False, scratch=scratch)
    except Exception:
        if not state["made"]:
            raise
        logger.debug("models made in the cell could not be packed", exc_info=True)
    # those that cannot travel are named (what holds one by its name finds none: the kernel unbinds it)
    state["made_failed"] = []
    for n, model in list(state["made"].items()):
        try:
            pack({"model": model}, targets=_all_cpu(model), fingerprint=False, scratch=scratch)
        except Exception as exc:  # noqa: BLE001 - named in the cell's note, with the reason
            state["not_returned"].append(f"{n} ({type(exc).__name__}: {exc})")
            state["made_failed"].append(n)
            del state["made"][n]
    return pack(state, targets=_all_cpu(state), fingerprint=False, scratch=scratch)


def _stateful_states(ns: dict, names: list) -> dict:
    states = {}
    for n in names:
        try:
            states[n] = ns[n].state_dict()
        except Exception:  # its state stays in the workers; the notebook keeps the object as it was
            logger.debug("state_dict() of %r failed", n, exc_info=True)
    return states


def _all_cpu(state) -> dict:
    import torch
    targets = {}

    def walk(o):
        if isinstance(o, torch.Tensor):
            targets[id(o)] = "cpu"
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(state)
    return targets


def _last_value(value, ns: dict, inner: dict, opts: dict):
    """What the kernel shows for the cell's last expression: a trained notebook object by name."""
    named = {id(o): n for n, o in [*inner.items(), *opts.items()]}
    named.update({id(ns[n]): n for n in inner if n in ns})   # the DDP wrapper the cell's name is bound to
    return NotebookName(named[id(value)]) if value is not None and id(value) in named else _returnable(value)


def _returnable(value):
    import torch
    if value is None or is_plain_value(value):
        return value
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        return value.detach()
    numpy = __import__("sys").modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return value
    return RemoteRepr(repr(value))
