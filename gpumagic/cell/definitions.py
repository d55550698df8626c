"""A worker cell's ``def``, ``class`` and ``import`` statements, run again in the notebook (and
``Name = namedtuple(...)``, which makes a class as ``class`` does).

A cell run in worker processes binds its names there; the functions, classes and
modules among them are cheap to make again in the kernel, reading the notebook's
names, so they exist there as after a plain cell (a ``def evaluate`` in the
training cell can be called in the next one). Plain functions; no IPython.

In a notebook::

    %%sharedtrain --nprocs 2
    import math
    def lr_at(step): return 0.1 * math.cos(step / 100)
    ...
    # next cell: lr_at(10) works
"""
from __future__ import annotations

import ast

from .names import import_bindings

__all__ = ["definitions", "define_in_notebook"]


# Calls that make a class, as a ``class`` statement does (``Point = namedtuple("Point", "x y")``):
# running one again has no other effect.
CLASS_FACTORIES = frozenset({"namedtuple", "NamedTuple", "make_dataclass", "Enum", "IntEnum", "StrEnum",
                             "Flag", "IntFlag", "TypedDict", "NewType", "TypeVar"})


def definitions(tree: ast.AST) -> dict[str, ast.stmt]:
    """``{name: the last top-level def, class or import statement binding it}``; also a top-level
    ``Name = namedtuple(...)`` and the like (:data:`CLASS_FACTORIES`)."""
    last: dict[str, ast.stmt] = {}
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            last[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for local, _ in import_bindings(node):
                last[local] = node
        elif _makes_a_class(node):
            last[node.targets[0].id] = node
    return last


def _makes_a_class(node: ast.stmt) -> bool:
    """``Name = factory(...)`` with a factory of :data:`CLASS_FACTORIES` (``collections.namedtuple`` too)."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)):
        return False
    func = node.value.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name in CLASS_FACTORIES


def define_in_notebook(ns: dict, tree, filename: str, names: list[str]) -> tuple[list[str], list[str]]:
    """Run again, in the notebook, the cell's statements that bound ``names`` to functions, classes and
    modules (``def``, ``class``, ``import``): they exist there as after a plain cell, reading the
    notebook's names. Returns ``(defined, not_defined)``, the second with the reason for each."""
    last = definitions(tree)
    done, failed, run = [], [], set()
    for name in names:
        node = last.get(name)
        if node is None:
            failed.append(f"{name} (not bound by a def, class, import or namedtuple(...) at the top of the cell)")
            continue
        try:
            if id(node) not in run:
                run.add(id(node))
                exec(compile(ast.Module([node], type_ignores=[]), filename, "exec"), ns)
            done.append(name)
        except Exception as exc:  # noqa: BLE001 - named in the cell's note, with the reason
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
    return done, failed
