"""What a ``%%dataparallel`` cell did, and rank 0's trained state brought into the notebook.

:func:`load_into_notebook` checks that rank 0's state fits the notebook's
objects, then loads it into them in place (modules, optimizers, schedulers
and other objects with a ``state_dict``), binds the plain values and other
objects the cell assigned, and sets the attributes it changed on the
notebook's objects (:mod:`.returnable`). Nothing changes unless everything fits.
"""
from __future__ import annotations

import copy
import logging
import sys
from dataclasses import dataclass, field

from ..cell.module_settings import apply_settings
from ..cell.values import is_stateful
from .by_reference import loaded, resolved
from .returnable import HeldByName, PickledObject, follow_path

logger = logging.getLogger(__name__)

__all__ = ["CellResult", "load_into_notebook", "cloned",
           "adopt_cell_classes", "NotebookName", "unbind_not_returned"]

@dataclass
class CellResult:
    """What a ``%%dataparallel`` cell did, for display and for benchmarks."""
    devices: list[str]
    backend: str
    modules: list[str]
    optimizers: list[str]
    loaders: list[str]
    stateful: list[str]
    values: list[str] = field(default_factory=list)          # plain values bound in the notebook
    defined: list[str] = field(default_factory=list)         # functions, classes, modules the cell bound
    made: list[str] = field(default_factory=list)            # models the cell built, brought back whole
    stayed: list[str] = field(default_factory=list)          # fsdp: trained state kept sharded in the workers
    strategy: str = "ddp"
    not_returned: list[str] = field(default_factory=list)    # assigned names not brought back (they end with the cell)
    value: object = None                                     # rank 0's last expression
    per_rank: dict = field(default_factory=dict)             # rank -> steps, samples, seconds
    pids: list = field(default_factory=list)
    pool_started: bool = False
    timings: dict = field(default_factory=dict)
    shipped_bytes: int = 0
    cached_bytes: int = 0
    returned_bytes: int = 0

    def summary(self) -> str:
        what = ", ".join(n for n in self.modules + self.optimizers + self.stateful if n not in self.stayed)
        ranks = f"{len(self.devices)} rank{'s' if len(self.devices) != 1 else ''} ({self.backend}" + (
            ", fsdp)" if self.strategy == "fsdp" else ")")
        steps = {s.get("steps", 0) for s in self.per_rank.values()}
        step_text = f", {next(iter(steps))} optimizer steps each" if len(steps) == 1 and steps != {0} else ""
        loaded = f"trained state loaded into {what}" if what else ""
        if self.stayed:
            loaded += (f"{'; ' if loaded else ''}trained state kept sharded in the workers (a later --strategy "
                       f"fsdp cell continues from it): {', '.join(self.stayed)}")
        text = f"%%dataparallel: {ranks}{step_text}; " + (
            loaded or "no notebook model used (nothing loaded in place)")
        shown = [n for n in self.values if n != "_"]   # (``for _ in range(3)``: bound, not worth a word)
        if shown:
            text += f"; values: {', '.join(shown)}"
        if self.made:
            text += f"; models built in the cell (on the CPU): {', '.join(self.made)}"
        if self.defined:
            text += f"; defined: {', '.join(self.defined)}"
        return text


@dataclass(frozen=True)
class NotebookName:
    """The cell's last expression was one of the notebook's own objects the cell trained (``model``,
    ``opt``): the kernel shows that object, which holds rank 0's state by then."""
    name: str


def _follow_dtypes(module, got: dict) -> None:
    """A cell that cast the model (``model.double()``, ``.half()``): the notebook's tensors take the new
    dtype in place (the same Parameter objects, as after a plain cell), so loading does not cast back."""
    for key, t in module.state_dict(keep_vars=True).items():
        if key in got and got[key].dtype != t.dtype:
            t.data = t.data.to(got[key].dtype)


def _load_grads(module, grads: dict) -> None:
    """Rank 0's last gradients on the notebook's parameters, as a plain cell leaves them (None where
    the cell zeroed them to None): copied, as the packed tensors are views of a reused buffer."""
    for key, p in module.named_parameters():
        g = grads.get(key)
        if g is None:
            p.grad = None
        elif p.grad is not None and p.grad.shape == g.shape and p.grad.dtype == g.dtype:
            p.grad.copy_(g)
        else:
            p.grad = g.to(device=p.device, dtype=p.dtype, copy=True)


