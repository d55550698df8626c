"""Which names a cell's ``with ... as NAME`` binds to something worth keeping after the cell.

The training magics leave loop variables behind without a note (``for x, y in loader``: the last
batch; ``with open(path) as f``: a closed file). A ``with`` statement also binds results, though:
the profiler recipe's ``with profile(...) as prof:`` is read by the next cell
(``prof.key_averages().table(...)``), so a name like that is treated as any name the cell assigns
(brought back where it can be, else named in the note with the reason), never dropped in silence.
"""
from __future__ import annotations

import ast

from .names import loop_targets

__all__ = ["kept_with_targets", "quiet_targets"]

# ``with open(...) as f`` and its kin bind a file, closed when the block ends: nothing to keep
_FILE_OPENERS = frozenset({"open", "TemporaryFile", "NamedTemporaryFile", "TemporaryDirectory", "urlopen"})


def kept_with_targets(tree: ast.AST) -> list[str]:
    """Names bound by ``with X as NAME`` where X does not open a file."""
    found: dict[str, None] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.With, ast.AsyncWith)):
            continue
        for item in node.items:
            if item.optional_vars is None or _opens_file(item.context_expr):
                continue
            found.update(dict.fromkeys(n.id for n in ast.walk(item.optional_vars) if isinstance(n, ast.Name)))
    return list(found)


def quiet_targets(tree: ast.AST) -> list[str]:
    """:func:`~gpumagic.cell.names.loop_targets` less the ``with`` results worth keeping."""
    kept = set(kept_with_targets(tree))
    return [n for n in loop_targets(tree) if n not in kept]


def _opens_file(expr: ast.AST) -> bool:
    if not isinstance(expr, ast.Call):
        return False
    func = expr.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in _FILE_OPENERS
