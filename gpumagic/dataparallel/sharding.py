"""``%%dataparallel --strategy fsdp`` on a rank: the notebook's models sharded with FSDP2, and gathered back.

:func:`shard_modules` shards each trained module over the ranks
(``fully_shard`` per block, see :mod:`.blocks`, then the whole model): a rank
holds ``1/N`` of the parameters, gradients and optimizer state. The module
arrives as views of the notebook's own tensors (in shared memory, see
:mod:`.fsdp`): FSDP copies one block at a time to the rank's device and keeps
the rank's shard of it, so no rank holds more than its shards plus one block; a module on the
``meta`` device is materialised block by block on the rank's device (each
submodule's ``reset_parameters()``) and sharded before the next block exists.
The notebook's optimizers are pointed at the sharded parameters and their
state split the same way.

After the cell, :func:`gather_into_notebook` all-gathers one tensor at a time;
rank 0 writes each into the notebook's own tensor (shared memory) in place,
or into its outgoing buffer where the notebook has none to write into. No
process holds more than its shards plus one whole tensor.

Each rank keeps its sharded modules and optimizers (``ctx.state``) for the
next cell, which gets them instead of the notebook's copies when the kernel
finds the notebook's unchanged (:func:`kept_objects`).

Runs in the workers: no IPython.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from ..cell.module_settings import apply_settings
from .blocks import block_instances

logger = logging.getLogger(__name__)

__all__ = ["shard_modules", "gather_into_notebook", "gather_deferred", "GATHER_DEFERRED", "kept_objects",
           "forget_kept"]

_STATE_KEY = "fsdp"


def _kept(ctx) -> dict:
    """What a rank keeps between cells: sharded ``modules`` and ``optimizers`` by notebook name, and
    ``targets``: the notebook's tensors (shared memory) that rank 0 writes the trained state into, by
    ``("module", name, fqn)`` or ``("optimizer", name, index, key)``; the kernel sends only new ones."""
    return ctx.state.setdefault(_STATE_KEY, {"modules": {}, "optimizers": {}, "targets": {}})


def forget_kept(ctx) -> None:
    """Drop what the rank kept (a failed cell may have half-updated it)."""
    ctx.state.pop(_STATE_KEY, None)


def kept_objects(ctx, config: dict) -> dict:
    """The stand-ins for what the kernel did not ship because this rank kept it:
    ``("module", name)``, ``("tensor", name, fqn)``, ``("optimizer", name)``. Whatever the kernel no
    longer counts on is dropped."""
    kept = _kept(ctx)
    for kind, names in (("modules", config["kept_modules"]), ("optimizers", config["kept_optimizers"])):
        for name in [n for n in kept[kind] if n not in names]:
            del kept[kind][name]
    valid = set(config["target_refs"])
    kept["targets"] = {} if config["targets_reset"] else {r: t for r, t in kept["targets"].items() if r in valid}
    kept["targets"].update(config["targets"])
    missing = [n for n in config["kept_modules"] if n not in kept["modules"]] + \
        [n for n in config["kept_optimizers"] if n not in kept["optimizers"]]
    if missing:
        raise RuntimeError(f"this worker no longer holds the sharded {', '.join(missing)} the kernel expected; "
                           "run the cell again (the kernel will ship the model)")
    stand_ins: dict = {}
    for name in config["kept_modules"]:
        module = kept["modules"][name]
        stand_ins[("module", name)] = module
        for fqn, t in _named_tensors(module):
            stand_ins[("tensor", name, fqn)] = t
    for name in config["kept_optimizers"]:
        stand_ins[("optimizer", name)] = kept["optimizers"][name]
    return stand_ins


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


def shard_modules(ctx, ns: dict, meta: dict, device) -> dict:
    """Shard the cell's modules (those not kept from the last cell) and adopt its optimizers;
    returns ``{name: sharded module}``, the cell's names bound to them."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    config = meta["fsdp"]
    kept = _kept(ctx)
    mesh = _mesh(ctx, device)
    dtype = config.get("param_dtype")
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32) if dtype \
        else MixedPrecisionPolicy()
    inner, param_map = {}, {}
    for name in meta["modules"]:
        module = ns[name]
        if name in config["kept_modules"]:
            # what the notebook set on its copy since the last cell (model.train(), a frozen layer)
            apply_settings(module, config.get("settings", {}).get(name) or {"modules": {}, "requires_grad": {}})
            inner[name] = module
            continue
        on_meta = any(t.is_meta for _, t in _named_tensors(module))
        fqn_of = {id(p): fqn for fqn, p in module.named_parameters(remove_duplicate=False)}
        if not on_meta:
            _private_buffers(module)
        uninitialised = _shard(module, config["blocks"].get(name, []), mesh, policy, device, on_meta)
        if uninitialised and ctx.rank == 0:
            ctx.send({"kind": "warning", "text": (
                f"{name} was on the meta device and these classes have no reset_parameters() to initialise "
                f"their parameters or buffers on the ranks, so they start at zero: {', '.join(uninitialised)}. "
                "Give them one (computing the buffers too), or initialise them in the cell")})
        now = dict(module.named_parameters(remove_duplicate=False))
        param_map.update({pid: now[fqn] for pid, fqn in fqn_of.items()})
        kept["modules"][name] = module
        inner[name] = module
    for name in meta["optimizers"]:
        opt = ns[name]
        if name in config["kept_optimizers"]:
            continue
        _adopt_optimizer(opt, param_map, mesh, device)
        kept["optimizers"][name] = opt
    return inner


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


