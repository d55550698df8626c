"""Each magic's options, usage line and docstring, read from its ``magic_arguments`` parser.

The same parser prints ``%magic?`` and parses the magic's line, so what this
returns is what the magic takes. Used by the ``{magic}`` directive
(:mod:`magicdoc`) and by ``tests/test_docs.py``; needs no Sphinx.
"""
from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass

# argparse's own groups: shown as one table, titled "options"
_DEFAULT_GROUPS = {"positional arguments", "options", "optional arguments"}


@dataclass
class Option:
    """One ``@argument`` of a magic, as ``%magic?`` shows it."""
    names: list[str]      # ["--nprocs", "-n"]; a positional: ["device"]
    shown: str            # "--nprocs N, -n N"
    help: str             # argparse's help, %-expanded as argparse prints it


@dataclass
class Group:
    title: str
    description: str
    options: list[Option]


def magic_function(name: str):
    """``(class, function, kinds)`` of the magic called ``name`` (``gpumem``, ``dataparallel``)."""
    from gpumagic.magics import MAGIC_CLASSES
    for module_name, class_name in MAGIC_CLASSES:
        cls = getattr(importlib.import_module(module_name), class_name)
        kinds = [kind for kind, names in cls.magics.items() if name in names]
        if kinds:
            return cls, getattr(cls, cls.magics[kinds[0]][name]), kinds
    raise ValueError(f"no gpumagic magic is called {name!r}")


def magic_names() -> list[str]:
    """Every magic gpumagic registers, in the order of ``MAGIC_CLASSES``."""
    from gpumagic.magics import MAGIC_CLASSES
    names: list[str] = []
    for module_name, class_name in MAGIC_CLASSES:
        cls = getattr(importlib.import_module(module_name), class_name)
        for table in cls.magics.values():
            names.extend(n for n in table if n not in names)
    return names


def escapes(kinds: list[str]) -> str:
    """How the magic is written: ``%%ondevice`` (cell), ``%gpumem`` (line), ``%%dataparallel`` (both)."""
    return "%%" if "cell" in kinds else "%"


def _shown(action, formatter) -> str:
    if not action.option_strings:
        return action.metavar or action.dest
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    metavar = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return ", ".join(f"{flag} {metavar}" for flag in action.option_strings)


def magic_options(name: str) -> list[Group]:
    """The magic's arguments by argument group, as its parser holds them (``-h`` left out)."""
    return parser_options(magic_function(name)[1].parser)


def flags(name: str) -> set[str]:
    """Every flag the magic takes (``--nprocs``, ``-n``, ...)."""
    return {n for group in magic_options(name) for option in group.options for n in option.names
            if n.startswith("-")}


def parser_options(parser) -> list[Group]:
    """A ``magic_arguments`` parser's arguments: argparse's own groups as one, titled "options", then
    each argument group (``@argument_group``) with its title and description."""
    formatter = parser._get_formatter()
    groups: list[Group] = []
    merged = Group("options", "", [])
    for group in parser._action_groups:
        options = [Option(list(a.option_strings) or [a.dest], _shown(a, formatter),
                          formatter._expand_help(a) if a.help else "")
                   for a in group._group_actions if a.dest != "help"]
        if not options:
            continue
        if group.title in _DEFAULT_GROUPS:
            merged.options.extend(options)
        else:
            groups.append(Group(group.title or "", group.description or "", options))
    return ([merged] if merged.options else []) + groups


def usage(name: str) -> str:
    """The usage line ``%magic?`` starts with, written with ``%%`` for a cell magic."""
    _cls, func, kinds = magic_function(name)
    lines = [line.strip() for line in func.parser.format_usage().replace("::", "", 1).strip().splitlines()]
    first = escapes(kinds) + lines[0].lstrip("%")   # argparse writes %name for every magic
    indent = " " * (len(first.split()[0]) + 1)      # the other lines aligned under the first option
    return "\n".join([first, *(indent + line for line in lines[1:])])


def docstring(name: str) -> str:
    """The magic's own docstring (argparse's description), numpydoc headings made rubrics."""
    _cls, func, _kinds = magic_function(name)
    text = inspect.cleandoc(func.parser.description or "")
    return re.sub(r"^(\w[\w ]*)\n-{3,}$", r".. rubric:: \1\n", text, flags=re.M)
