"""``--strategy fsdp`` after the cell, in the kernel: the trained state rank 0 gathered, in the notebook's objects.

Rank 0 wrote most of it into the notebook's own tensors already (shared memory); the rest (a model on a GPU in
the kernel) comes through the pool's buffer and is copied in. A fresh optimizer's state, which the notebook had
no tensors for, gets them made here in shared memory, and the ranks gather into those in a second task
(:func:`gather_deferred_state`), so that no process holds it twice. The optimizers' state is then copied out
of shared memory (the model stays there), so that it is the notebook's own, as after a plain cell: a later
``%%sharedtrain`` cell gives each worker its own copy. What the ranks now hold is recorded in the ranks'
:class:`~..ranks.kept.Sharded`, for the next cell.

Runs in the kernel: no IPython.
"""
from __future__ import annotations

import logging
import math
import weakref

from ...cell.module_settings import apply_settings
from ..protocol import Gathered, GatheredOptimizer
from ..ranks.kept import ShardRecord
from .fsdp_rank import GATHER_DEFERRED, DeferredOrder

logger = logging.getLogger(__name__)

__all__ = ["module_keys", "optimizer_keys", "unchanged", "share", "load_gathered", "private_again"]


def module_keys(module) -> dict:
    from ...procs.tensor_cache import fingerprint_keys
    sd = module.state_dict(keep_vars=True)
    return dict(zip(sd, fingerprint_keys([t.detach() for t in sd.values()]))) if sd else {}


