"""The task every rank runs for a ``%%dataparallel`` cell (:func:`run_rank`): the worker's side of the kernel's
:mod:`~gpumagic.dataparallel.kernel.train`.

The rank unpacks the cell (:func:`~.cell.unpacked`), its strategy starts it (wraps each trained module in
DDP under the cell's name, shards it, or leaves it to the cell's framework; splits the loaders), rank 0
takes a snapshot of what the cell may change (:mod:`..sync.snapshot`), the cell runs inside the strategy's
guards (:func:`~.execute.execute`), the strategy finishes it (the trained state collected, what is kept for
the next cell kept), rank 0 captures what the cell changed (:mod:`..sync.capture`), and the strategy sends
the rank's :class:`~gpumagic.dataparallel.protocol.RankDone`. Should anything fail, the rank drops what it
keeps: a failed cell may have half-updated it.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import dataclasses

from ...cell.trees import shipped
from ...procs import torch_settings
from ...procs.tensor_cache import TensorStore
from ..protocol import CellOrder, Returned
from ..strategies.ddp_warm import let_go_of_warm_models
from ..strategies.fsdp_rank import forget_kept
from ..sync.capture import capture
from ..sync.snapshot import take
from .cell import RankCell, unpacked
from .execute import execute

__all__ = ["TASK", "run_rank"]

TASK = "gpumagic.dataparallel.rank.task:run_rank"


def run_rank(ctx, order: CellOrder, data):
    """Run one cell on this rank; returns ``(RankDone, buffer)``."""
    store = ctx.state.setdefault("store", TensorStore())
    order = dataclasses.replace(order, code=dataclasses.replace(order.code, tree=shipped(order.code.tree)))
    try:
        return _run(ctx, order, data, store)
    except BaseException:
        # What the rank keeps may be half-updated by the failed cell: the tensors handed to it, a kept
        # compiled model's weights and DDP state, fsdp's shards. They go; the next cell ships anew.
        store.clear()
        forget_kept(ctx)
        let_go_of_warm_models(ctx, "the last cell failed, which let the compiled model go")
        raise


def _run(ctx, order: CellOrder, data, store: TensorStore):
    cell = unpacked(ctx, order, data, store)
    strategy = order.strategy
    strategy.start(cell)
    snap = take(cell.ns, order.watch, cell.known) if cell.rank0 else None
    with strategy.running(cell):
        execute(cell)
    strategy.finish(cell)
    return strategy.send(cell, _returned(cell, snap) if snap is not None else None)


def _returned(cell: RankCell, snap) -> Returned:
    """Rank 0's answer: the trained state the strategy collected, and what the cell changed in the notebook."""
    order = cell.order
    changes, value = capture(snap, cell.ns, order.watch, tree=order.code.tree, loop_targets=order.code.loop_targets,
                             answered=cell.answered, trained=order.roles.trained, value=cell.value)
    changes.not_returned[:0] = cell.not_returned
    # torch's settings the cell changed (torch.set_default_dtype...): the kernel takes them
    settings = torch_settings.changed(order.settings.torch, torch_settings.current())
    return Returned(cell.trained, changes, value, settings)
