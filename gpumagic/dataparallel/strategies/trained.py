"""In the kernel, rank 0's trained state (:class:`~gpumagic.dataparallel.protocol.Trained`) loaded into the
notebook's own objects in place: what DDP and launch mode do after the cell.

Everything is checked first: a module whose structure or shapes the cell changed without replacing its
layers, or an optimizer whose parameter groups changed, leaves every notebook object as it was. Then the
modules take the trained tensors in place (``model`` stays the same object, on its device; a cell that cast
it takes the new dtype; one that replaced layers gives the notebook's module the new layers), what the cell
set on them besides their tensors, and rank 0's last gradients; the optimizers, schedulers and loaders' own
generators take their state; a module the cell scripted is scripted again from the notebook's.

In a notebook (what the magic does after a DDP cell)::

    load_trained(get_ipython().user_ns, returned.trained, modules, optimizers, stateful)
"""
from __future__ import annotations

import collections
import copy
import logging
from dataclasses import dataclass, field

from ...cell.module_settings import apply_settings
from ..protocol import Trained

logger = logging.getLogger(__name__)

__all__ = ["Loaded", "load_trained", "load_into_notebook", "tensor_targets", "cloned"]


def cloned(obj):
    """``obj`` with each tensor in it cloned (dicts keep their type): out of a buffer the next cell reuses."""
    import torch

    from ...cell.values import same_tuple_type
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        items = {k: cloned(v) for k, v in obj.items()}
        if type(obj) is collections.defaultdict:
            return collections.defaultdict(obj.default_factory, items)
        return collections.OrderedDict(items) if type(obj) is collections.OrderedDict else items
    if isinstance(obj, list):
        return [cloned(v) for v in obj]
    if isinstance(obj, tuple):
        return same_tuple_type(obj, [cloned(v) for v in obj])
    return obj


def _problems(trained: Trained, modules: dict, optimizers: dict) -> list[str]:
    problems = []
    for name, module in modules.items():
        if name in trained.reshaped:
            continue   # the cell replaced layers: the notebook's module takes the new ones
        got, have = trained.modules[name], module.state_dict()
        missing, extra = sorted(set(have) - set(got)), sorted(set(got) - set(have))
        if missing or extra:
            problems.append(f"{name}: the cell changed its structure (missing {missing[:3]}, new {extra[:3]})")
            continue
        problems += [f"{name}.{k}: shape {tuple(v.shape)} became {tuple(got[k].shape)} in the cell"
                     for k, v in have.items() if tuple(v.shape) != tuple(got[k].shape)]
    for name, opt in optimizers.items():
        got = trained.optimizers[name]
        if len(got["param_groups"]) != len(opt.param_groups) or any(
                len(g["params"]) != len(h["params"]) for g, h in zip(got["param_groups"], opt.param_groups)):
            problems.append(f"{name}: the cell changed the optimizer's parameter groups")
    return problems


def _follow_dtypes(module, got: dict) -> None:
    """A cell that cast the model (``model.double()``): the notebook's tensors take the new dtype in place (the
    same Parameter objects, as after a plain cell), so loading does not cast back."""
    for key, t in module.state_dict(keep_vars=True).items():
        if key in got and got[key].dtype != t.dtype:
            t.data = t.data.to(got[key].dtype)


def _load_grads(module, grads: dict) -> None:
    """Rank 0's last gradients on the notebook's parameters, as a plain cell leaves them (None where the cell
    zeroed them to None): copied, as the received tensors are views of a reused buffer."""
    for key, p in module.named_parameters():
        g = grads.get(key)
        if g is None:
            p.grad = None
        elif p.grad is not None and p.grad.shape == g.shape and p.grad.dtype == g.dtype:
            p.grad.copy_(g)
        else:
            p.grad = g.to(device=p.device, dtype=p.dtype, copy=True)


def _adopt_layers(module, trained) -> None:
    """``module`` (the notebook's) takes ``trained``'s structure and weights, as if the cell had replaced its
    layers in the notebook: layers that kept their type stay the same objects (their tensors updated in place),
    new ones are copies of the trained ones, on ``module``'s device."""
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
            # A layer of the same class whose own tensors kept their shapes is the same layer (its descendants
            # may have changed); otherwise the cell made a new one: take it.
            if old is not None and child is not None and type(old) is type(child) \
                    and own_shapes(old) == own_shapes(child):
                adopt(old, child)
            else:
                children[name] = None if child is None else copy.deepcopy(child).to(device)

    with torch.no_grad():
        adopt(module, trained)


def _optimizer_state_to_keep(opt, sd: dict) -> dict:
    """``sd`` whose tensors the optimizer may keep: ``load_state_dict`` copies a state tensor to its
    parameter's GPU anyway; CPU ones (and ``step``) it keeps as they are, so those are cloned here."""
    import torch
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for idx, st in sd["state"].items():
        on_gpu = isinstance(idx, int) and idx < len(params) and params[idx].device.type != "cpu"
        state[idx] = {k: (v.clone() if isinstance(v, torch.Tensor) and (not on_gpu or k == "step" or v.dim() == 0)
                          else cloned(v) if not isinstance(v, torch.Tensor) else v)
                      for k, v in st.items()}
    return {**sd, "state": state}


