"""The fork server gpumagic keeps: fresh workers in milliseconds where fork is unsafe.

multiprocessing's fork server is a process started once that imports torch
(and what a first optimizer call imports) and then forks clean workers for
every later cell, so they skip torch's import. gpumagic starts it with a
preload list, remembers that it did (:func:`adopt`), and stops it on
``%unload_ext gpumagic`` (:func:`stop`). A server that something else in the
kernel started is left alone.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing import forkserver as _mp_forkserver

from .start import starting

logger = logging.getLogger(__name__)

__all__ = ["running", "prepare", "adopt", "start_in_background", "stop", "ours"]

_CLOSER = "forkserver"
_ours: int | None = None   # the pid of the server gpumagic started


def _server():
    return _mp_forkserver._forkserver


def _pid() -> int | None:
    return getattr(_server(), "_forkserver_pid", None)


def running() -> bool:
    """Whether multiprocessing's fork server is up in this kernel."""
    return _pid() is not None


def ours() -> int | None:
    """The pid of the fork server gpumagic started, if it still runs."""
    return _ours


def prepare(ctx, preload: list[str]) -> int | None:
    """Have the server, if it is not running yet, import ``preload`` when it starts.

    The preload list only matters when the server starts: one that something
    else started keeps its own, and workers then import what they need
    themselves. Returns the running server's pid (None: none yet).
    """
    pid = _pid()
    if pid is None:
        ctx.set_forkserver_preload(list(preload))
    return pid


def adopt(before: int | None) -> None:
    """Remember a server that has just started, to stop it on ``%unload_ext gpumagic``.

    Ours when none ran before, or when ours had died and multiprocessing
    started another (with the same preload list).
    """
    global _ours
    from .. import session
    pid = _pid()
    if pid is not None and pid != before and (before is None or before == _ours):
        _ours = pid
        session.register_closer(_CLOSER, stop)


def start_in_background(preload: list[str]) -> None:
    """Start the server now: it imports torch while the notebook goes on."""
    try:
        before = prepare(multiprocessing.get_context("forkserver"), preload)
        with starting("forkserver"):
            _mp_forkserver.ensure_running()
        adopt(before)
    except Exception:  # later cells start it when they need it, and report what goes wrong then
        logger.debug("the fork server did not start in the background", exc_info=True)


def stop(timeout: float = 2.0) -> bool:
    """Stop the fork server gpumagic started, if it still runs; True if one was stopped.

    Closing its "alive" pipe asks it to exit once no worker holds that pipe;
    one that is still up after ``timeout`` is terminated.
    """
    global _ours
    from .. import session
    server = _server()
    pid, _ours = _ours, None
    session.unregister_closer(_CLOSER)
    if pid is None or _pid() != pid:
        return False
    with getattr(server, "_lock", threading.Lock()):
        alive_fd = server._forkserver_alive_fd
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    try:
        os.close(alive_fd)
    except (OSError, TypeError):
        logger.debug("the fork server's alive pipe was already closed", exc_info=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGTERM)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass  # it went meanwhile
            return True
        time.sleep(0.02)
