"""``%%dataparallel --strategy fsdp``: the kernel's side.

A model too big for one GPU's training state trains sharded over the ranks
(:mod:`.sharding` is the ranks' side). The kernel never holds a second copy of it:

* the notebook's CPU model (and its optimizer's state) is moved into shared
  memory in place, once (:func:`~gpumagic.procs.bulk.share_in_place`: the same
  tensor objects, in a ``memfd``), and travels by reference; each rank copies it
  to its device a block at a time, keeping its shard. A model on the ``meta``
  device travels as its structure; the ranks initialise it;
* after the cell rank 0 gathers one tensor at a time and writes it into the
  notebook's tensor in place; a fresh optimizer's state gets its tensors made
  here first (:func:`gather_deferred_state`); only a model on a GPU comes
  through the pool's buffer. The optimizer's state is then copied out of shared
  memory (the model stays there), so that it is the notebook's own, as after a
  plain cell: a later ``%%sharedtrain`` cell gives each worker its own copy;
* the ranks keep their shards: the next cell sends a token for each kept
  module and optimizer instead of its tensors when the notebook's are unchanged
  (same objects, same content by fingerprint, same hyperparameters).

A model on the ``meta`` device stays there: its trained weights stay sharded in
the workers (save them from a cell with ``torch.distributed.checkpoint``), and
``--keep-optimizer`` leaves the optimizer's state there too.

In a notebook::

    %%dataparallel --strategy fsdp --wrap GPT2Block
    for batch in loader:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..cell.module_settings import apply_settings, module_settings
from ..display import note
from ..errors import usage_error
from .blocks import autocast_dtype, choose_blocks

logger = logging.getLogger(__name__)

__all__ = ["FsdpShipment", "choose_all_blocks", "prepare_shipment", "gather_deferred_state", "load_gathered",
           "on_meta", "private_again"]


@dataclass
class FsdpShipment:
    """How a cell's models travel to the ranks under ``--strategy fsdp``."""
    config: dict                                          # meta["fsdp"], read by the ranks
    shared: set = field(default_factory=set)              # ids of tensors that travel by reference
    stand_ins: dict = field(default_factory=dict)         # id(obj) -> token of what the ranks kept
    moved: set = field(default_factory=set)               # ids of the tensors this cell moved into shared memory

    def share(self, t) -> bool:
        return id(t) in self.shared


@dataclass
class _Record:
    """What the ranks hold of a notebook module or optimizer, and what the notebook held then."""
    ref: weakref.ref
    keys: dict | None               # fingerprints of the notebook's tensors; None: a meta model (nothing to compare)
    groups: list | None = None      # an optimizer's hyperparameters
    blocks: list | None = None      # a module's FSDP unit classes


def _records(pool) -> dict:
    """Per pool (a new pool holds nothing): ``{"modules": {...}, "optimizers": {...}, "sent": {...}}``,
    ``sent`` being the notebook tensors the ranks hold as write targets (weak references)."""
    records = getattr(pool, "fsdp_records", None)
    if records is None:
        records = pool.fsdp_records = {"modules": {}, "optimizers": {}, "sent": None}
    return records