def load_into_notebook(ns: dict, state: dict, modules: dict, optimizers: dict, stateful: list,
                       define=None) -> dict:
    """Check everything first, then copy rank 0's state into the notebook's objects in place.

    ``define(names)`` (:func:`~gpumagic.cell.definitions.define_in_notebook`) runs the cell's ``def`` and
    ``class`` statements again once its values are bound, before the objects it assigned are unpickled:
    instances of its classes (``stats = [Stat(...)]``) are then of the notebook's ``Stat``."""
    import torch

    from .containers import planned as planned_containers
    from .containers import refill_all, same_value
    problems = []
    reshaped = state.get("reshaped") or {}
    for name, module in modules.items():
        if name in reshaped:
            continue   # the cell replaced layers: the notebook's module takes the new ones
        got = state["modules"][name]
        have = module.state_dict()
        missing = sorted(set(have) - set(got))
        extra = sorted(set(got) - set(have))
        if missing or extra:
            problems.append(f"{name}: the cell changed its structure (missing {missing[:3]}, new {extra[:3]})")
            continue
        for k, v in have.items():
            if tuple(v.shape) != tuple(got[k].shape):
                problems.append(f"{name}.{k}: shape {tuple(v.shape)} became {tuple(got[k].shape)} in the cell")
    optimizers = {n: o for n, o in optimizers.items() if n in state["optimizers"]}   # the rest stayed
    for name, opt in optimizers.items():
        got = state["optimizers"][name]
        if len(got["param_groups"]) != len(opt.param_groups) or any(
                len(g["params"]) != len(h["params"]) for g, h in zip(got["param_groups"], opt.param_groups)):
            problems.append(f"{name}: the cell changed the optimizer's parameter groups")
    if problems:
        raise RuntimeError("the ranks finished, but their state does not fit the notebook's objects, which are "
                           "left as they were: " + "; ".join(problems))
    with torch.no_grad():
        for name, module in modules.items():
            if name in reshaped:
                _adopt_layers(module, reshaped[name])
            else:
                _follow_dtypes(module, state["modules"][name])
                module.load_state_dict(state["modules"][name])
            if name in (state.get("settings") or {}):
                apply_settings(module, state["settings"][name])
            if name in (state.get("grads") or {}):   # (a reshaped module has the trained one's names by now)
                _load_grads(module, state["grads"][name])
    # the notebook's objects the cell bound other names to, taken before any name is bound anew
    aliased = {n: _aliased(ns, other) for n, other in (state.get("aliases") or {}).items()}
    aliased = {n: obj for n, obj in aliased.items() if obj is not None}
    # and the notebook's datasets and tensors that datasets the cell set on its objects hold (by_reference.py)
    datasets = state.get("attribute_objects")
    referenced = resolved(datasets[1], ns) if datasets else {}
    # The models the cell built, bound now: what its other objects and the notebook's containers hold of
    # them is found by their names (rank_state); one that could not travel leaves its name unbound.
    # Each is a copy, since its tensors are views of a buffer the next cell reuses.
    for name in state.get("made_failed") or []:
        ns.pop(name, None)
    made = []
    for name, module in (state.get("made") or {}).items():
        ns[name] = copy.deepcopy(module)
        made.append(name)
    # and those the objects the cell bound hold (``holder = {"net": model}``: the notebook's model, trained)
    # (the cell's own classes, which are defined anew below, are found after that)
    cell_defined = set(state.get("defined") or ())
    held = {name: resolved([p for p in paths if p not in cell_defined], ns)
            for name, (_, paths) in (state.get("objects") or {}).items()}
    for name, opt in optimizers.items():
        opt.load_state_dict(_optimizer_state_to_keep(opt, state["optimizers"][name]))
    for name in stateful:
        if name in state["stateful"]:
            try:
                ns[name].load_state_dict(cloned(state["stateful"][name]))
            except Exception as exc:
                # the trained weights are in the notebook already: say so, rather than leave it to be guessed
                written = ", ".join([*modules, *optimizers])
                raise RuntimeError(
                    f"{name}.load_state_dict raised {type(exc).__name__}: {exc}. The trained state was already "
                    f"loaded into {written}, which keep it; {name} and the cell's other values are as before "
                    "the cell") from exc
    for name, generator_state in (state.get("generators") or {}).items():
        if getattr(ns.get(name), "generator", None) is not None:
            ns[name].generator.set_state(generator_state.clone())
    # The items each notebook tensor or array got, found before any is written: two views of one
    # tensor (a row and the whole) each travel alone, and copying one whole would undo the other's.
    changed = {name: _changed_items(ns.get(name), value) for name, value in state["values"].items()
               if name not in state.get("assigned", ())}
    filled = [(target, attr, value, _changed_items(getattr(target, attr, None), value))
              for target, attr, value in _attribute_targets(ns, state.get("attributes_filled"))]
    # The notebook's lists and dicts whose items changed, each built before any is refilled: one reached
    # under two names (``b = a``, or also an object's attribute) would be rebuilt from places overwritten.
    plans: dict = {}
    item_names, rebound = _planned_items(ns, state.get("attribute_items") or {}, plans)
    container_names = planned_containers(ns, state.get("containers") or {}, plans)
    bound = []
    for name, value in state["values"].items():
        old = ns.get(name, _MISSING)
        if name not in state.get("assigned", ()):
            if same_value(old, value):   # (a dict whose keys the cell moved is not the same)
                continue
            if _refill(old, value, changed[name]):   # a list the cell appended to: same object, new contents
                bound.append(name)
                continue
        ns[name] = value
        bound.append(name)
    # (a name bound to the notebook's own function or class, ``fn = helper``, is that object: nothing to define)
    definable = [n for n in state.get("defined") or [] if n not in aliased]
    defined, not_defined = define(definable) if define is not None else ([], [])
    objects, not_loaded = [], []
    for name, (blob, paths) in (state.get("objects") or {}).items():
        try:
            ns[name] = loaded(blob, {**held[name], **resolved([p for p in paths if p in defined], ns)})
        except Exception as exc:   # named in the cell's note, with the reason
            logger.debug("%s could not be unpickled in the kernel", name, exc_info=True)
            not_loaded.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        objects.append(name)
    for name, obj in aliased.items():
        ns[name] = obj
        bound.append(name)
    for target, attr, value, items in filled:   # (self.buf.add_(1)): the notebook's tensor takes the contents
        if not _refill(getattr(target, attr, None), value, items):
            logger.debug("%s.%s changed shape or dtype in place: bound to rank 0's", type(target).__name__, attr)
            setattr(target, attr, value)
    bound += [f"{name}.{attr}" for name, attrs in (state.get("attributes_filled") or {}).items() for attr in attrs]
    kept = state.get("attributes_kept") or {}
    for name, attrs in (state.get("attributes") or {}).items():
        target = follow_path(ns, name)
        for attr, value in attrs.items():
            # a tensor or array bound anew is rank 0's (as a plain cell binds a new one); a list or dict
            # the cell changed in place, the notebook's own, refilled (other names may hold it); one the
            # cell bound anew, set (other names keep the old one, as after a plain cell)
            if isinstance(value, HeldByName):   # the notebook's object, or a model the cell made (bound above)
                value = ns.get(value.name)
            elif isinstance(value, PickledObject):   # an object the cell made, holding the notebook's by name
                try:
                    value = loaded(value.blob, resolved(list(value.paths), ns))
                except Exception as exc:   # named in the cell's note, with the reason
                    logger.debug("%s.%s could not be unpickled in the kernel", name, attr, exc_info=True)
                    not_loaded.append(f"{name}.{attr} ({type(exc).__name__}: {exc})")
                    continue
            elif isinstance(value, torch.nn.Module):   # a model the cell made: its tensors are views of a reused buffer
                value = copy.deepcopy(value)
            if attr not in kept.get(name, ()) or not _refill(getattr(target, attr, None), value):
                setattr(target, attr, value)
            bound.append(f"{name}.{attr}")
    for target, attr, new in rebound:
        setattr(target, attr, new)
    refill_all(plans)
    bound += item_names + container_names
    if datasets:
        bound += _set_datasets(ns, datasets, referenced, not_loaded)
    for name, attrs in (state.get("attributes_deleted") or {}).items():   # ``del cfg.name``
        target = follow_path(ns, name)
        for attr in attrs:
            if attr in getattr(target, "__dict__", {}):
                delattr(target, attr)
    for name in state.get("deleted") or []:   # unbound by the cell's ``del``, as after a plain cell
        ns.pop(name, None)
    for name, source in (state.get("scripted") or {}).items():
        # torch.jit.script(model) in the cell: the notebook's model scripted, sharing its parameters
        try:
            ns[name] = torch.jit.script(modules[source])
        except Exception as exc:   # named in the cell's note, with the reason
            logger.debug("torch.jit.script(%s) failed in the kernel", source, exc_info=True)
            not_loaded.append(f"{name} (torch.jit.script({source}) raised {type(exc).__name__} in the notebook: "
                              f"{exc})")
            continue
        bound.append(name)
    return {"values": bound + objects, "made": made, "objects": objects, "not_loaded": not_loaded,
            "defined": defined, "not_defined": not_defined}


