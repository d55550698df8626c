"""Which names a cell reads, and which notebook functions it reaches (gpumagic.cell.names)."""
from __future__ import annotations

import ast

from gpumagic.cell.names import free_reads, used_names


def test_used_names_follow_notebook_functions():
    ns = {"__name__": "__main__"}
    exec("def step():\n    return model(x)\nmodel = 1\nx = 2\n", ns)
    assert used_names(ast.parse("step()"), ns) == ["step", "model", "x"]


def test_free_reads_skip_names_the_cell_binds_first():
    src = ("it = iter(loader)\n"
           "for i in range(n):\n"
           "    if i == 2:\n"
           "        t0 = clock()\n"
           "    x, y = next(it)\n"
           "    out = model(x)\n"
           "    seen.append(t0)\n"
           "total += 1\n")
    assert free_reads(ast.parse(src)) == ["iter", "loader", "range", "n", "clock", "next", "model", "seen",
                                          "t0", "total"]
