"""The shape gpumagic's code keeps, checked on its source: no long function, no import cycle, a declared surface.

Complexity is ruff's C901 (``max-complexity = 15`` in ``pyproject.toml``); these are what ruff does not check:

* no function (or method) longer than :data:`MAX_LINES` lines, decorators and docstring included;
* no import cycle between gpumagic's modules. Imports inside functions count as much as those at the top of a
  module: deferring an import (to keep torch or IPython out of a process until needed) does not remove the
  dependency, so a cycle closed by one is still a cycle. ``from . import x`` counts as an import of the
  submodule ``x`` where there is one, else of the package;
* every module declares its public surface in ``__all__``: each name there exists, and each module-level
  function and class that is not listed is internal, its name starting with ``_``.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpumagic")
MAX_LINES = 80


def _modules() -> dict[str, tuple[str, ast.Module]]:
    """``{dotted name: (path, tree)}`` of every module of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = (path, ast.parse(open(path).read(), path))
    return found


MODULES = _modules()


def _where(path: str, line: int) -> str:
    return f"{os.path.relpath(path, os.path.dirname(ROOT))}:{line}"


def test_no_function_is_longer_than_the_limit():
    long = [f"{_where(path, node.lineno)} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in MODULES.values() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert long == [], f"functions over {MAX_LINES} lines:\n" + "\n".join(long)


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The gpumagic modules ``node`` (an import statement of ``module``) imports."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    base = module if is_package else module.rpartition(".")[0]
    if node.level:
        base = ".".join(base.split(".")[: len(base.split(".")) - (node.level - 1)])
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    targets = {f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source for alias in node.names}
    return {t for t in targets if t in MODULES}


def import_graph() -> dict[str, set[str]]:
    """``{module: the gpumagic modules it imports}``, at its top level and inside its functions alike."""
    graph: dict[str, set[str]] = {}
    for module, (path, tree) in MODULES.items():
        is_package = path.endswith("__init__.py")
        graph[module] = {target for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for target in _imported(module, is_package, node)} - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            target = next(edges, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_closed_inside_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    from . import names\n")
    node = tree.body[0].body[0]
    assert _imported("gpumagic.cell.compile", False, node) == {"gpumagic.cell.names"}


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def _declared(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(node.value))
    return None


def _defined(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (functions, classes, assignments, imports)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node in tree.body:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_public_surface_is_declared(module):
    path, tree = MODULES[module]
    declared = _declared(tree)
    assert declared is not None, f"{_where(path, 1)} declares no __all__"
    missing = [name for name in declared if name not in _defined(tree)]
    assert missing == [], f"{_where(path, 1)}: __all__ names what the module does not define: {missing}"
    internal = [node.name for node in tree.body
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and not node.name.startswith("_") and node.name not in declared]
    assert internal == [], f"{_where(path, 1)}: public names not in __all__ (list them, or start them with _): " \
                           f"{internal}"
