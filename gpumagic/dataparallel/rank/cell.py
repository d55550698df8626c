"""One ``%%dataparallel`` cell on one rank (:class:`RankCell`): the cell's namespace and what the rank keeps of it.

:func:`unpacked` takes the kernel's :class:`~gpumagic.dataparallel.protocol.CellOrder` apart: the kernel's
torch settings applied, the notebook's values unpacked on the rank's device (the notebook's loggers as
stand-ins that call back into the kernel), ``__main__``'s names and ``get_ipython`` set as a rank has them,
every rank seeded alike. The strategy then fills in what it trains (:attr:`RankCell.inner`, the modules
inside their wrappers) and what it answers for (:attr:`RankCell.trained`).

Runs in the workers: no IPython.
"""
from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Any

from ...cell.rewrite.workers import bind_placement
from ...procs import torch_settings
from ...procs.compile_settings import apply_compile_settings
from ...procs.relays import rank_relays
from ...procs.seeding import seed_all
from ...procs.tensor_cache import TensorStore
from ...procs.wire import unpack_namespace
from ..protocol import GRADS_KEY, CellOrder, RankStats, Trained

__all__ = ["RankCell", "unpacked"]


@dataclass
class RankCell:
    """A cell on this rank, from the kernel's order to rank 0's answer."""
    ctx: Any                        # the worker's context (procs.worker.WorkerContext, or an engine's)
    order: CellOrder
    ns: dict                        # the cell's namespace: the notebook's values, as this rank has them
    tensors: list                   # the tensors it unpacked
    grads: dict                     # the notebook's gradients, {module: {parameter: grad}}
    store: TensorStore              # the tensors the rank keeps between cells
    stats: RankStats = field(default_factory=RankStats)
    inner: dict = field(default_factory=dict)       # name -> the user's module (inside any wrapper)
    opts: dict = field(default_factory=dict)        # name -> the rank's optimizer
    swaps: dict = field(default_factory=dict)       # id(original) -> (original, the rank's stand-in)
    known: dict = field(default_factory=dict)       # id -> (ref, object): what the strategy names itself
    trained: Trained = field(default_factory=Trained)
    answered: set = field(default_factory=set)      # names the strategy brings back itself
    not_returned: list = field(default_factory=list)   # its entries for the note
    keys: frozenset = frozenset()                   # fingerprints of the tensors kept for the next cell
    scratch: dict = field(default_factory=dict)     # what the strategy remembers from start to finish
    value: Any = None                               # the cell's last expression
    started: float = 0.0
    ended: float = 0.0

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def rank0(self) -> bool:
        return self.ctx.rank == 0

    @property
    def device(self):
        return self.ctx.torch_device

    def send(self, message) -> None:
        """A message for the kernel (:mod:`gpumagic.dataparallel.protocol`), shown as the cell runs."""
        self.ctx.send(message)


def _no_ipython():
    """``get_ipython()`` in a rank: None, as in any process that is not IPython (the kernel refuses magics and
    !commands in the cell before it starts)."""
    return None


def unpacked(ctx, order: CellOrder, data, store: TensorStore) -> RankCell:
    """The cell's namespace on this rank (see the module's docstring)."""
    device = ctx.torch_device
    torch_settings.apply(order.settings.torch, device=device)
    apply_compile_settings(order.settings.compile)
    stand_ins = rank_relays(order.relays, ctx.send, active=ctx.rank == 0)   # the notebook's loggers
    stand_ins.update(order.strategy.stand_ins(ctx))
    ns, tensors = unpack_namespace(order.values, data, device=device, store=store, shared=order.shared,
                                   stand_ins=stand_ins)
    grads = ns.pop(GRADS_KEY)   # the notebook's gradients, which a plain cell would add to
    ns["__name__"] = "__main__"
    ns["__builtins__"] = builtins
    ns["get_ipython"] = _no_ipython
    for name in order.roles.device_strings:
        ns[name] = str(device) if device.type == "cuda" else "cpu"
    bind_placement(ns, order.code.placement, device)
    seed_all(order.seed)
    return RankCell(ctx, order, ns, tensors, grads, store)
