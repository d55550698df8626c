"""What a worker writes below Python (C++ warnings, NCCL, a subprocess, ``os.write(1, ...)``), sent as
its prints are.

A worker's ``sys.stdout`` is forwarded to the kernel (:class:`~.worker.ForwardedStream`), but its
file descriptors 1 and 2 are the kernel's, which ipykernel copies into the running cell: every
rank's C-level output would reach the cell, unprefixed, even where only rank 0's prints should
show. Here descriptors 1 and 2 become pipes that a thread reads and hands to ``on_text`` (which
forwards it as the rank's output, or drops it as it drops the rank's prints).
:meth:`DescriptorOutput.drain` waits until everything written so far has been handed over, so a
task's output arrives before its result.

Runs in the workers::

    output = DescriptorOutput(lambda stream, text: ...)
    output.start()
    ...                       # the task runs
    output.drain()            # before the result is sent
"""
from __future__ import annotations

import codecs
import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["DescriptorOutput"]

# Written into a pipe to learn that the reader has passed everything before it. A write this short is
# atomic on a pipe, so no other writer's bytes land inside it.
_MARK = b"\x1b]gpumagic-drained\x07"
_PIPE_BYTES = 1 << 20   # a burst this large fits before a writer blocks on the reader
_F_SETPIPE_SZ = 1031    # Linux


class DescriptorOutput:
    """Descriptors 1 and 2 of this process read by threads; ``on_text(stream, text)`` gets what they
    carry (``stream`` is ``"stdout"`` or ``"stderr"``)."""

    def __init__(self, on_text: Callable[[str, str], None]):
        self.on_text = on_text
        self.readers: list[_Reader] = []

    def start(self) -> None:
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            try:
                self.readers.append(_Reader(fd, stream, self.on_text))
            except OSError:   # no such descriptor (closed by the parent): nothing to read
                logger.debug("descriptor %d stays as it is", fd, exc_info=True)

    def drain(self, timeout: float = 2.0) -> None:
        """Hand over what was written so far (C's buffers flushed first)."""
        for stream in (sys.__stdout__, sys.__stderr__):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                logger.debug("a closed standard stream", exc_info=True)
        try:
            ctypes.CDLL(None).fflush(None)
        except (OSError, AttributeError):
            logger.debug("no libc fflush", exc_info=True)
        for reader in self.readers:
            reader.drain(timeout)

    def original(self, stream: str) -> int | None:
        """The descriptor ``stream`` went to before :meth:`start` (the kernel's), for output that
        belongs to no task."""
        return next((r.saved for r in self.readers if r.stream == stream), None)


class _Reader:
    def __init__(self, fd: int, stream: str, on_text: Callable[[str, str], None]):
        self.fd, self.stream, self.on_text = fd, stream, on_text
        self.saved = os.dup(fd)
        read_end, write_end = os.pipe()
        try:
            import fcntl
            fcntl.fcntl(write_end, _F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:   # above the system's limit: the default size only makes bursts wait
            logger.debug("pipe size left as it is", exc_info=True)
        os.dup2(write_end, fd)
        os.close(write_end)
        self.read_end = read_end
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.drained = threading.Event()
        threading.Thread(target=self._run, name=f"gpumagic-{stream}", daemon=True).start()

    def drain(self, timeout: float) -> None:
        self.drained.clear()
        try:
            os.write(self.fd, _MARK)
        except OSError:
            logger.debug("descriptor %d cannot be written", self.fd, exc_info=True)
            return
        if not self.drained.wait(timeout):
            logger.debug("descriptor %d not drained within %.1f s", self.fd, timeout)

    def _run(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.read_end, 65536)
            except OSError:
                return
            if not chunk:
                return
            pending += chunk
            while (at := pending.find(_MARK)) >= 0:
                self._hand_over(pending[:at])
                pending = pending[at + len(_MARK):]
                self.drained.set()
            keep = _partial_mark(pending)
            self._hand_over(pending[:len(pending) - keep])
            pending = pending[len(pending) - keep:]

    def _hand_over(self, data: bytes) -> None:
        text = self.decoder.decode(data)
        if text:
            try:
                self.on_text(self.stream, text)
            except Exception:  # the reader must go on, or writers would block
                logger.debug("output of descriptor %d lost", self.fd, exc_info=True)


def _partial_mark(data: bytes) -> int:
    """How many bytes at the end of ``data`` may be the start of a mark still being read."""
    for n in range(min(len(_MARK) - 1, len(data)), 0, -1):
        if data.endswith(_MARK[:n]):
            return n
    return 0
