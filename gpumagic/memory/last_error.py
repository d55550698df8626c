"""The last error, wherever IPython and ``sys`` keep it, and letting it go.

An error's traceback keeps every failing frame alive, and each frame its locals:
the batch, the activations, a model built inside a function. IPython keeps the
last error in several places at once: ``sys.last_exc`` / ``last_value`` /
``last_traceback`` (for ``%debug`` and ``%tb``), its traceback formatter
(``InteractiveTB.tb``), its debugger once ``%debug`` ran (``InteractiveTB.pdb``),
and the cell's result (``last_execution_result.error_in_exec``) until the next
cell ends. Setting only ``sys.last_*`` to ``None`` frees nothing.

:func:`kept_errors` lists the errors kept, :func:`error_frames` their frames
(chained errors' too), :func:`let_go` drops every reference IPython and ``sys``
hold, and :func:`clear_frames` drops the frames' locals, whoever else still
holds the frames. Nothing here imports torch; only :func:`let_go` and
:func:`clear_frames` change anything.
"""
from __future__ import annotations

import builtins
import logging
import sys
import types
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["KeptError", "kept_errors", "error_chain", "error_frames", "let_go", "clear_frames", "frame_label"]

_SYS_NAMES = ("last_exc", "last_value", "last_traceback", "last_type")
_GROUP = getattr(builtins, "BaseExceptionGroup", None)   # Python 3.11+


@dataclass
class KeptError:
    """An error IPython or ``sys`` keeps, and where (``holders``: ``sys.last_value``, ...)."""
    error: BaseException
    holders: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """``OutOfMemoryError: CUDA out of memory...`` (its first line, at most 100 characters)."""
        text = _first_line(self.error)
        return f"{type(self.error).__name__}: {text}" if text else type(self.error).__name__


def _first_line(error: BaseException) -> str:
    try:
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    except Exception:  # an error's __str__ is notebook code; its name is enough then
        logger.debug("an error's text could not be read", exc_info=True)
        return ""
    return text if len(text) <= 100 else text[:97] + "..."


def _is_error(value) -> bool:
    return issubclass(type(value), BaseException)


def kept_errors(shell=None) -> list[KeptError]:
    """The errors ``sys`` and ``shell`` keep, each once, with where each is kept.

    In a notebook::

        from gpumagic.memory.last_error import kept_errors
        [k.holders for k in kept_errors(get_ipython())]
        [['sys.last_exc', 'sys.last_value', 'last_execution_result.error_in_exec']]
    """
    found: dict[int, KeptError] = {}

    def add(value, holder: str) -> None:
        if _is_error(value):
            found.setdefault(id(value), KeptError(value)).holders.append(holder)

    for name in ("last_exc", "last_value"):
        add(getattr(sys, name, None), f"sys.{name}")
    last_tb = getattr(sys, "last_traceback", None)
    if last_tb is not None and not any(k.error.__traceback__ is last_tb for k in found.values()):
        logger.debug("sys.last_traceback is not the last error's traceback; its frames are listed alone")
    if shell is not None:
        result = getattr(shell, "last_execution_result", None)
        add(getattr(result, "error_in_exec", None), "last_execution_result.error_in_exec")
        add(getattr(result, "error_before_exec", None), "last_execution_result.error_before_exec")
        syntax = getattr(shell, "SyntaxTB", None)
        add(getattr(syntax, "last_syntax_error", None), "SyntaxTB.last_syntax_error")
    return list(found.values())


def error_chain(error: BaseException) -> list[BaseException]:
    """``error`` and every error it chains to (cause, context, an exception group's members)."""
    return _chain(error, set())


def _chain(error: BaseException, seen: set[int]) -> list[BaseException]:
    """``error`` and the errors it chains (cause, context, an exception group's members)."""
    todo, out = [error], []
    while todo:
        err = todo.pop()
        if not _is_error(err) or id(err) in seen:
            continue
        seen.add(id(err))
        out.append(err)
        todo += [vars(BaseException)[k].__get__(err) for k in ("__cause__", "__context__")]
        if _GROUP is not None and issubclass(type(err), _GROUP):
            todo += list(getattr(err, "exceptions", ()))
    return out


def error_frames(errors, extra_tracebacks=()) -> list[types.FrameType]:
    """Every frame the tracebacks of ``errors`` (and the errors they chain) keep, each once,
    outermost first; ``extra_tracebacks`` adds tracebacks kept apart (``sys.last_traceback``)."""
    frames: list[types.FrameType] = []
    seen_frames: set[int] = set()
    seen_errors: set[int] = set()
    tracebacks = []
    for error in errors:
        tracebacks += [vars(BaseException)["__traceback__"].__get__(e) for e in _chain(error, seen_errors)]
    for tb in [*tracebacks, *extra_tracebacks]:
        while tb is not None:
            frame = tb.tb_frame
            if id(frame) not in seen_frames:
                seen_frames.add(id(frame))
                frames.append(frame)
            tb = tb.tb_next
    return frames


