"""Compile a cell's body the way IPython compiles cells, keeping the user's lines.

The pipeline is IPython's own (as in ``%time``): ``shell.transform_cell`` (so
``%magics`` and ``!commands`` inside the body work), ``compile.ast_parse``,
``shell.transform_ast`` (other extensions' AST transformers still apply), then
gpumagic's own transformers, then ``shell.compile`` under a filename from
``compile.cache``. That filename is what makes tracebacks read
``Cell In[7], line 3`` with the user's source, and ``inspect.getsource`` work
on functions defined in the cell.

Line numbers count the magic's own line, so line 3 is the third line the user
sees in the cell. :func:`cell_label` says which ``In[n]`` a filename is, as the
running shell's compiler recorded it (a kernel names cells
``/tmp/ipykernel_<pid>/<hash>.py``, a terminal ``<ipython-input-7-...>``), and
:func:`is_cell` whether a worker's frame is in a cell.
"""
from __future__ import annotations

import ast
import itertools
import linecache
import logging
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from types import CodeType

from .trees import MAX_DEPTH, depth, room_for

logger = logging.getLogger(__name__)

__all__ = ["CompiledCell", "compile_cell", "compile_plain", "run_compiled", "register_source", "is_empty",
           "cell_label", "is_cell", "remember_cells_of", "shell_calls", "refuse_shell_calls", "refuse_too_deep",
           "refuse_top_level_await"]

# IPython's own name for a cell (IPython.core.compilerop.code_name), which carries its number.
_INPUT_NAME = re.compile(r"<ipython-input-(\d+)-[0-9a-f]+>")
# Cells whose source this process registered (a worker has no shell that knows them).
_registered: set[str] = set()


@dataclass
class CompiledCell:
    """A cell compiled in two parts: statements, then the last expression's value."""
    body: CodeType             # code object run with exec
    last_expr: CodeType | None  # code object for eval, or None when the cell ends in a statement
    filename: str              # the name tracebacks show as ``Cell In[n]``
    tree: ast.Module           # the final AST, after every transformer
    source: str = ""           # the cell as the notebook shows it, the magic's line included


def is_empty(cell: str | None) -> bool:
    """True for a cell with no code (blank lines and comments only)."""
    if not cell or not cell.strip():
        return True
    try:
        return not ast.parse(cell).body
    except SyntaxError:
        return False


def _leading_blank_lines(text: str) -> int:
    count = 0
    for line in text.splitlines():
        if line.strip():
            break
        count += 1
    return count


def register_source(filename: str, source: str) -> None:
    """Put ``source`` in linecache under ``filename``, known from now on as a cell's (where there is no shell)."""
    lines = [line + "\n" for line in source.splitlines()]
    linecache.cache[filename] = (len(source), None, lines, filename)
    _registered.add(filename)


# What IPython turns %magics, %%magics and !commands into: calls on get_ipython().
_SHELL_CALLS = {"run_line_magic": "%", "run_cell_magic": "%%", "system": "!", "getoutput": "!"}


def shell_calls(tree: ast.AST) -> list[tuple[str, int]]:
    """``[("%time", line), ("!ls", line), ...]``: the magics and shell commands in a compiled cell, which a
    process without IPython (a worker) cannot run."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _SHELL_CALLS and isinstance(node.func.value, ast.Call) \
                and isinstance(node.func.value.func, ast.Name) and node.func.value.func.id == "get_ipython":
            first = node.args[0] if node.args else None
            word = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
            found.append((_SHELL_CALLS[node.func.attr] + word.split()[0] if word.strip() else
                          _SHELL_CALLS[node.func.attr], node.lineno))
    return sorted(found, key=lambda f: f[1])


def refuse_shell_calls(tree: ast.AST, magic: str) -> None:
    """``UsageError`` naming the magics and !commands in a cell that ``magic`` runs in worker processes."""
    calls = shell_calls(tree)
    if calls:
        from ..errors import usage_error
        named = ", ".join(f"{what} (line {line})" for what, line in calls)
        raise usage_error(f"{magic} runs the cell in worker processes, which are not IPython: {named} cannot "
                          "run there; run it in a cell of its own, before or after")


def remember_cells_of(shell) -> None:
    """Every cell ``shell`` has compiled counts as a cell here even once there is no shell (a forked
    worker lets go of it): tracebacks still start at the user's code."""
    _registered.update(getattr(getattr(shell, "compile", None), "_filename_map", None) or ())


