"""The user's code of a ``%%dataparallel`` cell, run on a rank (:func:`execute`), counted as it trains.

The cell runs compiled under the notebook's cell name (tracebacks say ``Cell In[n], line k``), its last
expression's value kept; on a GPU rank its CUDA spellings mean the rank's GPU (:mod:`.devices`). While it
runs, classes it defines pickle as ``__main__``'s (``torch.save(model)`` works), an out-of-memory error
carries the rank's report (:mod:`gpumagic.memory.oom`), and the rank counts optimizer steps and backward
passes, telling the kernel at most once a second (:class:`~gpumagic.dataparallel.protocol.Progress`): no
step ever waits for that.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import time

from ...cell.compile import register_source
from ...cell.main_module import main_is_cell
from ...cell.trees import copy_tree, room_for
from ...memory.oom import reporting_out_of_memory
from ..protocol import Progress, RankStats, Started
from .cell import RankCell
from .devices import RankDevice

__all__ = ["execute", "PROGRESS_EVERY"]

PROGRESS_EVERY = 1.0   # seconds between a rank's progress messages


def _compiled(cell: RankCell):
    """The cell's body and last expression, compiled under its cell name."""
    code = cell.order.code
    register_source(code.filename, code.source)
    tree = code.tree
    with room_for(tree):   # (a deep cell, which the kernel took: rewritten and compiled here too)
        if cell.device.type == "cuda":
            tree = ast.fix_missing_locations(RankDevice(cell.device.index).visit(copy_tree(tree)))
        body_nodes = list(tree.body)
        last_expr = None
        if body_nodes and isinstance(body_nodes[-1], ast.Expr):
            last_expr = compile(ast.Expression(body_nodes.pop().value), code.filename, "eval")
        return compile(ast.Module(body_nodes, type_ignores=[]), code.filename, "exec"), last_expr


def execute(cell: RankCell) -> None:
    """Run the cell on this rank: :attr:`~.cell.RankCell.value`, ``started`` and ``ended`` are set."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    body, last_expr = _compiled(cell)
    stats = cell.stats
    t_start = time.monotonic()
    last_sent = [t_start]

    def on_step(optimizer, args, kwargs):
        stats.steps += 1
        now = time.monotonic()
        if stats.steps == 1:
            stats.first_step = now - t_start
        if now - last_sent[0] >= PROGRESS_EVERY:
            last_sent[0] = now
            stats.seconds = now - t_start
            cell.send(Progress(dataclasses.replace(stats)))

    handle = register_optimizer_step_post_hook(on_step)
    cell.send(Started(t_start))
    cell.started = t_start
    try:
        with main_is_cell(cell.ns), _counting_backwards(stats), \
                reporting_out_of_memory(cell.ns, cell.rank, cell.world_size):   # (classes pickle as __main__.X)
            exec(body, cell.ns)
            cell.value = eval(last_expr, cell.ns) if last_expr is not None else None
        if cell.device.type == "cuda":
            torch.cuda.synchronize(cell.device)
    finally:
        handle.remove()
    cell.ended = time.monotonic()
    stats.seconds = cell.ended - t_start


@contextlib.contextmanager
def _counting_backwards(stats: RankStats):
    """``stats.backwards`` counts the cell's backward passes (``loss.backward()`` goes through
    ``torch.autograd.backward``): a split pass that steps no optimizer but runs backward accumulates
    gradients for a later cell, which is training, not an evaluation that forgot ``no_grad()``."""
    import torch.autograd
    original = torch.autograd.backward

    def backward(*args, **kwargs):
        stats.backwards += 1
        return original(*args, **kwargs)
    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original
