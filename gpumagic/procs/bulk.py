"""Bulk bytes between the kernel and its workers: anonymous shared memory, or the pipe.

A pipe moves a few hundred MB/s; a ResNet-50 and its optimizer state are
200 MB. So the bytes of tensors travel through a ``memfd`` (Linux anonymous
shared memory): the sender writes them once into its mapping, every receiver
maps the same pages, and the file descriptor itself is passed the first time
(and again only when the buffer grows): over the control pipe
(:meth:`Outgoing.send`), or with the process's start arguments
(:meth:`Outgoing.handle`). A memfd has no name in ``/dev/shm`` and is freed
when the last process holding it exits, however it exits: nothing can leak.

Where file descriptors cannot travel (a worker on another machine, a system
without ``memfd_create``), the same bytes go through the pipe.

One message carries a *bulk reference*, one of::

    None                          no bytes
    ("bytes", n)                  n bytes follow with send_bytes
    ("shm", gen, size, n, new)    the first n bytes of the sender's buffer gen;
                                  new: its descriptor follows (send_handle)
"""
from __future__ import annotations

import mmap
import os
from multiprocessing import reduction

import torch

__all__ = ["Outgoing", "Incoming", "BulkHandle", "shm_supported", "anonymous_memory", "share_in_place"]

_PAGE = mmap.PAGESIZE


def shm_supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(reduction, "send_handle")


