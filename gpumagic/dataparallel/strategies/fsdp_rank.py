"""``%%dataparallel --strategy fsdp`` on a rank: the notebook's models sharded with FSDP2, and gathered back.

:class:`FsdpRank` shards each trained module over the ranks
(``fully_shard`` per block, see :mod:`.fsdp_blocks`, then the whole model): a rank
holds ``1/N`` of the parameters, gradients and optimizer state. The module
arrives as views of the notebook's own tensors (in shared memory, see
:mod:`.fsdp`): FSDP copies one block at a time to the rank's device and keeps
the rank's shard of it, so no rank holds more than its shards plus one block; a module on the
``meta`` device is materialised block by block on the rank's device (each
submodule's ``reset_parameters()``) and sharded before the next block exists.
The notebook's optimizers are pointed at the sharded parameters and their
state split the same way.

After the cell, :meth:`FsdpRank.send` all-gathers one tensor at a time;
rank 0 writes each into the notebook's own tensor (shared memory) in place,
or into its outgoing buffer where the notebook has none to write into. No
process holds more than its shards plus one whole tensor.

Each rank keeps its sharded modules and optimizers (``ctx.state``) for the
next cell, which gets them instead of the notebook's copies when the kernel
finds the notebook's unchanged (:meth:`FsdpRank.stand_ins`).

Runs in the workers: no IPython.
"""
from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ...cell.module_settings import apply_settings
from ..protocol import CellWarning, Gathered, GatheredOptimizer, GatheredTensor, RankDone, Writing
from ..rank.cell import RankCell
from ..rank.exports import exporting_once
from ..rank.loaders import split_loaders
from ..rank.mode_guard import refusing_frameworks
from ..rank.send import pack_returned
from ..rank.swaps import held_objects_swapped
from .base import RankStrategy
from .collect import collect_unsharded, name_trained, trained_tensors
from .ddp_wrapper import refuse_unaveraged_steps
from .fsdp_blocks import block_instances
from .fsdp_whole import whole_values

logger = logging.getLogger(__name__)

__all__ = ["FsdpRank", "DeferredOrder", "gather_deferred", "GATHER_DEFERRED", "forget_kept"]

_STATE_KEY = "fsdp"


def _kept(ctx) -> dict:
    """What a rank keeps between cells: sharded ``modules`` and ``optimizers`` by notebook name, and
    ``targets``: the notebook's tensors (shared memory) that rank 0 writes the trained state into, by
    ``("module", name, fqn)`` or ``("optimizer", name, index, key)``; the kernel sends only new ones."""
    return ctx.state.setdefault(_STATE_KEY, {"modules": {}, "optimizers": {}, "targets": {}})


def forget_kept(ctx) -> None:
    """Drop what the rank kept (a failed cell may have half-updated it)."""
    ctx.state.pop(_STATE_KEY, None)


def _named_tensors(module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _mesh(ctx, device):
    """One device mesh over all ranks, made once per pool."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = ctx.state.get("fsdp_mesh")
    if mesh is None:
        mesh = ctx.state["fsdp_mesh"] = init_device_mesh(device.type, (ctx.world_size,))
    return mesh


def _private_buffers(module) -> None:
    """Buffers are not sharded: a rank's own copy, so training (BatchNorm's statistics) never writes
    into the notebook's."""
    for m in module.modules():
        for key, b in m._buffers.items():
            if b is not None:
                m._buffers[key] = b.clone()


def _shard(module, classes: list[str], mesh, policy, device, on_meta: bool) -> list[str]:
    """FSDP units: each block, then the rest; returns the classes a meta model had no initialiser for."""
    from torch.distributed.fsdp import fully_shard
    blocks = block_instances(module, classes)
    memo: dict = {}
    uninitialised: list[str] = []
    for block in blocks:
        if on_meta:
            _materialise(block.modules(), device, memo, uninitialised)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    if on_meta:
        in_blocks = {id(s) for b in blocks for s in b.modules()}
        _materialise([m for m in module.modules() if id(m) not in in_blocks], device, memo, uninitialised)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return uninitialised