def _aliased(ns: dict, other):
    """The notebook's object a name the cell bound stands for (rank_state's aliases): ``ns[other]``, or the
    list or dict ``(container, keys)`` names, as the notebook holds it before it is refilled."""
    from .containers import item_at
    if isinstance(other, tuple):
        where, keys = other
        return item_at(follow_path(ns, where), keys)
    return ns.get(other)


def _apply_items(ns: dict, items: dict) -> list[str]:
    """Lists and dicts of tensors the cell changed on the notebook's objects (``self.outs.append(...)``):
    rebuilt from their entries (:func:`~.containers.describe`), the notebook's own list refilled where
    the cell kept it, a new one bound where the cell bound one."""
    from .containers import refill_all
    plans: dict = {}
    done, rebound = _planned_items(ns, items, plans)
    for target, attr, new in rebound:
        setattr(target, attr, new)
    refill_all(plans)
    return done


def _planned_items(ns: dict, items: dict, plans: dict) -> tuple[list[str], list]:
    """:func:`_apply_items`' new contents, built before any is written: the notebook's lists to refill into
    ``plans`` (as :func:`~.containers.planned`), and ``(object, attribute, new)`` to bind anew."""
    from .containers import is_listlike, rebuilt
    done, rebound = [], []
    for name, attrs in items.items():
        target = follow_path(ns, name)
        for attr, (same, kind, entries) in attrs.items():
            old = getattr(target, attr, None)
            base = "list" if is_listlike(kind) else "dict"
            if same and isinstance(old, list if base == "list" else dict):   # (a defaultdict refilled stays one)
                if id(old) not in plans:
                    plans[id(old)] = (old, rebuilt(old, base, entries, plans, ns))
            else:   # (bound anew: of rank 0's type, a defaultdict with its factory)
                rebound.append((target, attr, rebuilt(old, kind, entries, plans, ns)))
            done.append(f"{name}.{attr}")
    return done, rebound


