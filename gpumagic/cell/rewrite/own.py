"""A module's own ``cuda`` from a plain notebook cell, compiled again so that it follows DEVICE.

A class defined in a plain cell was written for a GPU, and its ``cuda`` may move tensors the module
keeps outside its parameters and buffers. Under ``%%ondevice meta``, ``model.cuda()`` must move those
too, as a GPU would; but plain cells are not rewritten, and the method as written would reach CUDA.
:func:`rebuilt` compiles the method's source again through the placement rewrite (once per code object)
and gives back a function that uses the placement it is handed.

The method is compiled as the inner function of a wrapper whose parameters are its free variables
(``__class__``, which ``super()`` needs, and any closure) and the helper, inside a class of the owner's
name (so ``self.__x`` is mangled as before). Nothing is run to compile it: the new function is made from
the inner code object with the method's globals, defaults and closure cells, and the helper's own cell,
so nothing is bound in the notebook. Its file and line numbers are the cell's, so tracebacks show the
user's line. Library code is left alone (:func:`notebook_function`): its ``cuda`` may ask CUDA things
the rewrite cannot answer.
"""
from __future__ import annotations

import ast
import inspect
import logging
import sys
import textwrap
import types
import weakref

from .transform import PlacementRewriter

__all__ = ["notebook_function", "rebuilt"]

logger = logging.getLogger(__name__)

_HELPER = "__gpumagic_device_own__"   # a closure variable of the compiled function, not a global
_WRAPPER = "__gpumagic_own__"
# the method's code -> the rewritten code (None: its source could not be had or compiled)
_compiled: weakref.WeakKeyDictionary[types.CodeType, types.CodeType | None] = weakref.WeakKeyDictionary()


def notebook_function(function) -> bool:
    """Whether ``function`` is a plain Python function defined in a notebook cell (``__main__``)."""
    return isinstance(function, types.FunctionType) and function.__module__ == "__main__"


def rebuilt(method, placement):
    """``method`` (bound, from a notebook cell) with its CUDA spellings going through ``placement``; None
    where it is no notebook function or its source cannot be compiled again (the caller goes on without it)."""
    function = getattr(method, "__func__", None)
    if not notebook_function(function):
        return None
    code = function.__code__
    if code not in _compiled:
        _compiled[code] = _rewrite(function)
    made = _compiled[code]
    if made is None:
        return None
    cells = dict(zip(code.co_freevars, function.__closure__ or ()))
    cells[_HELPER] = types.CellType(placement)
    if not all(name in cells for name in made.co_freevars):
        return None
    again = types.FunctionType(made, function.__globals__, function.__name__, function.__defaults__,
                               tuple(cells[name] for name in made.co_freevars))
    again.__kwdefaults__ = function.__kwdefaults__
    again.__qualname__ = function.__qualname__
    return types.MethodType(again, method.__self__)


def _rewrite(function) -> types.CodeType | None:
    """The code of ``function`` compiled again through the placement rewrite, or None (logged)."""
    code = function.__code__
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError) as exc:
        logger.debug("no source to follow the device with for %s: %s", function.__qualname__, exc)
        return None
    # Parsed where it stands in the cell (its lines, its indentation), so tracebacks point at the user's code.
    indented = source[:1].isspace()
    if indented and code.co_firstlineno < 2:
        return None
    head = "\n" * (code.co_firstlineno - 2) + "if 1:\n" if indented else "\n" * (code.co_firstlineno - 1)
    try:
        tree = ast.parse(head + source)
    except SyntaxError as exc:
        logger.debug("the source of %s does not parse alone: %s", function.__qualname__, exc)
        return None
    node = tree.body[0] if tree.body else None
    if isinstance(node, ast.If):
        node = node.body[0]
    if not isinstance(node, ast.FunctionDef) or node.name != code.co_name or hasattr(function, "__wrapped__"):
        # A decorator's wrapper (``@torch.no_grad()``) runs code of its own around the source's: not this.
        # One that returns the method itself (``@override``) is fine: its decorators are compiled, never run.
        logger.debug("%s is not a plain def or wraps another: left as written", function.__qualname__)
        return None
    PlacementRewriter(function.__globals__, _HELPER).visit(tree)
    owner = function.__qualname__.split(".")[-2] if "." in function.__qualname__ else ""
    template = f"def {_WRAPPER}({', '.join([*code.co_freevars, _HELPER])}):\n    pass\n"
    if owner.isidentifier():   # ``self.__x`` is mangled with the class's name, as it was
        template = f"class {owner}:\n" + textwrap.indent(template, "    ")
    module = ast.parse(template)
    wrapper = next(part for part in ast.walk(module) if isinstance(part, ast.FunctionDef))
    wrapper.body = [node]
    try:
        compiled = compile(ast.fix_missing_locations(module), code.co_filename, "exec")
    except (SyntaxError, ValueError) as exc:
        logger.debug("could not compile %s again: %s", function.__qualname__, exc)
        return None
    inner = _find(_find(compiled, _WRAPPER), code.co_name)
    if inner is not None and sys.version_info >= (3, 11):   # what tracebacks name the frame by
        inner = inner.replace(co_qualname=function.__qualname__)
    return inner


def _find(code: types.CodeType | None, name: str) -> types.CodeType | None:
    """The code object called ``name`` among those ``code`` holds, at any depth."""
    if code is None:
        return None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name:
                return const
            found = _find(const, name)
            if found is not None:
                return found
    return None