def _materialise(modules, device, memo: dict, uninitialised: list) -> None:
    """Meta tensors of ``modules`` made real on ``device`` and initialised by each module's
    ``reset_parameters()`` (tied parameters stay tied: ``memo``). Modules without one get zeros, and
    what is left at zero is added to ``uninitialised``: the class, or its buffers (a positional
    encoding's table, a causal mask: computed in ``__init__``, which the ranks do not run)."""
    import torch
    for m in modules:
        fresh, fresh_buffers = False, []
        for store in (m._parameters, m._buffers):
            for key, t in store.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in memo:
                    new = torch.zeros_like(t, device=device)
                    memo[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else new
                    if store is m._buffers:
                        fresh_buffers.append(key)
                store[key] = memo[id(t)]
                fresh = True
        if not fresh:
            continue
        # nn.MultiheadAttention names its own _reset_parameters
        reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
        if callable(reset):
            with torch.no_grad():
                reset()
            continue
        what = type(m).__name__
        if fresh_buffers:
            what += f" (buffer{'s' if len(fresh_buffers) > 1 else ''} {', '.join(fresh_buffers)})"
        if (fresh_buffers or any(True for _ in m.parameters(recurse=False))) and what not in uninitialised:
            uninitialised.append(what)


def _adopt_optimizer(opt, param_map: dict, mesh, device) -> None:
    """Point ``opt`` at the sharded parameters and split its state like them."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    for group in opt.param_groups:
        group["params"] = [param_map.get(id(p), p) for p in group["params"]]
    state = {param_map.get(id(p), p): st for p, st in opt.state.items()}
    for p in [p for g in opt.param_groups for p in g["params"]]:
        st = state.get(p)
        if not st or not isinstance(p, DTensor):
            continue
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and tuple(v.shape) == tuple(p.shape):
                # A copy: on a CPU rank the shard would otherwise be a view of the notebook's tensor,
                # which the optimizer's steps would write into.
                st[k] = distribute_tensor(v.detach().to(device, copy=True), mesh, p.placements, src_data_rank=None)
    opt.state = defaultdict(dict, state)


def _let_go_of_optimizer_targets(targets: dict) -> None:
    """The kernel copies the optimizers' state out of shared memory once it is written (fsdp.py): the
    tensors the ranks hold are no longer the notebook's, and holding them would keep the memory."""
    for ref in [r for r in targets if r[0] == "optimizer"]:
        del targets[ref]


GATHER_DEFERRED = "gpumagic.dataparallel.strategies.fsdp_rank:gather_deferred"


@dataclass(frozen=True)
class DeferredOrder:
    """The kernel's second task after an fsdp cell: the optimizer state it had no tensors for, gathered into the
    ones it has just made (shared memory), in ``order``."""
    targets: dict                   # ref -> the kernel's new tensor
    order: list


def gather_deferred(ctx, order: DeferredOrder, data) -> list[GatheredTensor] | None:
    """Every rank gathers; rank 0 writes each into the kernel's tensor in place and answers where it went."""
    import torch
    from torch.distributed.tensor import DTensor

    from ...procs.tensor_cache import fingerprint_keys
    kept = _kept(ctx)
    where = []
    with torch.no_grad():
        for ref in order.order:
            _, name, idx, k = ref
            opt = kept["optimizers"][name]
            param = [p for g in opt.param_groups for p in g["params"]][idx]
            t = opt.state[param][k]
            full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            if ctx.rank == 0:
                order.targets[ref].copy_(full)
                where.append(GatheredTensor(ref, -1, str(full.dtype).removeprefix("torch."), tuple(full.shape),
                                            fingerprint_keys([full])[0]))
    return where if ctx.rank == 0 else None


@dataclass(frozen=True)
class FsdpRank(RankStrategy):
    """What the kernel tells each rank of an fsdp cell (:mod:`.fsdp`)."""
    blocks: dict                            # module name -> its FSDP unit classes
    kept_modules: tuple = ()                # the shards this rank kept from the last cell stand for these
    kept_optimizers: tuple = ()
    stay: tuple = ()                        # models on the meta device: their weights stay in the ranks
    keep_optimizers: tuple = ()             # optimizers whose state stays in the ranks (--keep-optimizer)
    param_dtype: str | None = None          # the cell's autocast dtype: parameters gathered in it
    targets: dict = field(default_factory=dict)     # ref -> the notebook's tensor (shared memory), new ones
    targets_reset: bool = True              # the rank holds no targets from before
    target_refs: tuple = ()                 # every valid ref: the rest are dropped
    settings: dict = field(default_factory=dict)    # a kept module's settings, as the notebook set them since

    def stand_ins(self, ctx) -> dict:
        """The stand-ins for what the kernel did not ship because this rank kept it: ``("module", name)``,
        ``("tensor", name, fqn)``, ``("optimizer", name)``. Whatever the kernel no longer counts on is dropped."""
        kept = _kept(ctx)
        for kind, names in (("modules", self.kept_modules), ("optimizers", self.kept_optimizers)):
            for name in [n for n in kept[kind] if n not in names]:
                del kept[kind][name]
        valid = set(self.target_refs)
        kept["targets"] = {} if self.targets_reset else {r: t for r, t in kept["targets"].items() if r in valid}
        kept["targets"].update(self.targets)
        missing = [n for n in self.kept_modules if n not in kept["modules"]] + \
            [n for n in self.kept_optimizers if n not in kept["optimizers"]]
        if missing:
            raise RuntimeError(f"this worker no longer holds the sharded {', '.join(missing)} the kernel expected; "
                               "run the cell again (the kernel will ship the model)")
        stand_ins: dict = {}
        for name in self.kept_modules:
            module = kept["modules"][name]
            stand_ins[("module", name)] = module
            for fqn, t in _named_tensors(module):
                stand_ins[("tensor", name, fqn)] = t
        for name in self.kept_optimizers:
            stand_ins[("optimizer", name)] = kept["optimizers"][name]
        return stand_ins

    def start(self, cell: RankCell) -> None:
        self._shard_modules(cell)
        cell.opts = {name: cell.ns[name] for name in cell.order.roles.optimizers}
        split_loaders(cell)
        name_trained(cell)

    def _shard_modules(self, cell: RankCell) -> None:
        """Shard the cell's modules (those not kept from the last cell) and adopt its optimizers; the cell's
        names bound to the sharded modules, and :attr:`~.RankCell.inner` set."""
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy
        ns, ctx, device = cell.ns, cell.ctx, cell.device
        kept = _kept(ctx)
        mesh = _mesh(ctx, device)
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, self.param_dtype), reduce_dtype=torch.float32) \
            if self.param_dtype else MixedPrecisionPolicy()
        param_map = {}
        for name in cell.order.roles.modules:
            module = ns[name]
            cell.inner[name] = module
            if name in self.kept_modules:
                # what the notebook set on its copy since the last cell (model.train(), a frozen layer)
                apply_settings(module, self.settings[name])
                continue
            on_meta = any(t.is_meta for _, t in _named_tensors(module))
            fqn_of = {id(p): fqn for fqn, p in module.named_parameters(remove_duplicate=False)}
            if not on_meta:
                _private_buffers(module)
            uninitialised = _shard(module, self.blocks[name], mesh, policy, device, on_meta)
            if uninitialised and cell.rank0:
                cell.send(CellWarning(
                    f"{name} was on the meta device and these classes have no reset_parameters() to initialise "
                    f"their parameters or buffers on the ranks, so they start at zero: {', '.join(uninitialised)}. "
                    "Give them one (computing the buffers too), or initialise them in the cell"))
            now = dict(module.named_parameters(remove_duplicate=False))
            param_map.update({pid: now[fqn] for pid, fqn in fqn_of.items()})
            kept["modules"][name] = module
        for name in cell.order.roles.optimizers:
            if name not in self.kept_optimizers:
                _adopt_optimizer(ns[name], param_map, mesh, device)
                kept["optimizers"][name] = ns[name]

    def running(self, cell: RankCell) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if cell.world_size > 1:
            # FSDP averages the modules it sharded; stepping anything else would train a copy per rank
            sharded = list(cell.inner)
            guard = refuse_unaveraged_steps(lambda: list(cell.inner.values()), cell.ns, sharded, [], {})
            stack.callback(guard.remove)
        # (each rank holds a shard: a save there is the user's per-rank file, as written)
        for guarded in (refusing_frameworks(), exporting_once(cell.rank), held_objects_swapped(cell.ns, cell.swaps)):
            stack.enter_context(guarded)
        return stack

    def finish(self, cell: RankCell) -> None:
        # The shards stay with the rank's own keeping; the store keeps the data the cell read.
        cell.keys = frozenset(cell.store.rebuild(trained_tensors(cell.tensors, {}, {})))
        # A sharded value (clip_grad_norm_'s norm, a state_dict) is useless in the kernel: whole first.
        names = list(dict.fromkeys([*cell.order.watch.assigned, *cell.order.watch.roots]))
        cell.value, not_whole = whole_values(cell.ctx, cell.ns, names, cell.value)
        cell.not_returned += not_whole
        if cell.rank0:
            collect_unsharded(cell)

    def send(self, cell: RankCell, returned):
        """Rank 0's values packed, then every rank gathers the sharded state (rank 0 writing it into the
        notebook's tensors, or after those values)."""
        done = RankDone(cell.stats, cell.started, cell.ended, cell.keys)
        prefix = None
        if returned is not None:
            packed = pack_returned(returned, None)
            done.returned, prefix = packed.header, packed.data()
        done.gathered, buffer = self._gather_into_notebook(cell, prefix)
        done.returned_bytes = buffer.numel() if buffer is not None else 0
        return done, buffer

    def _gathered_items(self, cell: RankCell, targets: dict) -> tuple[list, Gathered]:
        """``[(ref, tensor on the rank, the notebook's tensor or None)]`` to gather, and the rest of what comes
        back: the optimizers' hyperparameters and plain state, and the state the kernel must make first."""
        import torch
        items: list[tuple] = []
        for name, module in cell.inner.items():
            if name not in self.stay:
                items += [(("module", name, fqn), t, targets.get(("module", name, fqn)))
                          for fqn, t in module.state_dict().items()]
        gathered = Gathered()
        for name, opt in cell.opts.items():
            plain: dict = {}
            for idx, p in enumerate(p for g in opt.param_groups for p in g["params"]):
                for k, v in sorted(opt.state.get(p, {}).items()):
                    ref = ("optimizer", name, idx, k)
                    if not isinstance(v, torch.Tensor):
                        plain.setdefault(idx, {})[k] = v
                    elif name in self.keep_optimizers:
                        continue   # only the hyperparameters come back
                    elif targets.get(ref) is None and v.dim() > 0:
                        # a fresh optimizer's state: the kernel makes its tensors, then gather_deferred
                        gathered.deferred.append((ref, str(v.dtype).removeprefix("torch."), tuple(v.shape)))
                    else:
                        items.append((ref, v, targets.get(ref)))
            gathered.optimizers[name] = GatheredOptimizer(
                [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups], plain)
        return items, gathered

    def _gather_into_notebook(self, cell: RankCell, prefix) -> tuple[Gathered | None, Any]:
        """Every rank all-gathers the trained tensors one at a time; rank 0 writes each into the notebook's
        tensor in place, or into its outgoing buffer after ``prefix`` (rank 0's packed answer). No process
        holds more than its shards and one whole tensor."""
        import torch
        from torch.distributed.tensor import DTensor

        from ...procs.tensor_cache import fingerprint_keys
        targets = _kept(cell.ctx)["targets"]
        items, gathered = self._gathered_items(cell, targets)
        offsets, total = _offsets(items, prefix, cell.rank0)
        buffer = cell.ctx.outgoing.get(total) if cell.rank0 and total else None
        if buffer is not None and prefix is not None:
            buffer[: prefix.numel()].copy_(prefix)
        announced = False
        with torch.no_grad():
            for (ref, t, dest), offset in zip(items, offsets):
                full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
                if not cell.rank0:
                    continue
                if offset < 0:
                    if not announced:
                        # every rank got this far (the gather is collective): from here on an interrupt leaves
                        # the notebook's model part-written, and the kernel says so
                        cell.send(Writing())
                        announced = True
                    dest.copy_(full)
                else:
                    assert buffer is not None
                    nbytes = full.numel() * full.element_size()
                    buffer[offset: offset + nbytes].copy_(full.contiguous().reshape(-1).view(torch.uint8))
                # its fingerprint, taken while it is whole on the rank's device: the kernel's next cell compares
                # the notebook's tensors with these to know whether the ranks' shards are current
                gathered.tensors.append(GatheredTensor(ref, offset, str(full.dtype).removeprefix("torch."),
                                                       tuple(full.shape), fingerprint_keys([full])[0]))
        _let_go_of_optimizer_targets(targets)
        if not cell.rank0:
            return None, None
        return gathered, (buffer[:total] if buffer is not None else prefix)


def _offsets(items: list, prefix, rank0: bool) -> tuple[list[int], int]:
    """Where each gathered tensor goes in rank 0's buffer (-1: into the notebook's own tensor, in place), and
    the buffer's size, ``prefix`` first."""
    in_place = [rank0 and dest is not None and tuple(dest.shape) == tuple(t.shape) and dest.dtype == t.dtype
                and dest.device.type == "cpu" for _, t, dest in items]
    total = -(-(prefix.numel() if prefix is not None else 0) // 64) * 64
    offsets = []
    for (_, t, _), here in zip(items, in_place):
        offsets.append(-1 if here else total)
        if not here:
            total += -(-t.numel() * t.element_size() // 64) * 64
    return offsets, total
