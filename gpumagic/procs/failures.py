"""What a worker's failure looks like on both sides of the pipe.

The worker describes its exception as a plain dict (:func:`exception_info`),
keeping only the frames from the user's cell on (gpumagic's left out) so the
traceback points at their lines; the kernel turns such dicts into one
:class:`~gpumagic.errors.WorkerError` (:func:`primary_error`), naming each cell
``Cell In[n]`` as its shell numbered it (:func:`relabel`), or a
:class:`~gpumagic.errors.WorkerDied` for a worker that went away without a word
(:func:`death_info`).

The worker half imports neither IPython nor torch.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import traceback

from ..cell.compile import cell_label, is_cell

__all__ = ["exception_info", "death_info", "primary_error", "same_failure", "relabel"]

logger = logging.getLogger(__name__)

# Errors after which the process group or the CUDA context is not to be trusted.
_POISONING = ("DistBackendError", "DistNetworkError", "DistStoreError", "AcceleratorError", "OutOfMemoryError")
# Errors that are the consequence of another rank's failure (its socket closed...).
_COLLATERAL = ("connection closed", "connection reset", "broken pipe", "distbackenderror", "distnetworkerror",
               "timed out", "timeout")


# ============================================================== worker side

def exception_info(rank: int, exc: BaseException) -> dict:
    """A picklable description of ``exc`` raised in worker ``rank``.

    Where the traceback passes through a cell, frames before the cell's and every
    gpumagic frame are left out (they are the worker's plumbing: its loop, the
    task, wrappers and counting loaders); frames below the user's (inside torch,
    say) stay. Chained exceptions are kept, trimmed alike.
    """
    te = traceback.TracebackException.from_exception(exc)
    _trim(te)
    # A report the task attached while the frames were alive (an out-of-memory error's: see
    # gpumagic.memory.oom): plain data, shown under the worker's traceback.
    report = getattr(exc, "gpumagic_report", None)
    return {"rank": rank, "pid": os.getpid(), "exc_type": type(exc).__name__, "message": relabel(_text(exc)),
            "traceback": relabel("".join(te.format())), "report": report}


def _text(exc: BaseException) -> str:
    """``str(exc)``, or what ``traceback`` writes where the exception's own ``__str__`` fails: that
    failure would otherwise end the worker without a word about the cell's exception."""
    try:
        return str(exc)
    except Exception:  # any failure of the user's __str__
        logger.debug("str() of a %s failed", type(exc).__name__, exc_info=True)
        return "<exception str() failed>"


def _trim(te: traceback.TracebackException) -> None:
    """Trim the frames of ``te`` and of the exceptions chained to it, in place."""
    seen: set[int] = set()
    pending = [te]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        frames = list(current.stack)
        first = next((i for i, f in enumerate(frames) if is_cell(f.filename)), None)
        if first is not None:
            kept = [f for f in frames[first:] if not _is_own(f.filename)]
            current.stack = traceback.StackSummary.from_list(kept)
        chained = [current.__cause__, current.__context__, *(getattr(current, "exceptions", None) or [])]
        pending += [c for c in chained if c is not None]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _is_own(filename: str) -> bool:
    return not filename.startswith("<") and os.path.abspath(filename).startswith(_PACKAGE)


# A frame as the traceback module writes it (``File "name", line 3, in f``), or a SyntaxError's place.
_FRAME = re.compile(r'File "(?P<name>[^"\n]+)", line (?P<line>\d+)')


def relabel(text: str) -> str:
    """``File "<cell's filename>", line 3`` written the way IPython writes it: ``Cell In[7], line 3``.

    Which filename is which cell is asked of this process's shell (in the kernel, the one that
    compiled the cells; see :func:`~gpumagic.cell.compile.cell_label`), so it works whatever the
    kernel names its cells. Text about other files is left as it is.
    """
    def label(match: re.Match) -> str:
        name = cell_label(match.group("name"))
        return f"{name}, line {match.group('line')}" if name else match.group(0)
    return _FRAME.sub(label, text)


# ============================================================== kernel side

def death_info(rank: int, pid: int | None, exitcode: int | None) -> dict:
    """What to say about a worker that went away without a word (``exitcode`` None: still running)."""
    if exitcode is None:
        how = "the worker closed its pipe"
    elif exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown"
        hint = ": out of memory?" if -exitcode == signal.SIGKILL else ""
        how = f"the worker was killed by signal {-exitcode} ({name}{hint})"
    else:
        how = f"the worker exited with code {exitcode}"
    return {"rank": rank, "pid": pid, "exc_type": "WorkerDied", "message": how, "traceback": "", "died": True}


def same_failure(errors: dict, world: int) -> bool:
    """Every rank raised the same exception at the same line, so none waits in a collective."""
    if len(errors) != world:
        return False
    infos = list(errors.values())
    if any(e.get("died") for e in infos):
        return False
    if any(e.get("exc_type") in _POISONING or "CUDA error" in e.get("message", "") for e in infos):
        return False
    return len({(e.get("exc_type"), _last_line(e.get("traceback", ""))) for e in infos}) == 1


def _last_line(tb: str) -> str:
    lines = [line for line in tb.splitlines() if line.strip().startswith(("File ", "Cell In"))]
    return lines[-1].strip() if lines else ""


def _collateral(info: dict) -> bool:
    text = (info.get("exc_type", "") + " " + info.get("message", "")).lower()
    return any(s in text for s in _COLLATERAL)


def primary_error(errors: dict, still_running=()):
    """The error to show for ``{rank: info}``: a real exception before a death before what others
    suffered from it, lowest rank first. Every rank's info stays in ``.all_errors``; where the error
    shown is such a consequence (a collective that timed out), the ranks that had not finished
    (stopped then) in ``.still_running``."""
    from ..errors import WorkerDied, WorkerError  # kernel side only: errors imports IPython
    for info in errors.values():
        # The worker named cells as far as it could; the kernel's shell knows every cell's number.
        for key in ("traceback", "message"):
            if info.get(key):
                info[key] = relabel(info[key])
    infos = sorted(errors.values(), key=lambda e: (_collateral(e), bool(e.get("died")), e["rank"]))
    e = infos[0]
    cls = WorkerDied if e.get("died") else WorkerError
    err = cls(e["rank"], e.get("pid"), e["exc_type"], e["message"], e.get("traceback", ""))
    report = e.get("report")
    if hasattr(report, "relabel"):
        report.relabel(relabel)
    err.report = report
    err.all_errors = errors
    # (where the shown error is one a rank suffered from another, such as a timed-out collective: a rank
    # that waited on a rank which raised is no lead)
    err.still_running = sorted(still_running) if _collateral(e) else []
    return err