def _load_modules(trained: Trained, modules: dict) -> None:
    import torch
    with torch.no_grad():
        for name, module in modules.items():
            if name in trained.reshaped:
                _adopt_layers(module, trained.reshaped[name])
            else:
                _follow_dtypes(module, trained.modules[name])
                module.load_state_dict(trained.modules[name])
            if name in trained.settings:
                apply_settings(module, cloned(trained.settings[name]))
            if name in trained.grads:   # (a reshaped module has the trained one's names by now)
                _load_grads(module, trained.grads[name])


def _load_stateful(ns: dict, trained: Trained, stateful, written: list[str]) -> None:
    for name in stateful:
        if name not in trained.stateful:
            continue
        try:
            ns[name].load_state_dict(cloned(trained.stateful[name]))
        except Exception as exc:
            # the trained weights are in the notebook already: say so, rather than leave it to be guessed
            raise RuntimeError(
                f"{name}.load_state_dict raised {type(exc).__name__}: {exc}. The trained state was already loaded "
                f"into {', '.join(written)}, which keep it; {name} and the cell's other values are as before the "
                "cell") from exc


def _scripted(ns: dict, trained: Trained, modules: dict) -> tuple[list[str], list[str]]:
    """torch.jit.script(model) in the cell: the notebook's model scripted, sharing its parameters."""
    import torch
    bound, failed = [], []
    for name, source in trained.scripted.items():
        try:
            ns[name] = torch.jit.script(modules[source])
        except Exception as exc:   # named in the cell's note, with the reason
            logger.debug("torch.jit.script(%s) failed in the kernel", source, exc_info=True)
            failed.append(f"{name} (torch.jit.script({source}) raised {type(exc).__name__} in the notebook: {exc})")
            continue
        bound.append(name)
    return bound, failed


def load_trained(ns: dict, trained: Trained, modules: dict, optimizers: dict, stateful) -> tuple[list, list]:
    """Rank 0's trained state into the notebook's ``modules``, ``optimizers`` and ``stateful`` objects (see the
    module's docstring); raises without changing anything where it does not fit. Returns the names a scripted
    module was bound to, and the note's entries for those that could not be."""
    optimizers = {n: o for n, o in optimizers.items() if n in trained.optimizers}   # (the rest stayed)
    problems = _problems(trained, modules, optimizers)
    if problems:
        raise RuntimeError("the ranks finished, but their state does not fit the notebook's objects, which are "
                           "left as they were: " + "; ".join(problems))
    _load_modules(trained, modules)
    for name, opt in optimizers.items():
        opt.load_state_dict(_optimizer_state_to_keep(opt, trained.optimizers[name]))
    _load_stateful(ns, trained, stateful, [*modules, *optimizers])
    for name, generator_state in trained.generators.items():
        generator = getattr(ns.get(name), "generator", None)
        if generator is not None:
            generator.set_state(generator_state.clone())
    return _scripted(ns, trained, modules)


@dataclass
class Loaded:
    """What a strategy's :meth:`~.base.Strategy.after` loaded into the notebook."""
    optimizers: list[str] = field(default_factory=list)    # those that took rank 0's state
    stayed: list[str] = field(default_factory=list)        # trained state kept sharded in the workers
    bound: list[str] = field(default_factory=list)         # names bound (a module scripted again)
    not_loaded: list[str] = field(default_factory=list)    # the note's entries


def tensor_targets(read, modules_to: str = "rank") -> dict:
    """Tensors of the trained modules (and their gradients) go to the rank's device (``modules_to``: fsdp
    shards them from the CPU); optimizer state stays put until the optimizer places it beside its parameter."""
    import torch
    targets = {}
    for m in read.survey.modules.values():
        for t in m.state_dict(keep_vars=True).values():
            targets[id(t)] = modules_to
        for p in m.parameters():
            if p.grad is not None:
                targets[id(p.grad)] = modules_to
    for opt in read.survey.optimizers.values():
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    targets[id(v)] = "keep" if modules_to == "rank" else modules_to
    return targets


def load_into_notebook(read, returned) -> Loaded:
    """Rank 0's trained state into the notebook's modules, optimizers and schedulers (DDP, launch mode)."""
    survey = read.survey
    bound, not_loaded = load_trained(read.ns, returned.trained, survey.modules, survey.optimizers,
                                     survey.stateful)
    # (a notebook optimizer whose state a framework sharded is left as it was: not named as loaded)
    return Loaded([n for n in survey.optimizers if n in returned.trained.optimizers], [], bound, not_loaded)
