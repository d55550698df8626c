"""Where a pool's ranks meet to form their ``torch.distributed`` process group.

A pool on this machine meets in a ``FileStore`` inside a directory only this
user can enter (0700): unlike a TCP port, even on 127.0.0.1, nothing another
local user could connect to or write in. A pool with ranks on other machines
needs a ``TCPStore``, served by the kernel on the socket it binds (torch's own
would listen on every interface).

The kernel's side makes the store (:func:`private_file_store`,
:func:`serve_tcp`); each rank calls :func:`connect` with what it was given,
``("file", path)`` or ``("tcp", address, port)``.

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
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["PrivateFileStore", "private_file_store", "serve_tcp", "connect", "CONNECT_TIMEOUT", "free_loopback_port"]

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


class TcpStore:
    """A ``TCPStore`` the kernel serves on ``address`` (for pools with ranks on other machines)."""

    def __init__(self, address: str, port: int, world_size: int, timeout: float):
        import torch.distributed as dist
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
            sock.listen(128)
            self.address, self.port = address, sock.getsockname()[1]
            # The kernel is one more client of its own store: world_size + 1.
            self.store: Any = dist.TCPStore(address, self.port, world_size + 1, True,
                                       timeout=datetime.timedelta(seconds=timeout),
                                       wait_for_workers=False, master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store owns the descriptor now, and closes it when it goes

    @property
    def rendezvous(self) -> tuple:
        return ("tcp", self.address, self.port)

    def describe(self) -> str:
        return f"{self.address}:{self.port}"

    def close(self) -> None:
        self.store = None


def serve_tcp(address: str, port: int, world_size: int, timeout: float) -> TcpStore:
    """Serve a ``TCPStore`` on ``address:port`` (0: a free port) for ``world_size`` ranks."""
    return TcpStore(address, port, world_size, timeout)


def connect(rendezvous: tuple, world_size: int):
    """In a rank: the store named by ``rendezvous``, ``("file", path)`` or ``("tcp", address, port)``."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=CONNECT_TIMEOUT)
    if rendezvous[0] == "file":
        store = dist.FileStore(rendezvous[1], world_size)
        store.set_timeout(timeout)
        return store
    if rendezvous[0] == "tcp":
        _, address, port = rendezvous
        return dist.TCPStore(address, port, world_size + 1, False, timeout=timeout)
    raise ValueError(f"unknown rendezvous {rendezvous!r}: expected ('file', path) or ('tcp', address, port)")


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for code that forms its own group via ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