def _set_datasets(ns: dict, datasets: tuple, referenced: dict, not_loaded: list[str]) -> list[str]:
    """The datasets the cell set on the notebook's objects (rank_state's ``(blob, paths, names)``),
    holding the notebook's own where they did; what cannot be unpickled here is named in ``not_loaded``."""
    try:
        found = loaded(datasets[0], referenced)
    except Exception as exc:   # named in the cell's note, with the reason
        logger.debug("%s could not be unpickled in the kernel", datasets[2], exc_info=True)
        not_loaded += [f"{name} ({type(exc).__name__}: {exc})" for name in datasets[2]]
        return []
    done = []
    for name, attrs in found.items():
        target = follow_path(ns, name)
        for attr, value in attrs.items():
            setattr(target, attr, value)
            done.append(f"{name}.{attr}")
    return done


def _attribute_targets(ns: dict, attributes) -> list:
    """``(object, attribute, value)`` for each of ``{path: {attribute: value}}``."""
    return [(follow_path(ns, name), attr, value) for name, attrs in (attributes or {}).items()
            for attr, value in attrs.items()]


def _refill(old, value, items=None) -> bool:
    """Give the notebook's list, dict, tensor or array ``old`` the contents of ``value`` (the same object
    stays, as other names may hold it); False where they are not of one kind (and shape). ``items``:
    where a tensor or array takes ``value``'s items (:func:`_changed_items`), else everywhere."""
    import torch
    if isinstance(old, list) and isinstance(value, list):
        old[:] = value
    elif isinstance(old, dict) and isinstance(value, dict):
        old.clear()
        old.update(value)
    elif _same_tensor(old, value):
        with torch.no_grad():
            if items is None:
                old.copy_(value)
            else:
                old[items] = value.to(old.device)[items]
    elif _same_array(old, value):
        if items is None:
            old[...] = value
        else:
            old[items] = value[items]
    else:
        return False
    return True


def _same_tensor(old, value) -> bool:
    import torch
    return isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape \
        and old.dtype == value.dtype


def _changed_items(old, value):
    """Where ``value`` differs from the notebook's tensor or array ``old`` of its shape (a mask), or None."""
    try:
        if _same_tensor(old, value):
            mask = old.ne(value.to(old.device))
        elif _same_array(old, value):
            mask = old != value
        else:
            return None
    except Exception:  # a kind without elementwise comparison: copied whole
        logger.debug("no elementwise comparison of a %s: copied whole", type(old).__name__, exc_info=True)
        return None
    return mask if getattr(mask, "shape", None) == old.shape and str(mask.dtype) in ("bool", "torch.bool") else None


def _same_array(old, value) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(old, numpy.ndarray) and isinstance(value, numpy.ndarray) and \
        old.shape == value.shape and old.dtype == value.dtype and old.flags.writeable