def anonymous_memory(size: int) -> int:
    """A descriptor of ``size`` bytes of anonymous shared memory (freed with its last descriptor)."""
    fd = os.memfd_create("gpumagic-bulk", getattr(os, "MFD_CLOEXEC", 0))
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(fd: int, size: int) -> torch.Tensor:
    """``size`` bytes of ``fd`` as a uint8 tensor whose views say ``is_shared()``, as torch's own do."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared_fd_cpu", None)
    if new_shared is not None:
        # torch keeps its own duplicate of the descriptor while the storage lives.
        return torch.empty(0, dtype=torch.uint8).set_(new_shared(fd, size))
    return torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)  # pragma: no cover - older torch


def share_in_place(tensors) -> None:
    """Move CPU tensors into one piece of anonymous shared memory, in place (the same tensor
    objects, ``is_shared()`` afterwards; tensors viewing one storage keep doing so).

    Like ``Tensor.share_memory_()``, but a ``memfd``: nothing in ``/dev/shm``, whose size a
    container may cap at 64 MB, and one descriptor for all of them. Each storage is copied and
    let go in turn, so the peak is the tensors plus their largest storage. Other processes map
    it through torch's reducers (``multiprocessing``), as they would ``share_memory_()``'s.
    """
    storages: dict[int, list] = {}
    seen: set[int] = set()
    for t in tensors:
        # Once per object: a tied weight listed twice (a state_dict names it under both its names)
        # must not be moved twice, the second time from its new place.
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.device.type == "cpu" and not t.is_shared() and t.untyped_storage().nbytes():
            storages.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    if not storages:
        return
    offsets, total = {}, 0
    for ptr, group in storages.items():
        offsets[ptr] = total
        total += -(-group[0].untyped_storage().nbytes() // 64) * 64
    fd = anonymous_memory(total)
    try:
        home = _map(fd, total)
    finally:
        os.close(fd)   # the mapping keeps its own descriptor
    whole = home.untyped_storage()
    with torch.no_grad():
        for ptr, group in storages.items():
            old = group[0].untyped_storage()
            start = offsets[ptr]
            home[start: start + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for t in group:
                size = t.element_size()
                moved = torch.empty(0, dtype=t.dtype).set_(whole, (start + t.storage_offset() * size) // size,
                                                           t.shape, t.stride())
                t.data = moved


class Outgoing:
    """The sender's buffer: ``get(n)`` gives a uint8 tensor to fill; ``send`` or ``handle`` passes it on."""

    def __init__(self, shared: bool = True):
        self.shared = shared and shm_supported()
        self.gen = 0
        self.size = 0
        self._fd: int | None = None
        self._tensor = torch.empty(0, dtype=torch.uint8)
        self._peers_have: dict = {}   # peer key -> generation it has mapped

    def get(self, nbytes: int) -> torch.Tensor:
        if nbytes > self._tensor.numel():
            self._grow(nbytes)
        return self._tensor[:nbytes]

    def _grow(self, nbytes: int) -> None:
        size = -(-int(nbytes * 1.25 + 4096) // _PAGE) * _PAGE   # headroom: a slightly larger next cell fits
        if not self.shared:
            self._tensor = torch.empty(size, dtype=torch.uint8)
            self.size = size
            return
        fd = anonymous_memory(size)
        try:
            mapped = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        if self._fd is not None:
            os.close(self._fd)
        # The old mapping goes away with the last tensor viewing it.
        self._fd, self._tensor, self.size = fd, mapped, size
        self.gen += 1

    def owns(self, data) -> bool:
        return (isinstance(data, torch.Tensor) and data.numel() > 0 and self._tensor.numel() > 0
                and data.data_ptr() == self._tensor.data_ptr())

    def reference(self, data, peer, can_share: bool):
        """The bulk reference for sending ``data`` to ``peer``, and whether its descriptor must follow."""
        if data is None:
            return None, False
        n = data.numel() if isinstance(data, torch.Tensor) else len(memoryview(data).cast("B"))
        if n == 0:
            return None, False
        if can_share and self.shared and self.owns(data):
            new = self._peers_have.get(peer) != self.gen
            return ("shm", self.gen, self.size, n, new), new
        return ("bytes", n), False

    def send(self, conn, ref, new_fd: bool, data, peer, destination_pid: int) -> None:
        """Send what follows a message carrying ``ref``: the descriptor, or the bytes."""
        if ref is None:
            return
        if ref[0] == "shm":
            if new_fd and self._fd is not None:
                reduction.send_handle(conn, self._fd, destination_pid)
                self._peers_have[peer] = self.gen
            return
        conn.send_bytes(data.numpy() if isinstance(data, torch.Tensor) else data)

    def handle(self, data) -> BulkHandle | None:
        """``data`` (None, bytes, or a tensor from :meth:`get`) as an argument for a process being
        started: the descriptor travels with the process's start (fork, spawn or fork server)."""
        if data is None:
            return None
        if self.shared and self.owns(data):
            return BulkHandle(self._fd, self.size, data.numel())
        return BulkHandle(None, 0, 0, bytes(data.numpy() if isinstance(data, torch.Tensor) else data))

    def forget(self, peer) -> None:
        self._peers_have.pop(peer, None)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._tensor = torch.empty(0, dtype=torch.uint8)
        self.size = 0
        self._peers_have.clear()


class BulkHandle:
    """Bulk bytes given to a process as it starts: a shared-memory descriptor, or the bytes themselves.

    Under spawn and the fork server the descriptor is pickled with the
    process's arguments as one of its own (``DupFd``); under fork it is inherited.
    """

    def __init__(self, fd: int | None, size: int, nbytes: int, data: bytes | None = None):
        self.fd, self.size, self.nbytes, self.data = fd, size, nbytes, data

    def __reduce__(self):
        if self.fd is None:
            return (BulkHandle, (None, 0, 0, self.data))
        return (BulkHandle._rebuild, (reduction.DupFd(self.fd), self.size, self.nbytes))

    @staticmethod
    def _rebuild(dup, size: int, nbytes: int) -> BulkHandle:
        return BulkHandle(dup.detach(), size, nbytes)

    def open(self) -> torch.Tensor:
        """In the worker: the bytes as a uint8 tensor (mapped, not copied); the descriptor is closed."""
        if self.fd is None:
            return torch.frombuffer(bytearray(self.data or b""), dtype=torch.uint8)
        try:
            return _map(self.fd, self.size)[: self.nbytes]
        finally:
            os.close(self.fd)
            self.fd = None


class Incoming:
    """The receiver's side for one sender: its mapped buffer, or a scratch buffer for bytes."""

    def __init__(self):
        self.gen = None
        self._mapped = torch.empty(0, dtype=torch.uint8)
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def receive(self, conn, ref) -> torch.Tensor | None:
        """Read what follows a message carrying ``ref``; returns a uint8 tensor (valid until the next)."""
        if ref is None:
            return None
        if ref[0] == "shm":
            _, gen, size, n, new = ref
            if new:
                fd = reduction.recv_handle(conn)
                try:
                    self._mapped = _map(fd, size)
                finally:
                    os.close(fd)
                self.gen = gen
            if self.gen != gen:
                raise RuntimeError(f"bulk buffer {gen} was never received (have {self.gen})")
            return self._mapped[:n]
        n = ref[1]
        if self._scratch.numel() < n:
            self._scratch = torch.empty(int(n * 1.25) + 4096, dtype=torch.uint8)
        view = self._scratch[:n]
        conn.recv_bytes_into(view.numpy())
        return view

    def close(self) -> None:
        self._mapped = torch.empty(0, dtype=torch.uint8)
        self._scratch = torch.empty(0, dtype=torch.uint8)