def on_meta(module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _module_keys(module) -> dict:
    from ..procs.tensor_cache import fingerprint_keys
    sd = module.state_dict(keep_vars=True)
    return dict(zip(sd, fingerprint_keys([t.detach() for t in sd.values()]))) if sd else {}


def _optimizer_keys(opt) -> dict:
    import torch

    from ..procs.tensor_cache import fingerprint_keys
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


def choose_all_blocks(modules: dict, wrap: list[str] | None) -> dict:
    """Each module's unit classes (``UsageError`` before anything starts: see :func:`.blocks.choose_blocks`).
    With several models, each takes the ``--wrap`` classes it has."""
    blocks = {}
    for name, module in modules.items():
        # torch's fully_shard refuses them on every rank; said here, before any process starts
        scalars = [f"{name}.{n}" for n, p in module.named_parameters() if p.dim() == 0]
        if scalars:
            raise usage_error(f"--strategy fsdp: FSDP2 (fully_shard) cannot shard 0-d parameters, and {name} has "
                              f"{', '.join(scalars[:4])}{' and more' if len(scalars) > 4 else ''}: make them 1-D "
                              "(nn.Parameter(torch.tensor([1.0])) instead of torch.tensor(1.0)), or train with "
                              "--strategy ddp", ["--strategy ddp"])
        present = {type(m).__name__ for m in module.modules()}
        asked = [w for w in wrap if w in present] if wrap else None
        blocks[name] = choose_blocks(module, asked or wrap, name)
    return blocks


def prepare_shipment(tree, modules: dict, optimizers: dict, pool, blocks: dict,
                     keep_optimizer: bool, namespace: dict | None = None) -> FsdpShipment:
    """Decide what the ranks kept, and put the rest in shared memory; returns the :class:`FsdpShipment`."""
    records = _records(pool)
    kept_modules = []
    for name, module in modules.items():
        record = records["modules"].get(name)
        if not _unchanged(record, module, _module_keys):
            continue
        if record.blocks == blocks[name]:
            kept_modules.append(name)
        elif record.keys is None:   # a meta model's only weights are the ranks': keep them as sharded
            note(f"--strategy fsdp: {name} stays sharded by {', '.join(record.blocks or []) or 'the whole model'} "
                 "in the workers (it is on the meta device: sharding it anew would start it afresh)")
            blocks[name] = record.blocks or []
            kept_modules.append(name)
    kept_ids = {id(p) for n in kept_modules for p in modules[n].parameters()}
    kept_optimizers = [
        n for n, o in optimizers.items()
        if all(id(p) in kept_ids for g in o.param_groups for p in g["params"])
        and _unchanged(records["optimizers"].get(n), o, _optimizer_keys)]
    stay = [n for n, m in modules.items() if on_meta(m)]
    stay_ids = {id(p) for n in stay for p in modules[n].parameters()}
    shipment = FsdpShipment(config={
        "blocks": blocks, "kept_modules": kept_modules, "kept_optimizers": kept_optimizers,
        "stay": stay,
        # an optimizer of a meta model keeps its state in the workers, as the model does its weights
        "keep_optimizers": [n for n, o in optimizers.items() if keep_optimizer or any(
            id(p) in stay_ids for g in o.param_groups for p in g["params"])],
        "param_dtype": autocast_dtype(tree, namespace)})
    try:
        _fill(shipment, records, modules, optimizers, kept_optimizers)
    except BaseException:   # (an interrupt while it moves state into shared memory: none of it stays there)
        private_again(optimizers, shipment)
        raise
    for name, module in modules.items():
        on_gpu = sorted({str(t.device) for t in module.parameters() if t.device.type == "cuda"})
        if on_gpu and name not in kept_modules:
            note(f"--strategy fsdp: {name} is on {', '.join(on_gpu)} in the kernel, which takes that GPU's memory "
                 f"from the rank training there, and its weights come back through a copy; keep it on the CPU "
                 f"({name}.cpu()) or build it on the meta device")
    for name in modules:
        what = ", ".join(blocks[name]) or "none (the whole model is one unit)"
        if name not in kept_modules:
            note(f"--strategy fsdp: {name} sharded over the ranks; blocks: {what}")
    if shipment.config["param_dtype"]:
        note(f"--strategy fsdp: the cell runs under autocast({shipment.config['param_dtype']}): parameters are "
             f"gathered in {shipment.config['param_dtype']}, gradients reduced in float32")
    return shipment


def _fill(shipment: FsdpShipment, records: dict, modules: dict, optimizers: dict, kept_optimizers: list) -> None:
    """What travels by reference (moved into shared memory), what the ranks kept (stand-ins), and the
    targets rank 0 writes into."""
    import torch
    kept_modules = shipment.config["kept_modules"]
    shipment.config.update(_new_targets(records, modules, optimizers, shipment.moved))
    # A kept module is the ranks' own object: what the notebook set on its copy since (model.train(),
    # model.temperature = 0.5, a frozen layer) reaches it this way, as it would in a plain cell.
    shipment.config["settings"] = {name: module_settings(modules[name]) for name in kept_modules}
    for name, module in modules.items():
        if name in kept_modules:
            shipment.stand_ins[id(module)] = ("module", name)
            for fqn, t in [*module.named_parameters(remove_duplicate=False),
                           *module.named_buffers(remove_duplicate=False)]:
                shipment.stand_ins[id(t)] = ("tensor", name, fqn)
        else:
            shipment.shared |= _share(list(module.parameters()) + list(module.buffers()))
    for name, opt in optimizers.items():
        if name in kept_optimizers:
            shipment.stand_ins[id(opt)] = ("optimizer", name)
        else:
            shipment.shared |= _share([v for st in opt.state.values() for v in st.values()
                                       if isinstance(v, torch.Tensor) and v.dim() > 0], shipment.moved)


def _new_targets(records: dict, modules: dict, optimizers: dict, moved: set) -> dict:
    """The notebook's CPU tensors rank 0 writes the trained state into (moved into shared memory),
    those the ranks do not hold yet: ``{"targets": {ref: tensor}, "targets_reset": bool}``."""
    import torch
    targets: dict[tuple, Any] = {}
    for name, module in modules.items():
        for fqn, t in module.state_dict(keep_vars=True).items():
            targets[("module", name, fqn)] = t
    for name, opt in optimizers.items():
        for idx, p in enumerate(p for g in opt.param_groups for p in g["params"]):
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    targets[("optimizer", name, idx, k)] = v
    targets = {ref: t for ref, t in targets.items() if t.device.type == "cpu" and not t.is_meta}
    _share(targets.values(), moved)
    reset = records["sent"] is None
    sent = records["sent"] = {} if reset else records["sent"]
    new = {ref: t for ref, t in targets.items() if (sent.get(ref) or _gone)() is not t}
    sent.update({ref: weakref.ref(t) for ref, t in new.items()})
    for ref in [r for r in sent if r not in targets]:
        del sent[ref]
    # every valid reference: the ranks drop targets the notebook no longer has (another model, a new
    # optimizer's state), which rank 0 must not write into
    return {"targets": new, "targets_reset": reset, "target_refs": list(targets)}


def _gone():
    return None


def _unchanged(record: _Record | None, obj, keys_of) -> bool:
    if record is None or record.ref() is not obj:
        return False
    if record.groups is not None and not _same(record.groups, _hyperparameters(obj)):
        return False
    return record.keys is None or keys_of(obj) == record.keys


def _share(tensors, moved: set | None = None) -> set:
    """CPU tensors moved into shared memory in place (the same objects; once: a shared one stays);
    returns their ids, and adds to ``moved`` those of the ones not shared before."""
    from ..procs.bulk import share_in_place
    cpu = [t for t in tensors if t.device.type == "cpu" and not t.is_meta]
    if moved is not None:
        moved |= {id(t) for t in cpu if not t.is_shared()}
    share_in_place(cpu)
    return {id(t) for t in cpu}


def gather_deferred_state(state: dict, pool) -> dict:
    """The optimizer state the notebook had no tensors for (a fresh optimizer's first moments): made
    here in shared memory, zeroed, and filled in place by the ranks in a second task, so that no
    process holds it twice. Returns ``{ref: tensor}``; ``state["tensors"]`` gets their entries."""
    import torch

    from ..procs.bulk import share_in_place
    from .sharding import GATHER_DEFERRED
    deferred = state.get("deferred") or []
    if not deferred:
        return {}
    made = {tuple(ref): torch.zeros(shape, dtype=getattr(torch, dtype)) for ref, dtype, shape in deferred}
    share_in_place(list(made.values()))
    order = list(made)
    results = pool.run(GATHER_DEFERRED, {"targets": made, "order": order})
    state["tensors"] = list(state["tensors"]) + list(results[0][0]["tensors"])
    return made


def load_gathered(state: dict, buffer, modules: dict, optimizers: dict, pool, shipment: FsdpShipment,
                  made: dict | None = None, settings: dict | None = None) -> list[str]:
    """Rank 0's gathered state into the notebook: what it wrote in place is there already (``made``:
    the optimizer tensors :func:`gather_deferred_state` made for it); the rest is copied from
    ``buffer``; ``settings`` (rank 0's :func:`~gpumagic.cell.module_settings.module_settings`: eval(),
    attributes, requires_grad) are set on the modules, a meta model's too. Records what the ranks now
    hold. Returns the names whose trained state stays in the workers."""
    import torch
    config = shipment.config
    made = made or {}
    by_module: dict = {}
    by_optimizer: dict = {}
    for ref, offset, dtype, shape, key in state["tensors"]:
        ref = tuple(ref)
        view = None
        if offset >= 0:
            raw = buffer[offset: offset + _nbytes(dtype, shape)]
            view = raw.view(getattr(torch, dtype)).view(shape)
        if ref[0] == "module":
            by_module.setdefault(ref[1], {})[ref[2]] = (view, key)
        else:
            by_optimizer.setdefault(ref[1], {})[(ref[2], ref[3])] = (view, key)
    records = _records(pool)
    stayed = []
    settings = settings or {}
    with torch.no_grad():
        for name, module in modules.items():
            if name in settings:
                apply_settings(module, settings[name])
            if name in config["stay"]:
                records["modules"][name] = _Record(weakref.ref(module), None, blocks=config["blocks"][name])
                stayed.append(name)
                continue
            got = by_module.get(name, {})
            mine = module.state_dict(keep_vars=True)
            for fqn, (view, _) in got.items():
                if view is not None:
                    mine[fqn].data.copy_(view)
            records["modules"][name] = _Record(weakref.ref(module), {fqn: key for fqn, (_, key) in got.items()},
                                               blocks=config["blocks"][name])
    for name, opt in optimizers.items():
        groups = state["optimizers"][name]
        if name in config["keep_optimizers"]:
            for mine, theirs in zip(opt.param_groups, groups["param_groups"]):
                mine.update(theirs)
            _private_state(opt, shipment.moved)
            records["optimizers"][name] = _Record(weakref.ref(opt), _optimizer_keys(opt), _hyperparameters(opt))
            stayed.append(name)
        else:
            _load_optimizer(opt, groups, by_optimizer.get(name, {}),
                            {r[2:]: t for r, t in made.items() if r[1] == name})
            _private_state(opt, shipment.moved | {id(t) for t in made.values()})
            records["optimizers"][name] = _Record(weakref.ref(opt), {
                r: key for r, (_, key) in by_optimizer.get(name, {}).items()}, _hyperparameters(opt))
        # The ranks let go of its state tensors (sharding.py): the next cell shares the notebook's anew.
        for ref in [r for r in records["sent"] or {} if r[0] == "optimizer" and r[1] == name]:
            del records["sent"][ref]
    return stayed


def private_again(optimizers: dict, shipment: FsdpShipment) -> None:
    """After a cell that failed or was interrupted: the optimizers' state the cell moved into shared
    memory is the notebook's own again (copies, holding what it held), as after a cell that succeeded.
    A later ``%%sharedtrain`` cell would otherwise take it as shared on purpose, every worker updating one
    Adam state. Run on every way out: after a success it finds nothing left to copy."""
    for opt in optimizers.values():
        _private_state(opt, shipment.moved)


def _private_state(opt, moved: set) -> None:
    """An optimizer's state in the notebook's own memory again, as after a plain cell: left in shared memory,
    a later ``%%sharedtrain`` cell would share it with its workers (it shares what is shared already) instead
    of giving each its own copy. The ranks wrote into the shared tensors; copies of them take the place
    of those the cell put there (``moved``, by id); state the notebook had shared itself stays shared."""
    for st in opt.state.values():
        for k, v in list(st.items()):
            if id(v) in moved:
                st[k] = v.clone()


def _load_optimizer(opt, groups: dict, tensors: dict, made: dict) -> None:
    """The trained state: tensors written in place are the notebook's own (or ``made`` for it, by
    ``(index, key)``), the others copied out of the buffer."""
    flat = [p for g in opt.param_groups for p in g["params"]]
    state: dict = {}
    for idx, values in groups["plain"].items():
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
    for mine, theirs in zip(opt.param_groups, groups["param_groups"]):
        n = len(mine["params"])
        param_groups.append({**theirs, "params": list(range(start, start + n))})
        start += n
    opt.load_state_dict({"state": state, "param_groups": param_groups})


def _nbytes(dtype: str, shape) -> int:
    import math

    import torch
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
