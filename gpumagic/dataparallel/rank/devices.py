"""On a GPU rank, the CUDA spellings of a cell mean the rank's own GPU (:class:`RankDevice`).

A cell written for one GPU says ``'cuda:0'``, ``.cuda(0)``, ``torch.device("cuda", 0)`` or ``device=0``:
on rank k those are ``cuda:k``. (``.cuda()`` and ``'cuda'`` are the current device already: the rank's.)

Runs in the workers: no IPython.
"""
from __future__ import annotations

import ast
import re

__all__ = ["CUDA_STRING", "RankDevice"]

CUDA_STRING = re.compile(r"^cuda(:\d+)?$")


class RankDevice(ast.NodeTransformer):
    """On GPU ranks: ``'cuda:0'``, ``.cuda(0)``, ``device=0`` in the cell mean this rank's GPU."""

    def __init__(self, index: int):
        self.index = index

    def visit_Constant(self, node):
        if isinstance(node.value, str) and CUDA_STRING.match(node.value) and ":" in node.value:
            return ast.copy_location(ast.Constant(f"cuda:{self.index}"), node)
        return node

    def visit_JoinedStr(self, node):
        return node  # f-strings are text, not devices

    def visit_Call(self, node):
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("cuda", "set_device") and node.args:
            node.args = [self._index(a) for a in node.args[:1]] + node.args[1:]
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "device" and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value == "cuda":
            node.args[1] = self._index(node.args[1])      # torch.device("cuda", 0)
        for kw in node.keywords:
            if kw.arg == "device":
                kw.value = self._index(kw.value)
        return node

    def _index(self, arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, int) and not isinstance(arg.value, bool):
            return ast.copy_location(ast.Constant(self.index), arg)
        return arg
