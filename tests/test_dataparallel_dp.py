"""--strategy dp in the kernel (gpumagic.dataparallel.strategies.dp): model calls rewritten to split over devices."""
from __future__ import annotations

import ast

from gpumagic.dataparallel.strategies.dp import ModelCallRewriter


def test_model_calls_rewritten_for_dp():
    tree = ModelCallRewriter({"model"}).visit(ast.parse("y = model(x, k=1)\nz = other(x)\nm = model.fc(x)"))
    assert ast.unparse(tree) == "y = __gpumagic_dp__(model, x, k=1)\nz = other(x)\nm = model.fc(x)"