def gather_into_notebook(ctx, meta: dict, inner: dict, opts: dict, prefix=None) -> tuple[dict | None, Any]:
    """Every rank: all-gather the trained tensors one at a time; rank 0 writes each into the notebook's
    tensor in place, or into its outgoing buffer after ``prefix`` (rank 0's other packed bytes).
    Returns rank 0's ``(state, buffer)`` (None elsewhere): per tensor, where it went (a buffer offset,
    -1 for in place) and its fingerprint key."""
    import torch
    from torch.distributed.tensor import DTensor

    from ..procs.tensor_cache import fingerprint_keys
    config = meta["fsdp"]
    targets = _kept(ctx)["targets"]
    items: list[tuple] = []   # (ref, tensor on the rank, the notebook's tensor or None)
    for name, module in inner.items():
        if name in config["stay"]:
            continue
        for fqn, t in module.state_dict().items():
            ref: tuple = ("module", name, fqn)
            items.append((ref, t, targets.get(ref)))
    groups: dict = {}
    deferred: list = []
    for name, opt in opts.items():
        keep = name in config["keep_optimizers"]    # only the hyperparameters come back
        flat = [p for g in opt.param_groups for p in g["params"]]
        plain: dict = {}
        for idx, p in enumerate(flat):
            for k, v in sorted(opt.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    ref = ("optimizer", name, idx, k)
                    if keep:
                        continue
                    if targets.get(ref) is None and v.dim() > 0:
                        # a fresh optimizer's state: the kernel makes its tensors, then gather_deferred
                        deferred.append((ref, str(v.dtype).removeprefix("torch."), tuple(v.shape)))
                    else:
                        items.append((ref, v, targets.get(ref)))
                else:
                    plain.setdefault(idx, {})[k] = v
        groups[name] = {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                        "plain": plain}
    rank0 = ctx.rank == 0
    in_place = [rank0 and dest is not None and tuple(dest.shape) == tuple(t.shape) and dest.dtype == t.dtype
                and dest.device.type == "cpu" for _, t, dest in items]
    start = -(-(prefix.numel() if prefix is not None else 0) // 64) * 64
    offsets, total = [], start
    for (_, t, _), here in zip(items, in_place):
        offsets.append(-1 if here else total)
        if not here:
            total += -(-t.numel() * t.element_size() // 64) * 64
    buffer = ctx.outgoing.get(total) if rank0 and total else None
    if buffer is not None and prefix is not None:
        buffer[: prefix.numel()].copy_(prefix)
    where = []
    announced = False
    with torch.no_grad():
        for (ref, t, dest), offset in zip(items, offsets):
            full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            if not rank0:
                continue
            if offset < 0:
                if not announced:
                    # every rank got this far (the gather is collective): from here on an interrupt
                    # leaves the notebook's model part-written, and the kernel says so
                    ctx.send({"kind": "writing"})
                    announced = True
                dest.copy_(full)
            else:
                assert buffer is not None
                nbytes = full.numel() * full.element_size()
                buffer[offset: offset + nbytes].copy_(full.contiguous().reshape(-1).view(torch.uint8))
            # Its fingerprint, taken while it is whole on the rank's device: the kernel's next cell
            # compares the notebook's tensors with these to know whether the ranks' shards are current.
            where.append((ref, offset, str(full.dtype).removeprefix("torch."), tuple(full.shape),
                          fingerprint_keys([full])[0]))
    _let_go_of_optimizer_targets(targets)
    if not rank0:
        return None, None
    return {"tensors": where, "optimizers": groups, "deferred": deferred}, \
        (buffer[:total] if buffer is not None else prefix)


def _let_go_of_optimizer_targets(targets: dict) -> None:
    """The kernel copies the optimizers' state out of shared memory once it is written (fsdp.py): the
    tensors the ranks hold are no longer the notebook's, and holding them would keep the memory."""
    for ref in [r for r in targets if r[0] == "optimizer"]:
        del targets[ref]


GATHER_DEFERRED = "gpumagic.dataparallel.sharding:gather_deferred"


def gather_deferred(ctx, meta: dict, data) -> dict | None:
    """A task after the cell's: the optimizer state the notebook had no tensors for, gathered into the
    ones the kernel has just made (``meta["targets"]``, shared memory) in place. Every rank gathers;
    returns rank 0's ``{"tensors": [(ref, -1, dtype, shape, key), ...]}``."""
    import torch
    from torch.distributed.tensor import DTensor

    from ..procs.tensor_cache import fingerprint_keys
    kept = _kept(ctx)
    where = []
    with torch.no_grad():
        for ref in meta["order"]:
            _, name, idx, k = ref
            opt = kept["optimizers"][name]
            param = [p for g in opt.param_groups for p in g["params"]][idx]
            t = opt.state[param][k]
            full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            if ctx.rank == 0:
                meta["targets"][ref].copy_(full)
                where.append((ref, -1, str(full.dtype).removeprefix("torch."), tuple(full.shape),
                              fingerprint_keys([full])[0]))
    return {"tensors": where} if ctx.rank == 0 else None
