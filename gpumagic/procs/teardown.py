"""Ending worker processes, and making sure they end with the kernel.

One teardown for every worker gpumagic starts: let those that are leaving
leave, SIGTERM each worker's process group (so DataLoader workers it started
go too), wait a grace period, SIGKILL what is left, reap, close. Workers
themselves call :func:`die_with_parent` first thing (Linux
``PR_SET_PDEATHSIG``), and under a fork server, whose children outlive the
kernel by design, :func:`watch_kernel` too.

This module is imported by workers: no IPython, no torch.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

__all__ = ["die_with_parent", "watch_kernel", "signal_group", "end_processes", "no_interrupts",
           "interrupts_deferred", "STOP_GRACE"]

STOP_GRACE = 2.0    # seconds between SIGTERM and SIGKILL: well inside the 5 s an interrupt may take
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Make the parent's death kill this process (Linux ``PR_SET_PDEATHSIG``).

    If the parent already died before the call, exit at once: the signal would never come.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            logger.debug("PR_SET_PDEATHSIG unavailable", exc_info=True)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def watch_kernel() -> None:
    """End this worker and its process group when the kernel dies (for fork-server children).

    Their parent is the fork server, which stays up while any worker holds
    its "alive" pipe, so a parent-death signal alone would never come. The
    pipe multiprocessing keeps from the kernel (``parent_process().sentinel``)
    reaches end-of-file when the kernel dies, however it dies.
    """
    import multiprocessing
    import warnings
    from multiprocessing.connection import wait
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return

    def watch():
        try:
            wait([sentinel])
        except OSError:
            return  # the sentinel is unusable: the parent-death signal still ends us with the server
        signal_group(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="gpumagic-kernel-watch", daemon=True).start()
    # That thread only waits on a pipe: a DataLoader that forks its own workers from here is safe.
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                            category=DeprecationWarning)


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``'s process group (it leads one), else to ``pid`` alone."""
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass  # not a group leader (or already gone): the process alone
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def end_processes(processes, *, wait: float = 0.0, grace: float = STOP_GRACE) -> list:
    """End ``processes`` (multiprocessing ``Process`` objects); returns their exit codes.

    Waits up to ``wait`` seconds for them to exit by themselves (workers told
    to leave, or done with their task), then SIGTERMs each one's process
    group, waits ``grace`` seconds, SIGKILLs what is left, and reaps and
    closes them all. A negative code is the signal that ended the process.
    """
    procs = [p for p in processes if p is not None]
    deadline = time.monotonic() + wait
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    # exitcode set means reaped already: its pid may belong to someone else by now.
    running = [p for p in procs if p.exitcode is None]
    for p in running:
        signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in running:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in running:
        if p.exitcode is None:
            signal_group(p.pid, signal.SIGKILL)
            p.join(2.0)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is not None:
            p.close()
        else:  # pragma: no cover - a process that survived SIGKILL (uninterruptible sleep)
            logger.warning("worker process %s did not end after SIGKILL", p.pid)
    return codes


@contextmanager
def interrupts_deferred() -> Iterator[list[bool]]:
    """Hold Ctrl-C while processes start: yields a list that gets an entry per interrupt.

    An interrupt arriving inside ``fork()`` or ``Process.start()`` would be raised in the middle of
    multiprocessing's (or logging's) at-fork handlers, swallowed there, and leave a half-started
    worker; the caller checks the list between starts instead and stops cleanly.
    """
    pending: list[bool] = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: pending.append(True)) if main else None
    try:
        yield pending
    finally:
        if main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


@contextmanager
def no_interrupts() -> Iterator[None]:
    """Let cleanup finish even when the user presses interrupt again."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