def let_go(shell=None) -> list[str]:
    """Drop every reference ``sys`` and ``shell`` keep to the last error; returns where they were.

    ``%debug`` and ``%tb`` then have no error to show, as after a kernel restart. The
    errors themselves lose their tracebacks, so that a holder nobody knows of keeps
    no frame through them.
    """
    kept = kept_errors(shell)
    dropped = [h for k in kept for h in k.holders]
    for name in _SYS_NAMES:
        if getattr(sys, name, None) is not None:
            setattr(sys, name, None)
            if f"sys.{name}" not in dropped and name != "last_type":   # a class, not the error
                dropped.append(f"sys.{name}")
    if shell is not None:
        dropped += _let_go_in_shell(shell)
    for k in kept:
        for err in _chain(k.error, set()):
            try:
                err.__traceback__ = None
            except Exception:  # an error type that refuses it still loses every other holder
                logger.debug("could not drop a %s's traceback", type(err).__name__, exc_info=True)
    return dropped


def _let_go_in_shell(shell) -> list[str]:
    """The shell's own references: formatters' tracebacks, the debugger, the last result's error."""
    dropped = []
    for formatter_name in ("InteractiveTB", "SyntaxTB", "SysTB"):
        formatter: Any = getattr(shell, formatter_name, None)
        if getattr(formatter, "tb", None) is not None:
            formatter.tb = None
            dropped.append(f"{formatter_name}.tb")
        if getattr(formatter, "pdb", None) is not None:
            # the debugger of the last %debug keeps its bottom frame; IPython makes a new one when needed
            formatter.pdb = None
            dropped.append(f"{formatter_name}.pdb")
    syntax: Any = getattr(shell, "SyntaxTB", None)
    if getattr(syntax, "last_syntax_error", None) is not None:
        syntax.last_syntax_error = None
    result = getattr(shell, "last_execution_result", None)
    for name in ("error_in_exec", "error_before_exec"):
        error: Any = getattr(result, name, None)
        if _is_error(error):
            # The same type and message, without the traceback: `result.success` stays False.
            setattr(result, name, _bare_copy(error))
    return dropped


def _bare_copy(error: BaseException) -> BaseException:
    """A copy of ``error`` that keeps no traceback, cause or context."""
    import copy
    try:
        bare = copy.copy(error)
    except Exception:  # an error type that cannot be copied: a plain one of the same name
        logger.debug("could not copy a %s; keeping a plain RuntimeError in its place", type(error).__name__,
                     exc_info=True)
        bare = RuntimeError(f"{type(error).__name__}: {_first_line(error)}")
    bare.__traceback__ = None
    bare.__cause__ = bare.__context__ = None
    return bare


def clear_frames(frames) -> tuple[int, list[str]]:
    """Drop the locals of finished ``frames``; returns how many were cleared and which could not be.

    A module-level frame (a cell's own) is left alone: its locals are the notebook's
    namespace. Before Python 3.13, reading ``frame.f_locals`` (a debugger, ``%gpumem --vars``)
    leaves a copy of the locals on the frame that ``frame.clear()`` does not empty: it is
    emptied here too.
    """
    cleared, refused = 0, []
    for frame in frames:
        if frame.f_locals is frame.f_globals:
            continue
        snapshot = frame.f_locals if sys.version_info < (3, 13) else None
        try:
            frame.clear()
        except RuntimeError:  # still running (a suspended generator): its locals are in use
            logger.debug("frame %s is still running; its locals stay", frame_label(frame), exc_info=True)
            refused.append(frame_label(frame))
            continue
        if type(snapshot) is dict:
            snapshot.clear()
        cleared += 1
    return cleared, refused


def frame_label(frame, shell=None) -> str:
    """Where ``frame`` runs: ``Cell In[4], line 7, in step`` for a cell, else ``file.py:12, in forward``."""
    code = frame.f_code
    where = _cell_name(code.co_filename, shell)
    line = frame.f_lineno
    if where is not None:
        return f"{where}, line {line}, in {code.co_name}"
    if _is_cell_file(code.co_filename):
        # a cell this process did not compile (a rank's): written as a traceback does, for the
        # kernel to name it `Cell In[n]` (gpumagic.procs.failures.relabel)
        return f'File "{code.co_filename}", line {line}, in {code.co_name}'
    return f"{_short_path(code.co_filename)}:{line}, in {code.co_name}"


def _is_cell_file(filename: str) -> bool:
    from ..cell.compile import is_cell
    return is_cell(filename)


def _cell_name(filename: str, shell) -> str | None:
    """``Cell In[4]`` where ``filename`` is a cell the shell compiled, as IPython's tracebacks say."""
    if shell is None:
        shell = _running_shell()
    compiler = getattr(shell, "compile", None)
    fmt = getattr(compiler, "format_code_name", None)
    if fmt is None:
        return None
    try:
        named = fmt(filename)
    except Exception:  # an older IPython without the mapping: the file name is shown instead
        logger.debug("IPython could not name %s", filename, exc_info=True)
        return None
    return f"{named[0]} {named[1]}" if named else None


def _running_shell():
    ipython = sys.modules.get("IPython")
    getter = getattr(ipython, "get_ipython", None)
    return getter() if getter is not None else None


def _short_path(path: str) -> str:
    """``torch/nn/modules/linear.py`` rather than the whole site-packages path."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path
