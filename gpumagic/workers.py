"""Primitives shared by the multi-process magics: reaping, shipping, errors.

Worker processes must never outlive the kernel (restart or kill included), must
report exceptions with the user's cell lines, and must be reaped on every
ending. The pool and the Hogwild launcher build on these.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import traceback


__all__ = ["die_with_parent", "exception_info", "raise_worker_error", "reap", "dumps", "loads"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Make the kernel's death kill this worker (Linux ``PR_SET_PDEATHSIG``).

    Call first thing in a worker. If the parent already died before the call,
    exit at once: the signal would never come.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except Exception:
            pass
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def exception_info(rank: int, exc: BaseException) -> dict:
    """A picklable description of ``exc`` raised in worker ``rank``.

    The traceback keeps only frames from the user's cell where there are any,
    so it points at their lines rather than at gpumagic's.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if f.filename.startswith("<ipython-input-") or f.filename.startswith("<cell")]
    # Frames below the user's (inside torch, say) stay: they say where it broke.
    if user:
        first = frames.index(user[0])
        frames = traceback.StackSummary.from_list(frames[first:])
    lines = ["Traceback (most recent call last):\n"]
    lines += [_cell_label(line) for line in traceback.format_list(frames)]
    lines += traceback.format_exception_only(type(exc), exc)
    return {
        "rank": rank,
        "pid": os.getpid(),
        "exc_type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(lines),
    }


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


def raise_worker_error(info: dict):
    """Raise the :class:`WorkerError` described by ``info`` (from :func:`exception_info`)."""
    from .errors import WorkerError  # here, not at the top: worker processes need no IPython
    raise WorkerError(info["rank"], info.get("pid"), info["exc_type"], info["message"], info.get("traceback", ""))


def reap(processes, timeout: float = 3.0) -> None:
    """Stop and join ``processes`` (multiprocessing ``Process`` objects): ask, then kill.

    SIGINT first would let a worker print its own KeyboardInterrupt; workers
    are told to stop through their pipe instead, so this sends SIGTERM, waits
    ``timeout`` seconds in all, then SIGKILL.
    """
    procs = [p for p in processes if p is not None]
    for p in procs:
        if p.is_alive():
            try:
                p.terminate()
            except Exception:
                pass
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            try:
                p.kill()
            except Exception:
                pass
            p.join(1.0)
    for p in procs:
        close = getattr(p, "close", None)
        if close is not None and not p.is_alive():
            try:
                close()
            except Exception:
                pass


def dumps(obj) -> bytes:
    """cloudpickle: classes and functions defined in the notebook travel by value."""
    import cloudpickle
    return cloudpickle.dumps(obj)


def loads(data: bytes):
    import pickle
    return pickle.loads(data)