refill = _refill   # (the notebook's containers' items: containers.py)
_MISSING = object()


def _adopt_layers(module, trained) -> None:
    """``module`` (the notebook's object) takes ``trained``'s structure and weights, as if the cell had
    replaced its layers in the notebook: layers that kept their type stay the same objects (their
    tensors updated in place), new ones are copies of the trained ones, on ``module``'s device."""
    import torch
    where = next(iter(module.parameters()), None)
    device = where.device if where is not None else torch.device("cpu")

    def own_shapes(m) -> dict:
        return {n: getattr(t, "shape", None) for n, t in [*m._parameters.items(), *m._buffers.items()]}

    def adopt(mine, theirs) -> None:
        for attr in ("_parameters", "_buffers"):
            own, new = getattr(mine, attr), getattr(theirs, attr)
            for name in [n for n in own if n not in new]:
                del own[name]
            for name, t in new.items():
                old = own.get(name)
                if t is None or old is None:
                    # its tensors are views of a receive buffer the next cell reuses: a copy
                    own[name] = None if t is None else copy.deepcopy(t).to(device)
                else:
                    old.data.copy_(t)
        mine._non_persistent_buffers_set = set(theirs._non_persistent_buffers_set)
        children = mine._modules
        for name in [n for n in children if n not in theirs._modules]:
            del children[name]
        for name, child in theirs._modules.items():
            old = children.get(name)
            # A layer of the same class whose own tensors kept their shapes is the same layer (its
            # descendants may have changed); otherwise the cell made a new one: take it.
            if old is not None and child is not None and type(old) is type(child) \
                    and own_shapes(old) == own_shapes(child):
                adopt(old, child)
            else:
                children[name] = None if child is None else copy.deepcopy(child).to(device)

    with torch.no_grad():
        adopt(module, trained)


def adopt_cell_classes(ns: dict, made: list[str], defined: list[str]) -> None:
    """Models the cell built from classes it defined arrive as instances of copies of those classes;
    make them instances of the classes the notebook now holds
    (:func:`~gpumagic.cell.definitions.define_in_notebook`), so that ``isinstance(head, Head)`` holds and
    ``torch.save(head)`` finds the class, as after a plain cell."""
    classes = {name: ns[name] for name in defined if isinstance(ns.get(name), type)}
    by_qualname = {(c.__module__, c.__qualname__): c for c in classes.values()}
    for name in made:
        objects = ns[name].modules() if hasattr(ns[name], "modules") else [ns[name]]
        for sub in objects:
            cls = by_qualname.get((type(sub).__module__, type(sub).__qualname__))
            if cls is not None and cls is not type(sub):
                sub.__class__ = cls


def _optimizer_state_to_keep(opt, sd: dict) -> dict:
    """``sd`` whose tensors the optimizer may keep: the received ones are views of a reused buffer.

    ``load_state_dict`` copies a state tensor to its parameter's GPU anyway; it keeps CPU ones
    (and ``step``) as they are, so those are cloned here.
    """
    import torch
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for idx, st in sd["state"].items():
        on_gpu = isinstance(idx, int) and idx < len(params) and params[idx].device.type != "cpu"
        state[idx] = {k: (v.clone() if isinstance(v, torch.Tensor) and (not on_gpu or k == "step" or v.dim() == 0)
                          else cloned(v) if not isinstance(v, torch.Tensor) else v)
                      for k, v in st.items()}
    return {**sd, "state": state}


def cloned(obj):
    """``obj`` with each tensor in it cloned (dicts keep their type)."""
    import torch

    from .containers import tensors_mapped
    return tensors_mapped(obj, torch.Tensor.clone)


def unbind_not_returned(ns: dict, assigned: list, not_returned: list[str], still_bound: list[str]) -> None:
    """Names the cell bound anew that do not come back (``trainer = Trainer(...)``, noted as ending with
    the cell) are unbound in the notebook too: left alone, they would hold what an earlier cell bound
    (the trainer of a plain run), which the next cell would read as the cell's. A notebook model,
    optimizer, loader or scheduler that the cell rebound to the framework's wrapper of it
    (``loader = accelerator.prepare(loader)``) stays: it is the object the cell trained with; so does a
    name the cell left on the notebook's own object (``still_bound``: ``ev = ev or Evaluator(model)``)."""
    import torch
    kept = (torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader)
    for entry in not_returned:
        name = entry.split(" (", 1)[0]
        if name in assigned and name in ns and name not in still_bound \
                and not (isinstance(ns[name], kept) or is_stateful(ns[name])):
            del ns[name]
