"""``%%dataparallel --strategy fsdp`` in the kernel (:class:`Fsdp`): a model too big for one GPU's training state
trains sharded over the ranks (:mod:`.fsdp_rank` is the ranks' side). It owns ``--wrap`` and
``--keep-optimizer``. The kernel never holds a second copy of the model:

* the notebook's CPU model (and its optimizer's state) is moved into shared memory in place, once
  (:func:`~gpumagic.procs.bulk.share_in_place`: the same tensor objects, in a ``memfd``), and travels by
  reference; each rank copies it to its device a block at a time, keeping its shard. A model on the ``meta``
  device travels as its structure; the ranks initialise it;
* after the cell rank 0 gathers one tensor at a time and writes it into the notebook's tensor in place
  (:mod:`.fsdp_back`);
* the ranks keep their shards: the next cell sends a token for each kept module and optimizer instead of its
  tensors when the notebook's are unchanged (same objects, same content by fingerprint, same
  hyperparameters). What the kernel counts on them holding is the ranks' :class:`~..ranks.kept.Sharded`.

A model on the ``meta`` device stays there: its trained weights stay sharded in the workers (save them from
a cell with ``torch.distributed.checkpoint``), and ``--keep-optimizer`` leaves the optimizer's state there too.

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

from ...cell.module_settings import module_settings
from ...display import note
from ...errors import usage_error
from ..kernel import held
from ..ranks.kept import Sharded
from .base import Prepared
from .ddp_grads import not_carried
from .fsdp_back import load_gathered, module_keys, optimizer_keys, private_again, share, unchanged
from .fsdp_blocks import autocast_dtype, choose_blocks
from .fsdp_rank import FsdpRank
from .process import ProcessStrategy
from .trained import Loaded, cloned, load_trained, tensor_targets

logger = logging.getLogger(__name__)

__all__ = ["Fsdp", "Shipment", "choose_all_blocks", "on_meta"]


def on_meta(module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def choose_all_blocks(modules: dict, wrap: list[str] | None) -> dict:
    """Each module's unit classes (``UsageError`` before anything starts: see :func:`.fsdp_blocks.choose_blocks`).
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


@dataclass
class Shipment:
    """How a cell's models travel to the ranks under ``--strategy fsdp``."""
    order: FsdpRank                                       # what the ranks are told
    shared: set = field(default_factory=set)              # ids of tensors that travel by reference
    stand_ins: dict = field(default_factory=dict)         # id(obj) -> token of what the ranks kept
    moved: set = field(default_factory=set)               # ids of the tensors this cell moved into shared memory

    def share(self, t) -> bool:
        return id(t) in self.shared


def _kept_modules(sharded: Sharded, modules: dict, blocks: dict) -> list[str]:
    """The modules whose shards the ranks hold, unchanged in the notebook since (``blocks`` takes a meta model's
    units as the ranks hold them)."""
    kept = []
    for name, module in modules.items():
        record = sharded.modules.get(name)
        if not unchanged(record, module, module_keys):
            continue
        assert record is not None
        if record.blocks == blocks[name]:
            kept.append(name)
        elif record.keys is None:   # a meta model's only weights are the ranks': keep them as sharded
            note(f"--strategy fsdp: {name} stays sharded by {', '.join(record.blocks or []) or 'the whole model'} "
                 "in the workers (it is on the meta device: sharding it anew would start it afresh)")
            blocks[name] = record.blocks or []
            kept.append(name)
    return kept


def _new_targets(sharded: Sharded, modules: dict, optimizers: dict, moved: set) -> tuple[dict, bool, tuple]:
    """The notebook's CPU tensors rank 0 writes the trained state into (moved into shared memory), those the ranks
    do not hold yet; whether the ranks hold none from before; every valid ref (the ranks drop targets the
    notebook no longer has, another model or a new optimizer's state, which rank 0 must not write into)."""
    import torch
    targets: dict = {}
    for name, module in modules.items():
        for fqn, t in module.state_dict(keep_vars=True).items():
            targets[("module", name, fqn)] = t
    for name, opt in optimizers.items():
        for idx, p in enumerate(p for g in opt.param_groups for p in g["params"]):
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    targets[("optimizer", name, idx, k)] = v
    targets = {ref: t for ref, t in targets.items() if t.device.type == "cpu" and not t.is_meta}
    share(targets.values(), moved)
    reset = sharded.sent is None
    sent: dict = {} if sharded.sent is None else sharded.sent
    sharded.sent = sent
    new = {ref: t for ref, t in targets.items() if (sent[ref]() if ref in sent else None) is not t}
    sent.update({ref: weakref.ref(t) for ref, t in new.items()})
    for ref in [r for r in sent if r not in targets]:
        del sent[ref]
    return new, reset, tuple(targets)


