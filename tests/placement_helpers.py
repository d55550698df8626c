"""Running rewritten cell code in the tests of %%ondevice's placement (no magic, and through the magic)."""
from __future__ import annotations

import ast
import re
import textwrap

import torch
import torch.nn as nn

from gpumagic.cell.rewrite.helper import HELPER, Placement, rewrite_placement
from tests.conftest import run_cell

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_rewritten(src: str, target="cpu", ns: dict | None = None) -> dict:
    """Rewrite and run ``src`` with the helper bound to ``Placement(target)``; returns the namespace."""
    ns = {"torch": torch, "nn": nn, **(ns or {})}
    tree, _ = rewrite_placement(ast.parse(textwrap.dedent(src)), ns)
    ns[HELPER] = Placement(target)
    exec(compile(tree, "<cell>", "exec"), ns)
    return ns


def cell_ok(shell, src):
    """Run ``src`` as a cell that must succeed; returns ``(result, output without colours)``."""
    result, out, _ = run_cell(shell, src)
    out = ANSI.sub("", out)
    assert result.error_before_exec is None and result.error_in_exec is None, out
    return result, out
