"""The notebook a ``%%dataparallel`` cell runs against (:class:`Notebook`): an IPython shell, or, from plain
Python, a namespace dict.

In a notebook::

    Notebook.of(get_ipython()).ns is get_ipython().user_ns     # True
"""
from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...cell.compile import CompiledCell, compile_cell, compile_plain

__all__ = ["Notebook"]


@dataclass
class Notebook:
    """The namespace a cell reads and changes, and the shell around it where there is one."""
    ns: dict
    shell: Any = None

    @classmethod
    def of(cls, target) -> Notebook:
        """``target`` (an IPython shell, or a namespace dict) as a notebook; ``TypeError`` for anything else."""
        if isinstance(target, dict):
            return cls(target)
        ns = getattr(target, "user_ns", None)
        if not isinstance(ns, dict):
            raise TypeError(f"%%dataparallel runs against an IPython shell or a namespace dict, not a "
                            f"{type(target).__name__}")
        return cls(ns, target)

    @property
    def hidden(self) -> dict:
        """The names IPython itself put in the namespace (``In``, ``Out``, ``exit``...)."""
        return getattr(self.shell, "user_ns_hidden", None) or {}

    @property
    def is_kernel(self) -> bool:
        """Whether the notebook is a Jupyter kernel's (rich output), rather than terminal IPython or Python."""
        return getattr(self.shell, "kernel", None) is not None

    def compile(self, cell: str, header: str, transformers: Iterable[ast.NodeTransformer] = ()) -> CompiledCell:
        """The cell compiled as IPython compiles it (keeping its line numbers), or as plain Python without a shell."""
        if self.shell is not None:
            return compile_cell(self.shell, cell, header=header, transformers=transformers)
        compiled = compile_plain(cell, header, label="dataparallel")
        transformers = list(transformers)
        if not transformers:
            return compiled
        tree = compiled.tree
        for transformer in transformers:
            tree = ast.fix_missing_locations(transformer.visit(tree))
        body = list(tree.body)
        last = None
        if body and isinstance(body[-1], ast.Expr):
            last = compile(ast.Expression(body.pop().value), compiled.filename, "eval")  # type: ignore[attr-defined]
        return CompiledCell(body=compile(ast.Module(body, type_ignores=[]), compiled.filename, "exec"),
                            last_expr=last, filename=compiled.filename, tree=tree, source=compiled.source)
