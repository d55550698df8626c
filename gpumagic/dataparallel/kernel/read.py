"""A ``%%dataparallel`` cell read in the kernel before anything starts (:func:`read_cell`): compiled as IPython
compiles it, refused where it cannot run (magics and ``!commands`` inside it, a framework made in an earlier
cell), its strategy settled (a cell that distributes by itself runs in launch mode, and a one-line note says
why), what it trains and reads found (:mod:`.survey`), and, for ranks on the CPU, its ``.cuda()`` code
rewritten to run there (:mod:`gpumagic.cell.rewrite`).

In a notebook::

    read = read_cell(Notebook.of(get_ipython()), cell, plan, "%%dataparallel")
    read.strategy, read.survey.modules
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from ...cell.compile import CompiledCell, refuse_shell_calls
from ...cell.rewrite.workers import rewrite_for_cpu_workers
from ...cell.trees import room_for
from ...display import note
from ..strategies.base import Strategy
from .detect import distributes_itself
from .notebook import Notebook
from .survey import CellSurvey, read_names, survey_cell

__all__ = ["ReadCell", "read_cell"]


@dataclass
class ReadCell:
    """A cell read, ready to ship."""
    notebook: Notebook
    compiled: CompiledCell
    survey: CellSurvey
    strategy: Strategy
    ship_tree: ast.Module                   # the tree the ranks run (rewritten for CPU ranks)
    placement: Any = None                   # the .cuda() rewrite's helper, for CPU ranks
    blocks: dict = field(default_factory=dict)   # fsdp: each module's unit classes

    @property
    def ns(self) -> dict:
        return self.notebook.ns


def read_cell(notebook: Notebook, cell: str, plan, header: str) -> ReadCell:
    """The cell read against ``plan`` (see the module's docstring): ``UsageError`` where it cannot run."""
    compiled = notebook.compile(cell, header)
    with room_for(compiled.tree):   # (what reads the cell walks its tree recursively: a deep cell needs room)
        refuse_shell_calls(compiled.tree, "%%dataparallel")
        used = read_names(compiled.tree, notebook)
        strategy = plan.strategy
        why = distributes_itself(compiled.tree, notebook.ns, used)
        if why is not None:
            strategy = strategy.for_launch(why, plan.devices, plan.cluster is not None)
        survey = survey_cell(compiled.tree, notebook, plan.models, splits=strategy.splits, used=used,
                             filename=compiled.filename)
        if strategy is not plan.strategy:
            note(f"%%dataparallel: launch mode, because {why}: every rank runs the cell as a process torchrun "
                 "started, and the cell's own code wraps the model and splits the data")
        # On CPU ranks, a cell written for .cuda() runs on the CPU (the %%ondevice rewrite).
        ship_tree, placement = rewrite_for_cpu_workers(compiled.tree, notebook.ns) if plan.devices[0] == "cpu" \
            else (compiled.tree, None)
    return ReadCell(notebook, compiled, survey, strategy, ship_tree, placement)
