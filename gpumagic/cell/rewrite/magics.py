"""The code of ``%time``, ``%timeit`` and ``%prun`` inside a rewritten cell, rewritten like the cell.

IPython turns ``%timeit -n 3 model(x.cuda())`` into
``get_ipython().run_line_magic('timeit', '-n 3 model(x.cuda())')``: the code
is a string the placement rewrite would not see, and the magic compiles it
later, unrewritten. :func:`rewrite_magic_call` splits the magic's options
off the way the magic reads them (getopt-style, leading), rewrites the code
(parsed, rewritten, unparsed) and puts the options back. Anything it cannot
split or parse is left as written, so the magic reports it as usual. The
rewritten code names the cell's helper, which ``%%ondevice`` binds in the
notebook (and builtins), where these magics run code.
"""
from __future__ import annotations

import ast
from collections.abc import Callable

__all__ = ["rewrite_magic_call", "rewrite_magic_code"]

# magic -> (short options that take a value, short flags, long flags), as each magic parses its line.
_OPTIONS = {
    "timeit": ("nrpv", "tcqo", ()),
    "time": ("", "", ("--no-raise-error",)),
    "prun": ("DlsT", "rq", ()),
}


def _split_options(magic: str, line: str) -> tuple[str, str] | None:
    """``'-n 3 -r1 f(x)'`` -> ``('-n 3 -r1 ', 'f(x)')``; None where the options cannot be told apart."""
    valued, flags, long_flags = _OPTIONS[magic]
    pos, need_value = 0, False
    while True:
        start = len(line) - len(line[pos:].lstrip())
        if start == len(line):
            return None if need_value else (line, "")
        end = start + len(line[start:].split(None, 1)[0])
        token = line[start:end]
        if need_value:
            need_value, pos = False, end
            continue
        if not token.startswith("-") or token == "-":
            return line[:start], line[start:]
        pos = end
        if token == "--":
            rest = line[end:].lstrip()
            return line[:len(line) - len(rest)], rest
        if token.startswith("--"):
            if token not in long_flags:
                return None
            continue
        for i, char in enumerate(token[1:], 1):
            if char in valued:
                need_value = i == len(token) - 1   # ``-n3`` holds its value, ``-n 3`` does not
                break
            if char not in flags:
                return None   # an option the magic does not know: let it say so


def _rewrite_source(code: str, rewrite: Callable[[ast.Module], int], one_line: bool) -> str | None:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None   # IPython syntax inside, or an error the magic reports with its own words
    if not rewrite(tree):
        return None
    tree = ast.fix_missing_locations(tree)
    if not one_line:
        return ast.unparse(tree) + "\n"
    parts = [ast.unparse(statement) for statement in tree.body]
    if any("\n" in part for part in parts):
        return None   # ``%time`` re-joins its line on whitespace: a compound statement would not survive
    # A trailing ``;`` silences the magic's output (IPython reads the line for it).
    return "; ".join(parts) + (";" if code.rstrip().endswith(";") else "")


def rewrite_magic_code(magic: str, line: str, cell: str | None,
                       rewrite: Callable[[ast.Module], int]) -> tuple[str, str | None] | None:
    """``(line, cell)`` of ``%magic`` / ``%%magic`` with their code rewritten, or None where nothing changed.

    ``rewrite`` rewrites a parsed tree in place and returns how many places it changed.
    """
    if magic not in _OPTIONS:
        return None
    split = _split_options(magic, line)
    new_line = new_cell = None
    if split is not None and split[1].strip():
        options, code = split
        # ``%%timeit``'s line holds its setup statement; ``%%time``'s and ``%%prun``'s code is the cell.
        if cell is None or magic == "timeit":
            new_code = _rewrite_source(code, rewrite, one_line=True)
            new_line = None if new_code is None else options + new_code
    if cell is not None:
        new_cell = _rewrite_source(cell, rewrite, one_line=False)
    if new_line is None and new_cell is None:
        return None
    return (line if new_line is None else new_line), (cell if new_cell is None else new_cell)


def _is_get_ipython(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "get_ipython" \
        and not node.args and not node.keywords


def rewrite_magic_call(node: ast.Call, rewrite: Callable[[ast.Module], int]) -> ast.Call | None:
    """``get_ipython().run_line_magic('timeit', code)`` (or ``run_cell_magic``) with its code rewritten."""
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr in ("run_line_magic", "run_cell_magic")
            and _is_get_ipython(func.value)) or node.keywords:
        return None
    wanted = 2 if func.attr == "run_line_magic" else 3
    args = node.args
    values = [a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if len(args) != wanted or len(values) != wanted:
        return None
    changed = rewrite_magic_code(values[0], values[1], values[2] if wanted == 3 else None, rewrite)
    if changed is None:
        return None
    new_values = [values[0], changed[0]] + ([changed[1]] if wanted == 3 else [])
    new_args: list[ast.expr] = [ast.copy_location(ast.Constant(value=v), a) for v, a in zip(new_values, args)]
    return ast.copy_location(ast.Call(func=func, args=new_args, keywords=[]), node)
