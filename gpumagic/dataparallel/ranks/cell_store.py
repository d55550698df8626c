"""A ``--cluster`` rank's rendezvous store, open only while the ranks form and while a cell runs.

Rank 0's ``TCPStore`` is not authenticated: whoever reaches its port can read and write its keys.
The process group needs the store to form, and again when a cell forms groups of its own
(``new_group``, the pool's group formed again after a cell destroyed it, NCCL's communicators for
new pairs); between cells, never. So each engine forms the group on a :class:`CellStore`, a stand-in
that holds a real store only while the kernel says the ranks need one: rank 0 serves a new one
(:func:`serve`) on a port of its host before each cell, the others connect to it (:func:`connect`),
and once the cell has ended on every rank the kernel has rank 0 close it. Between cells nothing
listens. Where every engine is on one host, rank 0 serves on loopback only.

Runs in the engines: no IPython.
"""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

__all__ = ["CellStore", "serve", "connect", "LOOPBACK", "EVERY_INTERFACE"]

LOOPBACK = "127.0.0.1"
EVERY_INTERFACE = "0.0.0.0"


class CellStore(dist.Store):
    """The process group's store: the real one while :meth:`attach` holds it, refusing between cells.

    What is asked of it goes to the real store unchanged (keys, values, timeouts); dropping that store
    (:meth:`detach`) closes its connection, and on rank 0 the server with it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._store: dist.Store | None = None

    def attach(self, store: dist.Store) -> None:
        self._store = store

    def detach(self) -> None:
        self._store = None   # (the last reference: a TCPStore's socket, or its server, closes)

    @property
    def open(self) -> bool:
        return self._store is not None

    def _now(self) -> dist.Store:
        if self._store is None:
            raise RuntimeError("the --cluster rendezvous store is closed between cells (only a cell forms "
                               "process groups)")
        return self._store

    def set(self, key, value):
        return self._now().set(key, value)

    def get(self, key):
        return self._now().get(key)

    def add(self, key, amount):
        return self._now().add(key, amount)

    def compare_set(self, key, expected, desired):
        return self._now().compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        return self._now().wait(keys) if timeout is None else self._now().wait(keys, timeout)

    def check(self, keys):
        return self._now().check(keys)

    def delete_key(self, key):
        return self._now().delete_key(key)

    def num_keys(self):
        return self._now().num_keys()

    def set_timeout(self, timeout):
        return self._now().set_timeout(timeout)


def serve(host: str, world_size: int, timeout: float) -> dist.TCPStore:
    """Rank 0's store, on a free port of ``host`` (:data:`LOOPBACK` or :data:`EVERY_INTERFACE`)."""
    wait = datetime.timedelta(seconds=timeout)
    if host != LOOPBACK:
        return dist.TCPStore(host, 0, world_size, is_master=True, timeout=wait, wait_for_workers=False)
    # TCPStore's server listens on every interface whatever host it is given: on loopback only, it is
    # handed a socket bound there (and owns it from then on: it closes it)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        sock.listen()
        port = sock.getsockname()[1]
        return dist.TCPStore(LOOPBACK, port, world_size, is_master=True, timeout=wait, wait_for_workers=False,
                             master_listen_fd=sock.detach())


def connect(address: str, port: int, world_size: int, timeout: float) -> dist.TCPStore:
    """Another rank's connection to rank 0's store."""
    return dist.TCPStore(address, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout))
