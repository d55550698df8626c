"""What a worker's failure looks like on both sides of the pipe.

The worker describes its exception as a plain dict (:func:`exception_info`),
keeping only the frames from the user's cell so the traceback points at their
lines; the kernel turns such dicts into one :class:`~gpumagic.errors.WorkerError`
(:func:`primary_error`), or a :class:`~gpumagic.errors.WorkerDied` for a worker
that went away without a word (:func:`death_info`).

The worker half imports neither IPython nor torch.
"""
from __future__ import annotations

import os
import signal
import traceback

__all__ = ["exception_info", "death_info", "primary_error", "same_failure"]

# Errors after which the process group or the CUDA context is not to be trusted.
_POISONING = ("DistBackendError", "DistNetworkError", "DistStoreError", "AcceleratorError", "OutOfMemoryError")
# Errors that are the consequence of another rank's failure (its socket closed...).
_COLLATERAL = ("connection closed", "connection reset", "broken pipe", "distbackenderror", "distnetworkerror",
               "timed out", "timeout")


# ============================================================== worker side

def exception_info(rank: int, exc: BaseException) -> dict:
    """A picklable description of ``exc`` raised in worker ``rank``.

    Frames before the first one in a notebook cell are left out: they are
    gpumagic's. Frames below the user's (inside torch, say) stay.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if _is_cell(f.filename)]
    if user:
        frames = traceback.StackSummary.from_list(frames[frames.index(user[0]):])
    lines = ["Traceback (most recent call last):\n"]
    lines += [_cell_label(line) for line in traceback.format_list(frames)]
    lines += traceback.format_exception_only(type(exc), exc)
    return {"rank": rank, "pid": os.getpid(), "exc_type": type(exc).__name__, "message": str(exc),
            "traceback": "".join(lines)}


def _is_cell(filename: str) -> bool:
    return filename.startswith(("<ipython-input-", "<cell"))


def _cell_label(line: str) -> str:
    """Show ``File "<ipython-input-7-abc>", line 3`` the way IPython does: ``Cell In[7], line 3``."""
    marker = 'File "<ipython-input-'
    start = line.find(marker)
    if start < 0:
        return line
    rest = line[start + len(marker):]
    number = rest.split("-", 1)[0]
    after = rest.split('"', 1)[1] if '"' in rest else ""
    return line[:start] + f"Cell In[{number}]" + after


# ============================================================== kernel side

def death_info(rank: int, pid: int | None, exitcode: int | None, remote: bool = False) -> dict:
    """What to say about a worker that went away without a word (``exitcode`` None: still running)."""
    if remote:
        how = "the connection to the worker was lost"
    elif exitcode is None:
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


def primary_error(errors: dict):
    """The error to show for ``{rank: info}``: a real exception before a death before what others
    suffered from it, lowest rank first. Every rank's info stays in ``.all_errors``."""
    from ..errors import WorkerDied, WorkerError  # kernel side only: errors imports IPython
    infos = sorted(errors.values(), key=lambda e: (_collateral(e), bool(e.get("died")), e["rank"]))
    e = infos[0]
    cls = WorkerDied if e.get("died") else WorkerError
    err = cls(e["rank"], e.get("pid"), e["exc_type"], e["message"], e.get("traceback", ""))
    err.all_errors = errors
    return err