def _running_shell():
    """The running IPython shell, or None; never imports IPython (workers have none)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        return ipython.get_ipython()
    except Exception:  # a half-imported IPython: labels fall back to the names
        logger.debug("no IPython shell to ask for cell names", exc_info=True)
        return None


def cell_label(filename: str) -> str | None:
    """What tracebacks call the cell compiled under ``filename`` (``Cell In[7]``), None for a file.

    The running shell's compiler recorded the number of every cell it named, whatever the
    name looks like (``/tmp/ipykernel_<pid>/<hash>.py`` in a kernel): it is asked first. A
    process without a shell (a worker) still reads IPython's classic ``<ipython-input-7-...>``.

    >>> cell_label("<ipython-input-7-0123abcd>")
    'Cell In[7]'
    """
    shell = _running_shell()
    format_name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if format_name is not None:
        try:
            named = format_name(filename)
        except Exception:  # a compiler of another kind: fall back to the name
            logger.debug("format_code_name(%r) failed", filename, exc_info=True)
            named = None
        if named:
            return " ".join(named)
    match = _INPUT_NAME.fullmatch(filename)
    return f"Cell In[{match.group(1)}]" if match else None


def is_cell(filename: str) -> bool:
    """True for code compiled from a notebook cell (or a magic's cell) rather than read from a file."""
    return filename in _registered or filename.startswith("<cell-") or cell_label(filename) is not None


def _cell_number(shell) -> int:
    """The number IPython shows as ``In[n]`` for the cell running now.

    IPython 9 counts the running cell before executing it (the display hook's
    ``prompt_count`` is ``execution_count - 1`` then); IPython 8 counts after.
    The display hook knows which, in both.
    """
    try:
        return int(shell.displayhook.prompt_count)
    except (AttributeError, TypeError, ValueError):  # a shell without IPython's display hook
        return getattr(shell, "execution_count", 0)


def compile_cell(shell, cell: str, header: str = "", transformers: Iterable[ast.NodeTransformer] = ()) -> CompiledCell:
    """Compile ``cell`` (a cell magic's body) for ``run_compiled``.

    ``header`` is the magic's own line (``%%ondevice cuda:1``); it is kept in
    the cached source so line numbers match the notebook. A syntax error is
    raised pointing at the user's line.

    Examples
    --------
    In a cell magic::

        compiled = compile_cell(self.shell, cell, header=f"%%ondevice {line}")
        value = run_compiled(compiled, self.shell.user_ns)
    """
    offset = header.count("\n") + 1 if header else 0
    full_source = (header.rstrip("\n") + "\n" + cell) if header else cell
    number = _cell_number(shell)
    filename = shell.compile.cache(full_source, number=number, raw_code=full_source)

    transformed = shell.transform_cell(cell)
    # IPython drops a cell's leading blank lines; blank lines stand in for them and for the header,
    # so that every node keeps the line number it has in the source tracebacks show.
    offset += _leading_blank_lines(cell) - _leading_blank_lines(transformed)
    tree = shell.compile.ast_parse("\n" * offset + transformed, filename=filename)
    refuse_too_deep(tree, header)
    with room_for(tree):
        refuse_top_level_await(tree, header)
        tree = shell.transform_ast(tree)
        for transformer in transformers:
            tree = ast.fix_missing_locations(transformer.visit(tree))

        last_expr = None
        body_nodes = list(tree.body)
        if body_nodes and isinstance(body_nodes[-1], ast.Expr):
            last = body_nodes.pop()
            last_expr = shell.compile(ast.Expression(last.value), filename, "eval")
        body = shell.compile(ast.Module(body_nodes, type_ignores=[]), filename, "exec")
    return CompiledCell(body=body, last_expr=last_expr, filename=filename, tree=tree, source=full_source)


def refuse_too_deep(tree: ast.Module, header: str = "") -> None:
    """``UsageError`` for a cell nested deeper than :data:`~.trees.MAX_DEPTH` levels, which the magics'
    walks over its syntax tree would not finish (a plain cell compiles somewhat deeper)."""
    deep = depth(tree)
    if deep > MAX_DEPTH:
        from ..errors import usage_error
        magic = header.split()[0] if header else "this magic"
        raise usage_error(f"the cell nests {deep} levels deep (an if/elif chain of that many branches, or calls or "
                          f"expressions nested in each other), and {magic} takes cells up to {MAX_DEPTH} levels: "
                          "split it (a dict of cases instead of the elif chain, a function for each part); Python "
                          "itself compiles a plain cell only about this deep")


_ASYNC = (ast.Await, ast.AsyncFor, ast.AsyncWith)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def refuse_top_level_await(tree: ast.Module, header: str = "") -> None:
    """``UsageError`` for ``await`` (``async for``, ``async with``) outside a function in a magic's cell.

    A plain cell may await at its top level because IPython runs it as a coroutine; a magic's cell
    runs as ordinary code (in the kernel, or in worker processes), where Python would only say
    "'await' outside function".
    """
    found = _top_level_async(tree)
    if found is not None:
        from ..errors import usage_error
        magic = header.split()[0] if header else "this magic"
        raise usage_error(f"line {getattr(found, 'lineno', '?')}: top-level await is not supported under {magic}; "
                          "await in a cell of its own, or call asyncio.run(...) inside this one")


def _top_level_async(node: ast.AST) -> ast.AST | None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _SCOPES):
            continue   # an await inside a function (or a lambda, or a class body's methods) is fine
        if isinstance(child, _ASYNC) or (isinstance(child, ast.comprehension) and child.is_async):
            return child if hasattr(child, "lineno") else node
        found = _top_level_async(child)
        if found is not None:
            return found
    return None


_plain_counter = itertools.count(1)


def compile_plain(cell: str, header: str = "", label: str = "cell") -> CompiledCell:
    """Compile ``cell`` without a shell (plain Python callers), under a name tracebacks show as a cell.

    No IPython transforms apply: the cell must be plain Python. Line numbers count ``header``.
    """
    offset = header.count("\n") + 1 if header else 0
    source = (header.rstrip("\n") + "\n" + cell) if header else cell
    filename = f"<cell-{label}-{next(_plain_counter)}>"
    register_source(filename, source)
    tree = ast.parse("\n" * offset + cell, filename=filename)
    refuse_top_level_await(tree, header)
    body_nodes = list(tree.body)
    last_expr = None
    if body_nodes and isinstance(body_nodes[-1], ast.Expr):
        last_expr = compile(ast.Expression(body_nodes.pop().value), filename, "eval")  # type: ignore[attr-defined]
    body = compile(ast.Module(body_nodes, type_ignores=[]), filename, "exec")
    return CompiledCell(body=body, last_expr=last_expr, filename=filename, tree=tree, source=source)


def run_compiled(compiled: CompiledCell, namespace: dict):
    """Run a compiled cell in ``namespace``; returns the last expression's value."""
    __tracebackhide__ = True
    exec(compiled.body, namespace)
    if compiled.last_expr is not None:
        return eval(compiled.last_expr, namespace)
    return None
