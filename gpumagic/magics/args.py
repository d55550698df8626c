"""Argument parsing for every magic: a bad flag names the valid ones."""
from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, parse_argstring

#: ``--oversubscribe``, for the magics that start worker processes.
oversubscribe = argument(
    "--oversubscribe", action="store_true",
    help="start --nprocs workers even above what this machine has room for (4 per core, and the memory "
         "available); without it, such a count is refused before anything starts")


def parse(magic_func, line: str):
    """``parse_argstring`` whose errors end with the magic's usage line.

    >>> args = parse(self.gpuinfo, line)   # doctest: +SKIP
    """
    try:
        return parse_argstring(magic_func, line)
    except UsageError as exc:
        usage = " ".join(magic_func.parser.format_usage().replace("::", "").split()).replace("usage: ", "", 1)
        raise UsageError(f"{exc}; usage: {_escape(magic_func)[1:]}{usage}") from None


def _escape(magic_func) -> str:
    """``%%`` for a cell magic (argparse's usage line says ``%name`` for every magic), else ``%``."""
    kinds = getattr(getattr(magic_func, "__self__", None), "magics", {})
    name = getattr(magic_func, "__name__", "")
    return "%%" if name in kinds.get("cell", {}) and name not in kinds.get("line", {}) else "%"
