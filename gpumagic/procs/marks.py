"""Marks that tell gpumagic's workers from other processes: rank N of kernel K.

Seen from outside, a worker is a Python process like any other: forked, its
command line and environment are the kernel's; from a fork server, the
server's. So each worker leaves a mark as it starts, a small file named by its
pid in a folder of this user's (:func:`marks_dir`), saying its rank and its
kernel (pid, start time, kernel id). ``%gpumem --who`` reads them
(:func:`read_marks`) to name a worker and, once its kernel is gone, the orphan
it has become.

A mark counts only for the process that wrote it: pid *and* start time must
match, since pids are reused. A worker removes its mark as it leaves
(:func:`unmark`); a reader removes marks whose process is gone.

This module is imported by workers: no IPython, no torch.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass

from .kernel_files import connection_file
from .kernel_files import kernel_id as id_of

logger = logging.getLogger(__name__)

__all__ = ["WorkerMark", "marks_dir", "mark_worker", "unmark", "read_marks", "started", "DIR_ENV"]

DIR_ENV = "GPUMAGIC_MARKS_DIR"   # where marks go instead of the default (tests)
_mine: str | None = None          # this process's mark, once written


@dataclass(frozen=True)
class WorkerMark:
    """One worker as it described itself when it started."""
    pid: int
    started: float                  # its start time (psutil's create_time)
    rank: int
    world_size: int
    kernel_pid: int | None          # the kernel that started it
    kernel_started: float | None
    kernel_id: str | None           # from the kernel's connection file, where it has one


def marks_dir() -> str:
    """``$GPUMAGIC_MARKS_DIR``, else ``<tmp>/gpumagic-<uid>/workers``: one folder per user (mode 0700)."""
    return os.environ.get(DIR_ENV) or os.path.join(tempfile.gettempdir(), f"gpumagic-{os.getuid()}", "workers")


def started(pid: int) -> float | None:
    """The start time of process ``pid`` (None where it is gone: a zombie, dead but not yet reaped, included)."""
    import psutil
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


def mark_worker(rank: int, world_size: int, kernel_pid: int | None) -> str | None:
    """Leave this process's mark: rank ``rank`` of ``world_size``, started by kernel ``kernel_pid``.

    Returns the mark's path, or None where it could not be written (logged: the
    worker runs on, ``%gpumem --who`` will only not know it for one).
    """
    global _mine
    import psutil
    try:
        kernel_id = kernel_started = None
        if kernel_pid is not None:
            try:
                kernel = psutil.Process(kernel_pid)
                kernel_started, kernel_id = kernel.create_time(), id_of(connection_file(kernel.cmdline()))
            except psutil.Error:
                logger.debug("kernel %s is not readable; the mark names it by pid", kernel_pid, exc_info=True)
        me = os.getpid()
        mark = WorkerMark(pid=me, started=psutil.Process(me).create_time(), rank=int(rank),
                          world_size=int(world_size), kernel_pid=kernel_pid, kernel_started=kernel_started,
                          kernel_id=kernel_id)
        folder = marks_dir()
        os.makedirs(folder, mode=0o700, exist_ok=True)
        path = os.path.join(folder, f"{me}.json")
        temp = f"{path}.tmp"
        with open(temp, "w") as f:
            json.dump(asdict(mark), f)
        os.replace(temp, path)   # a reader never sees half a mark
        _mine = path
        return path
    except (OSError, psutil.Error):
        logger.debug("could not leave this worker's mark", exc_info=True)
        return None


def unmark() -> None:
    """Remove this process's mark (a worker leaving)."""
    global _mine
    path, _mine = _mine, None
    if path is None:
        return
    try:
        os.unlink(path)
    except OSError:
        logger.debug("the mark %s was already gone", path, exc_info=True)


def read_marks() -> dict[int, WorkerMark]:
    """The marks of live workers, by pid; marks whose process is gone (or whose pid is another
    process's now) are removed."""
    folder = marks_dir()
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    marks = {}
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(folder, name)
        mark = _read(path)
        if mark is None:
            continue
        now = started(mark.pid)
        if now is None or abs(now - mark.started) > 0.5:   # gone, or its pid reused by another process
            _remove(path)
            continue
        marks[mark.pid] = mark
    return marks


def _read(path: str) -> WorkerMark | None:
    try:
        with open(path) as f:
            return WorkerMark(**json.load(f))
    except (OSError, ValueError, TypeError):   # being replaced, or not a mark
        logger.debug("could not read the worker mark %s", path, exc_info=True)
        return None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        logger.debug("could not remove the stale mark %s", path, exc_info=True)
