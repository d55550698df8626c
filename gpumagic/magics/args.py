"""Argument parsing for every magic: a bad flag names the valid ones, and quoted values are unquoted."""
from __future__ import annotations

import shlex

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

__all__ = ["split", "parse", "oversubscribe"]

#: ``--oversubscribe``, for the magics that start worker processes.
oversubscribe = argument(
    "--oversubscribe", action="store_true",
    help="start --nprocs workers even above what this machine has room for (4 per core, and the memory "
         "available); without it, such a count is refused before anything starts")


def split(line: str) -> list[str]:
    """``line`` as the magic's arguments, quotes taken off as a shell does: ``"cuda:1"`` and ``'cpu'`` (devices
    copied from Python) are ``cuda:1`` and ``cpu``, ``--devices 'cuda:0','cuda:1'`` is ``--devices cuda:0,cuda:1``.

    A ``#`` that starts a word, outside quotes, begins a comment, as in Python and a shell:
    ``%gpumem --watch  # live gauges`` is ``--watch``; ``#`` inside a word (``run#2``) is kept.
    Backslashes are kept as written (a Windows path). Raises ``UsageError`` for a quote left open.
    """
    lexer = shlex.shlex(_without_comment(line), posix=True)
    lexer.whitespace_split = True
    lexer.commenters = ""   # comments are taken off above, where '#' inside a word can be kept
    lexer.escape = ""
    try:
        return list(lexer)
    except ValueError as exc:   # "No closing quotation"
        raise UsageError(f"{exc} in {line.strip()!r}") from None


def _without_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a word outside quotes (the rest is a comment)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def parse(magic_func, line: str):
    """``parse_argstring`` with quoted values unquoted, whose errors end with the magic's usage line.

    >>> args = parse(self.gpuinfo, line)   # doctest: +SKIP
    """
    try:
        return magic_func.parser.parse_args(split(line))
    except UsageError as exc:
        usage = " ".join(magic_func.parser.format_usage().replace("::", "").split()).replace("usage: ", "", 1)
        raise UsageError(f"{exc}; usage: {_escape(magic_func)[1:]}{usage}") from None


def _escape(magic_func) -> str:
    """``%%`` for a cell magic (argparse's usage line says ``%name`` for every magic), else ``%``."""
    kinds = getattr(getattr(magic_func, "__self__", None), "magics", {})
    name = getattr(magic_func, "__name__", "")
    return "%%" if name in kinds.get("cell", {}) and name not in kinds.get("line", {}) else "%"