@dataclass
class Fsdp(ProcessStrategy):
    """FSDP2 over the ranks, with its units (``--wrap``) and where the optimizer's state stays."""
    wrap: list[str] | None = None
    keep_optimizer: bool = False
    shipment: Shipment | None = None      # this cell's, once prepared

    name = "fsdp"
    OPTIONS = ("wrap", "keep_optimizer")
    tag = ", fsdp"
    holds_state = True

    @classmethod
    def from_options(cls, *, wrap: str | None = None, keep_optimizer: bool = False) -> Fsdp:
        if wrap is not None and not [w for w in wrap.split(",") if w.strip()]:
            raise usage_error("--wrap is empty: name the model's block classes, comma-separated",
                              ["--wrap TransformerEncoderLayer", "drop --wrap (the repeated blocks are found)"])
        return cls([w.strip() for w in wrap.split(",") if w.strip()] if wrap else None, bool(keep_optimizer))

    @classmethod
    def refuse(cls, flags: list[str]) -> None:
        why = "--launch runs the cell's own distribution, not gpumagic's FSDP" if "--launch" in flags \
            else "they configure the DDP wrapper, which --strategy fsdp does not use"
        raise usage_error(f"{', '.join(flags)} with --strategy fsdp: {why}",
                          ["--strategy fsdp --wrap CLASS", "--strategy fsdp --keep-optimizer", "--strategy ddp"])

    def for_launch(self, why: str, devices=(), on_cluster: bool = False):
        if why == "--launch":
            self.refuse(["--launch"])
        raise usage_error(f"--strategy fsdp shards a hand-written loop's model, but {why}, which distributes by "
                          "itself (launch mode): ask it for FSDP (TrainingArguments(fsdp=...), accelerate's FSDP "
                          "plugin, Lightning's FSDPStrategy) and drop --strategy fsdp",
                          ["%%dataparallel", "%%dataparallel --launch"])

    def check_cell(self, read) -> None:
        read.blocks = choose_all_blocks(read.survey.modules, self.wrap)

    def before(self, read, ranks) -> Prepared:
        """Decide what the ranks kept, and put the rest in shared memory: the models travel by reference (their
        tensors to the CPU, each rank shards them from there), what the ranks kept by its token."""
        order = self._shipped(read, ranks)
        assert self.shipment is not None
        grads = not_carried(read.survey.modules, "--strategy fsdp shards them")
        return Prepared(order, tensor_targets(read, "cpu"), grads, self.shipment.share, self.shipment.stand_ins)

    def _shipped(self, read, ranks) -> FsdpRank:
        modules, optimizers = read.survey.modules, read.survey.optimizers
        sharded = ranks.kept.sharded = ranks.kept.sharded or Sharded()
        blocks = dict(read.blocks)
        kept_modules = _kept_modules(sharded, modules, blocks)
        kept_ids = {id(p) for n in kept_modules for p in modules[n].parameters()}
        kept_optimizers = [n for n, o in optimizers.items()
                           if all(id(p) in kept_ids for g in o.param_groups for p in g["params"])
                           and unchanged(sharded.optimizers.get(n), o, optimizer_keys)]
        stay = [n for n, m in modules.items() if on_meta(m)]
        stay_ids = {id(p) for n in stay for p in modules[n].parameters()}
        # an optimizer of a meta model keeps its state in the workers, as the model does its weights
        keep_optimizers = [n for n, o in optimizers.items() if self.keep_optimizer or any(
            id(p) in stay_ids for g in o.param_groups for p in g["params"])]
        shipment = self.shipment = Shipment(FsdpRank(blocks, tuple(kept_modules), tuple(kept_optimizers),
                                                     tuple(stay), tuple(keep_optimizers),
                                                     autocast_dtype(read.compiled.tree, read.ns)))
        try:
            self._fill(shipment, sharded, modules, optimizers)
        except BaseException:   # (an interrupt while it moves state into shared memory: none of it stays there)
            private_again(optimizers, shipment.moved)
            raise
        self._notes(shipment.order, modules)
        return shipment.order

    def _fill(self, shipment: Shipment, sharded: Sharded, modules: dict, optimizers: dict) -> None:
        """What travels by reference (moved into shared memory), what the ranks kept (stand-ins), and the targets
        rank 0 writes into."""
        import dataclasses

        import torch
        order = shipment.order
        targets, reset, refs = _new_targets(sharded, modules, optimizers, shipment.moved)
        # A kept module is the ranks' own object: what the notebook set on its copy since (model.train(),
        # model.temperature = 0.5, a frozen layer) reaches it this way, as it would in a plain cell.
        shipment.order = dataclasses.replace(order, targets=targets, targets_reset=reset, target_refs=refs,
                                             settings={n: module_settings(modules[n]) for n in order.kept_modules})
        for name, module in modules.items():
            if name in order.kept_modules:
                shipment.stand_ins[id(module)] = ("module", name)
                for fqn, t in [*module.named_parameters(remove_duplicate=False),
                               *module.named_buffers(remove_duplicate=False)]:
                    shipment.stand_ins[id(t)] = ("tensor", name, fqn)
            else:
                shipment.shared |= share(list(module.parameters()) + list(module.buffers()))
        for name, opt in optimizers.items():
            if name in order.kept_optimizers:
                shipment.stand_ins[id(opt)] = ("optimizer", name)
            else:
                shipment.shared |= share([v for st in opt.state.values() for v in st.values()
                                          if isinstance(v, torch.Tensor) and v.dim() > 0], shipment.moved)

    def _notes(self, order: FsdpRank, modules: dict) -> None:
        for name, module in modules.items():
            on_gpu = sorted({str(t.device) for t in module.parameters() if t.device.type == "cuda"})
            if on_gpu and name not in order.kept_modules:
                note(f"--strategy fsdp: {name} is on {', '.join(on_gpu)} in the kernel, which takes that GPU's "
                     f"memory from the rank training there, and its weights come back through a copy; keep it on the "
                     f"CPU ({name}.cpu()) or build it on the meta device")
        for name in modules:
            if name not in order.kept_modules:
                what = ", ".join(order.blocks[name]) or "none (the whole model is one unit)"
                note(f"--strategy fsdp: {name} sharded over the ranks; blocks: {what}")
        if order.param_dtype:
            note(f"--strategy fsdp: the cell runs under autocast({order.param_dtype}): parameters are gathered in "
                 f"{order.param_dtype}, gradients reduced in float32")

    def after(self, read, returned, done, buffer, ranks) -> Loaded:
        assert self.shipment is not None and done.gathered is not None
        modules, optimizers = read.survey.modules, read.survey.optimizers
        # schedulers and loaders' generators first: rank 0 wrote the weights already, nothing else yet
        load_trained(read.ns, returned.trained, {}, {}, read.survey.stateful)
        stayed = load_gathered(done.gathered, buffer, modules, optimizers, ranks, self.shipment,
                               cloned(returned.trained.settings))
        held.keep(ranks, stayed, [*modules, *optimizers], read.ns)
        return Loaded(list(optimizers), stayed)

    def failed(self, read, ranks, done=None) -> None:
        # however the cell ends, the optimizer's state is the notebook's own again
        if self.shipment is not None:
            private_again(read.survey.optimizers, self.shipment.moved)
        # rank 0 wrote into the notebook's tensors before the kernel began: those stay written
        written = sorted({t.ref[1] for t in (done.gathered.tensors if done and done.gathered else []) if t.offset < 0})
        if written:
            note(f"%%dataparallel --strategy fsdp: loading the cell's result failed after rank 0 had written the "
                 f"trained tensors of {', '.join(written)} into the notebook's in place: those hold their state "
                 "after the cell, the rest (other optimizer state, schedulers, values) as before it. Run the "
                 "training again, or load a checkpoint")