def optimizer_keys(opt) -> dict:
    import torch

    from ...procs.tensor_cache import fingerprint_keys
    found = [((i, k), v.detach()) for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
             for k, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
    return dict(zip([r for r, _ in found], fingerprint_keys([t for _, t in found]))) if found else {}


def _hyperparameters(opt) -> list:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - tensor-valued hyperparameters compare elementwise: unequal, ship again
        return False


def unchanged(record: ShardRecord | None, obj, keys_of) -> bool:
    """Whether the ranks' shards of ``obj`` are current: the same object, hyperparameters and contents."""
    if record is None or record.ref() is not obj:
        return False
    if record.groups is not None and not _same(record.groups, _hyperparameters(obj)):
        return False
    return record.keys is None or keys_of(obj) == record.keys


def share(tensors, moved: set | None = None) -> set:
    """CPU tensors moved into shared memory in place (the same objects; once: a shared one stays); returns their
    ids, and adds to ``moved`` those of the ones not shared before."""
    from ...procs.bulk import share_in_place
    cpu = [t for t in tensors if t.device.type == "cpu" and not t.is_meta]
    if moved is not None:
        moved |= {id(t) for t in cpu if not t.is_shared()}
    share_in_place(cpu)
    return {id(t) for t in cpu}


def _gather_deferred_state(gathered: Gathered, ranks) -> dict:
    """The optimizer state the notebook had no tensors for (a fresh optimizer's first moments): made here in
    shared memory, zeroed, and filled in place by the ranks in a second task. Returns ``{ref: tensor}``;
    ``gathered.tensors`` gets their entries."""
    import torch

    from ...procs.bulk import share_in_place
    if not gathered.deferred:
        return {}
    made = {tuple(ref): torch.zeros(shape, dtype=getattr(torch, dtype)) for ref, dtype, shape in gathered.deferred}
    share_in_place(list(made.values()))
    results = ranks.run(GATHER_DEFERRED, DeferredOrder(made, list(made)))
    gathered.tensors = list(gathered.tensors) + list(results[0][0])
    return made


def _nbytes(dtype: str, shape) -> int:
    import torch
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _by_owner(gathered: Gathered, buffer) -> tuple[dict, dict]:
    """The gathered tensors by module and by optimizer: ``(view in the buffer or None, fingerprint)``."""
    import torch
    by_module: dict = {}
    by_optimizer: dict = {}
    for t in gathered.tensors:
        ref = tuple(t.ref)
        view = None
        if t.offset >= 0:
            raw = buffer[t.offset: t.offset + _nbytes(t.dtype, t.shape)]
            view = raw.view(getattr(torch, t.dtype)).view(t.shape)
        if ref[0] == "module":
            by_module.setdefault(ref[1], {})[ref[2]] = (view, t.key)
        else:
            by_optimizer.setdefault(ref[1], {})[(ref[2], ref[3])] = (view, t.key)
    return by_module, by_optimizer


def load_gathered(gathered: Gathered, buffer, modules: dict, optimizers: dict, ranks, shipment,
                  settings: dict) -> list[str]:
    """Rank 0's gathered state into the notebook (see the module's docstring); ``settings``: rank 0's
    :func:`~gpumagic.cell.module_settings.module_settings` (eval(), attributes, requires_grad), set on the
    modules, a meta model's too. Records what the ranks now hold; returns the names whose trained state stays
    in the workers."""
    import torch
    made = _gather_deferred_state(gathered, ranks)
    order, sharded = shipment.order, ranks.kept.sharded
    by_module, by_optimizer = _by_owner(gathered, buffer)
    stayed = []
    with torch.no_grad():
        for name, module in modules.items():
            if name in settings:
                apply_settings(module, settings[name])
            if name in order.stay:
                sharded.modules[name] = ShardRecord(weakref.ref(module), None, blocks=order.blocks[name])
                stayed.append(name)
                continue
            got, mine = by_module.get(name, {}), module.state_dict(keep_vars=True)
            for fqn, (view, _) in got.items():
                if view is not None:
                    mine[fqn].data.copy_(view)
            sharded.modules[name] = ShardRecord(weakref.ref(module), {fqn: key for fqn, (_, key) in got.items()},
                                                blocks=order.blocks[name])
    for name, opt in optimizers.items():
        if _load_optimizer_back(name, opt, gathered.optimizers[name], by_optimizer.get(name, {}), made, shipment,
                                sharded):
            stayed.append(name)
        # The ranks let go of its state tensors (fsdp_rank): the next cell shares the notebook's anew.
        for ref in [r for r in sharded.sent or {} if r[0] == "optimizer" and r[1] == name]:
            del sharded.sent[ref]
    return stayed


def _load_optimizer_back(name: str, opt, groups: GatheredOptimizer, tensors: dict, made: dict, shipment,
                         sharded) -> bool:
    """One optimizer's trained state: its hyperparameters only where its state stays in the workers (True)."""
    if name in shipment.order.keep_optimizers:
        for mine, theirs in zip(opt.param_groups, groups.param_groups):
            mine.update(theirs)
        _private_state(opt, shipment.moved)
        sharded.optimizers[name] = ShardRecord(weakref.ref(opt), optimizer_keys(opt), _hyperparameters(opt))
        return True
    _load_optimizer(opt, groups, tensors, {r[2:]: t for r, t in made.items() if r[1] == name})
    _private_state(opt, shipment.moved | {id(t) for t in made.values()})
    sharded.optimizers[name] = ShardRecord(weakref.ref(opt), {r: key for r, (_, key) in tensors.items()},
                                           _hyperparameters(opt))
    return False


def private_again(optimizers: dict, moved: set) -> None:
    """After a cell that failed or was interrupted: the optimizers' state the cell moved into shared memory is the
    notebook's own again (copies, holding what it held), as after a cell that succeeded. A later
    ``%%sharedtrain`` cell would otherwise take it as shared on purpose, every worker updating one Adam state.
    Run on every way out: after a success it finds nothing left to copy."""
    for opt in optimizers.values():
        _private_state(opt, moved)


def _private_state(opt, moved: set) -> None:
    """An optimizer's state in the notebook's own memory again: copies take the place of the tensors the cell put
    in shared memory (``moved``, by id); state the notebook had shared itself stays shared."""
    for st in opt.state.values():
        for k, v in list(st.items()):
            if id(v) in moved:
                st[k] = v.clone()


def _load_optimizer(opt, groups: GatheredOptimizer, tensors: dict, made: dict) -> None:
    """The trained state: tensors written in place are the notebook's own (or ``made`` for it, by
    ``(index, key)``), the others copied out of the buffer."""
    flat = [p for g in opt.param_groups for p in g["params"]]
    state: dict = {}
    for idx, values in groups.plain.items():
        state.setdefault(idx, {}).update(values)
    for (idx, k), (view, _) in tensors.items():
        if view is not None:
            value = view.clone()
        elif (idx, k) in made:
            value = made[(idx, k)]
        else:
            value = opt.state[flat[idx]][k]
        state.setdefault(idx, {})[k] = value
    param_groups, start = [], 0
    for mine, theirs in zip(opt.param_groups, groups.param_groups):
        n = len(mine["params"])
        param_groups.append({**theirs, "params": list(range(start, start + n))})
        start += n
    opt.load_state_dict({"state": state, "param_groups": param_groups})
