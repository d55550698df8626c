"""On a rank, what DDP and launch mode collect of the trained state after the cell, and keep for the next one.

Rank 0 sends the trained modules' state dicts, what the cell set on them besides their tensors (``eval()``,
plain attributes, ``requires_grad``), a module whose layers the cell replaced whole, the optimizers' and
schedulers' states, a loader's own generator, and the last gradients (a plain cell leaves them on the model).
Every rank keeps what it trained and the data it read for the next cell (:mod:`gpumagic.procs.tensor_cache`),
and the gradients, which are the same on every rank.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import logging

from ...cell.module_settings import module_settings
from ..protocol import Trained
from ..rank.cell import RankCell

__all__ = ["reload_optimizers", "remember_shapes", "name_trained", "plain_grads", "trained_tensors", "keep",
           "collect", "collect_unsharded"]

logger = logging.getLogger(__name__)


def reload_optimizers(cell: RankCell) -> None:
    """The cell's optimizers, their state placed by their own ``load_state_dict`` beside each parameter."""
    cell.opts = {name: cell.ns[name] for name in cell.order.roles.optimizers}
    for opt in cell.opts.values():
        opt.load_state_dict(opt.state_dict())


def _shapes(module) -> dict:
    return {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}


def remember_shapes(cell: RankCell) -> None:
    """Each trained module's tensor shapes: one whose layers the cell replaced comes back whole."""
    cell.scratch["shapes"] = {name: _shapes(module) for name, module in cell.inner.items()}


def name_trained(cell: RankCell) -> None:
    """The trained modules, their wrappers and their layers, as the notebook names them (the by-name
    pickler's: ``reg["head"] = model.fc`` is the notebook's layer)."""
    for name, module in cell.inner.items():
        cell.known[id(cell.ns[name])] = (("path", (name,)), cell.ns[name])
        cell.known[id(module)] = (("path", (name,)), module)
        for path, sub in module.named_modules():
            if path:
                cell.known.setdefault(id(sub), (("path", (name, ("layer", path))), sub))


def plain_grads(inner: dict) -> dict:
    """``{module: {parameter: grad or None}}``; a module with sharded gradients (the cell's own FSDP) has none
    to give."""
    import torch
    grads = {}
    for name, module in inner.items():
        params = dict(module.named_parameters())
        if all(p.grad is None or type(p.grad) is torch.Tensor for p in params.values()):
            grads[name] = {k: p.grad for k, p in params.items()}
    return grads


def trained_tensors(tensors: list, inner: dict, opts: dict) -> list:
    """What every rank holds for the next cell: what it trained, and the data it read."""
    import torch
    held = list(tensors)
    for module in inner.values():
        held += list(module.state_dict(keep_vars=True).values())
    for opt in opts.values():
        for st in opt.state.values():
            held += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return held


def keep(cell: RankCell, grads: dict, kept_grads: bool, gathered: dict) -> None:
    """The rank keeps what it trained for the next cell (not what a framework sharded: those are shards), and
    the gradients where ``kept_grads`` (DDP's average, the same on every rank); the parameters let theirs go."""
    held = [g for n, by_param in grads.items() if n not in gathered for g in by_param.values() if g is not None] \
        if kept_grads else []
    for module in cell.inner.values():
        for p in module.parameters():
            p.grad = None
    inner = {n: m for n, m in cell.inner.items() if n not in gathered}
    cell.keys = frozenset(cell.store.rebuild(trained_tensors(cell.tensors + held, inner, cell.opts)))


def _stateful_states(ns: dict, names) -> dict:
    states = {}
    for n in names:
        try:
            states[n] = ns[n].state_dict()
        except Exception:  # its state stays in the workers; the notebook keeps the object as it was
            logger.debug("state_dict() of %r failed", n, exc_info=True)
    return states


def collect_unsharded(cell: RankCell) -> None:
    """What rank 0 sends of the trained state beside the modules' and optimizers' tensors (which ``--strategy fsdp``
    gathers its own way): what the cell set on the modules (``eval()``, attributes, ``requires_grad``: an FSDP
    module answers with the notebook's qualified names), the schedulers' state, a loader's own generator."""
    ns, roles, trained = cell.ns, cell.order.roles, cell.trained
    trained.settings = {n: module_settings(m) for n, m in cell.inner.items()}
    # a loader's own generator (passed on to the split loader) advanced as it would in one process
    trained.generators = {n: ns[n].generator.get_state() for n in roles.loaders if ns[n].generator is not None}
    trained.stateful = _stateful_states(ns, roles.stateful)


def collect(cell: RankCell, grads: dict, gathered: dict | None = None) -> None:
    """Rank 0's trained state into ``cell.trained`` (``gathered``: whole state dicts of the modules a framework
    sharded, launch mode's)."""
    gathered = gathered or {}
    shapes = cell.scratch["shapes"]
    trained: Trained = cell.trained
    collect_unsharded(cell)
    trained.modules = {n: m.state_dict() for n, m in cell.inner.items()}
    trained.modules.update(gathered)
    trained.optimizers = {n: o.state_dict() for n, o in cell.opts.items()}
    trained.grads = {n: g for n, g in grads.items() if n not in gathered}
    # A module whose layers the cell replaced comes back whole: the notebook's takes its layers.
    trained.reshaped = {n: m for n, m in cell.inner.items() if n not in gathered and _shapes(m) != shapes[n]}
