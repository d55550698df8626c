"""DataLoader workers inside a gpumagic worker: forked, gone with it, printing through it.

A worker started by ``spawn`` or a fork server inherits that start method
(multiprocessing passes it on), so a cell's ``DataLoader(num_workers=2)``
would start fresh interpreters every epoch, each importing torch again
(seconds an epoch), and could not pickle a Dataset class defined in the
notebook. In the kernel those workers are forked; :func:`fork_from_here`
makes them forked in workers too, which is what PyTorch does by default in a
script on Linux (CUDA in the forking process is fine; CUDA in the forked
child is not, there as here). A DataLoader given its own
``multiprocessing_context`` keeps it.

Every child forked from the worker then

- dies with it (``PR_SET_PDEATHSIG``): a worker killed with the kernel takes
  its loader workers along, instead of leaving them to ``init``;
- prints into a pipe the worker relays to its own ``sys.stdout`` and
  ``sys.stderr``: the kernel's connection is the worker's alone (two processes
  writing one message stream could interleave and garble it).

Forked queues unlink their semaphores at once, so nothing is left in
``/dev/shm`` when a worker is killed.

This module is imported by workers: no IPython, no torch.
"""
from __future__ import annotations

import codecs
import io
import logging
import multiprocessing
import os
import selectors
import signal
import sys
import threading
import warnings

from .teardown import die_with_parent

logger = logging.getLogger(__name__)

__all__ = ["fork_from_here"]

_relay: _OutputRelay | None = None


def fork_from_here() -> None:
    """Fork this worker's DataLoader workers (and other children), as the kernel does.

    Call once, early in the worker process.
    """
    global _relay
    if _relay is not None or "fork" not in multiprocessing.get_all_start_methods():
        return
    multiprocessing.set_start_method("fork", force=True)
    # The threads a worker runs (torch.distributed's, the relay's) hold no lock a forked loader
    # worker takes: the warning that forking a threaded process may deadlock does not apply.
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                            category=DeprecationWarning)
    _relay = _OutputRelay()
    os.register_at_fork(before=_relay.start, after_in_child=_relay.in_child)


class _OutputRelay:
    """Two pipes children write to, and a thread that copies them to this process's streams."""

    def __init__(self) -> None:
        self.write_ends: dict[str, int] = {}
        self.worker_pid = os.getpid()
        self.forking_pid = self.worker_pid
        self._lock = threading.Lock()

    def start(self) -> None:
        """Before a fork: make the pipes and the thread, the first time."""
        self.forking_pid = os.getpid()   # a loader worker that forks in turn is the parent then
        if self.write_ends or self.forking_pid != self.worker_pid:
            return
        with self._lock:
            if self.write_ends:
                return
            selector = selectors.DefaultSelector()
            for stream in ("stdout", "stderr"):
                read_end, write_end = os.pipe()
                os.set_inheritable(read_end, False)
                selector.register(read_end, selectors.EVENT_READ, stream)
                self.write_ends[stream] = write_end
            threading.Thread(target=self._copy, args=(selector,), name="gpumagic-child-output",
                             daemon=True).start()

    def in_child(self) -> None:
        """After a fork, in the child: die with the parent; print into the pipes."""
        die_with_parent(self.forking_pid, signal.SIGKILL)
        for stream, fd in self.write_ends.items():
            raw = io.FileIO(fd, "w", closefd=False)
            # Whole lines, each in one write: several children share the pipe, and a write of up
            # to PIPE_BUF bytes is not interleaved with another's (print writes "\n" separately).
            setattr(sys, stream, io.TextIOWrapper(raw, encoding="utf-8", errors="replace", line_buffering=True))

    @staticmethod
    def _copy(selector: selectors.BaseSelector) -> None:
        decoders = {stream: codecs.getincrementaldecoder("utf-8")("replace") for stream in ("stdout", "stderr")}
        while True:
            for key, _ in selector.select():
                stream = key.data
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fd)
                    continue
                text = decoders[stream].decode(data)
                if not text:
                    continue
                try:
                    # The worker's stream of the moment: forwarded to the kernel while a task
                    # runs (with the rank's prefix), the worker's own output otherwise.
                    target = getattr(sys, stream)
                    target.write(text)
                    target.flush()
                except Exception:  # a lost line must not end the relay
                    logger.debug("could not relay a child's %s", stream, exc_info=True)
