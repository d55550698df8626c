"""Where a pool's ranks meet to form their ``torch.distributed`` process group.

A pool on this machine meets in a ``FileStore`` inside a directory only this
user can enter (0700): unlike a TCP port, even on 127.0.0.1, nothing another
local user could connect to or write in. (Ranks on other machines are
ipyparallel engines, which meet at rank 0's ``TCPStore``:
:mod:`gpumagic.dataparallel.engine`.)

The kernel's side makes the store (:func:`private_file_store`); each rank
calls :func:`connect` with what it was given, ``("file", path)``.

This module is imported by workers: no IPython.
"""
from __future__ import annotations

import datetime
import glob
import logging
import os
import shutil
import socket
import tempfile

logger = logging.getLogger(__name__)

__all__ = ["PrivateFileStore", "private_file_store", "connect", "CONNECT_TIMEOUT", "free_loopback_port"]

CONNECT_TIMEOUT = 120.0   # seconds a rank waits for the others at the rendezvous
_PREFIX = "gpumagic-rendezvous-"


class PrivateFileStore:
    """A directory only this user can enter, and the store file ranks will create in it."""

    def __init__(self) -> None:
        # mkdtemp makes the directory 0700, with a name nobody can take first.
        self.directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
        self.path = os.path.join(self.directory, "store")

    @property
    def rendezvous(self) -> tuple:
        return ("file", self.path)

    def describe(self) -> str:
        return f"file {self.path}"

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def private_file_store() -> PrivateFileStore:
    """A new private store, after removing those of kernels that died without removing theirs."""
    _sweep_stale()
    return PrivateFileStore()


def _sweep_stale() -> None:
    # A kernel killed outright (SIGKILL) cannot remove its directory: the next one does.
    uid = os.getuid()
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), f"{_PREFIX}*-*")):
        try:
            pid = int(os.path.basename(directory)[len(_PREFIX):].split("-", 1)[0])
            if os.stat(directory).st_uid != uid or _running(pid):
                continue
        except (ValueError, OSError):
            continue
        shutil.rmtree(directory, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def connect(rendezvous: tuple, world_size: int):
    """In a rank: the store named by ``rendezvous``, ``("file", path)``."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=CONNECT_TIMEOUT)
    if rendezvous[0] == "file":
        store = dist.FileStore(rendezvous[1], world_size)
        store.set_timeout(timeout)
        return store
    raise ValueError(f"unknown rendezvous {rendezvous!r}: expected ('file', path)")


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for code that forms its own group via ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
