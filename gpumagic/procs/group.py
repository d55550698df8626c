"""The kernel's side of a set of workers: start them, hear from them, end them.

A :class:`WorkerGroup` is one worker process per rank, each with one pipe
(:mod:`.worker` is the other end). ``%%sharedtrain`` starts a group for one
cell, each worker with its task; ``%%dataparallel`` keeps one as a persistent
pool (:mod:`.pool`) and sends it a task per cell. Either way the kernel hears
from its workers through :meth:`WorkerGroup.collect`: output, messages,
results, exceptions, and deaths (a process that ends without a word), and
ends them through :meth:`WorkerGroup.end` (:func:`~.teardown.end_processes`).

In a notebook::

    group = WorkerGroup(["cpu", "cpu"], name="example")
    group.start("spawn", [WorkerConfig(rank=r, world_size=2) for r in range(2)],
                first=["mypackage.tasks:train", meta, None])
    results, errors, pending = group.collect()
    group.end(wait=5.0)
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection as mpc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .display_relay import show, stop_open_bars
from .failures import death_info
from .start import start_process
from .teardown import STOP_GRACE, end_processes, interrupts_deferred

logger = logging.getLogger(__name__)

__all__ = ["Rank", "WorkerGroup"]


@dataclass
class _Collection:
    """What collecting a cell's results has gathered so far."""
    pending: set
    results: list
    errors: dict = field(default_factory=dict)
    first_error_at: float | None = None


@dataclass
class Rank:
    """One worker as the kernel sees it."""
    rank: int
    device: str
    pid: int | None = None
    process: Any = None            # multiprocessing.Process
    conn: Any = None               # the kernel's end of the worker's pipe
    info: dict = field(default_factory=dict)   # what the worker reported when it was ready
    exitcode: int | None = None    # once it has ended

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.exitcode is None and self.process.is_alive()


class WorkerGroup:
    """One worker process per entry of ``devices`` (``"cuda:1"``, ``"cpu"``...), named ``name``."""

    def __init__(self, devices, *, name: str = "workers"):
        self.devices = [str(d) for d in devices]
        if not self.devices:
            raise ValueError("a group needs at least one device")
        self.name = name
        self.ranks = [Rank(r, d) for r, d in enumerate(self.devices)]
        self._incoming: dict = {}

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def pids(self) -> list:
        return [r.pid for r in self.ranks]

    # ---- starting
    def start(self, method: str, configs: list, first: list | None = None, ranks=None) -> None:
        """Start a worker for each rank in ``ranks`` (default all) with ``configs[rank]``.

        ``first`` (``[task, meta, data]``) is each worker's one task: it runs it and exits.
        A worker that fails to start is ended with the others, and the error propagates; so is an
        interrupt, which is held while each process starts and raised between starts.
        """
        ctx = multiprocessing.get_context(method)
        from .worker import worker_main
        with interrupts_deferred() as interrupted:
            try:
                for r in (self.ranks if ranks is None else [self.ranks[i] for i in ranks]):
                    parent, child = ctx.Pipe(duplex=True)
                    args = (child, configs[r.rank]) if first is None else (child, configs[r.rank], list(first))
                    try:
                        r.process = start_process(ctx, worker_main, args, f"gpumagic-{self.name}-{r.rank}")
                    except BaseException:
                        parent.close()   # no worker at its other end: end() would not see it
                        raise
                    finally:
                        child.close()
                    r.conn, r.pid = parent, r.process.pid
                    if interrupted:
                        raise KeyboardInterrupt
            except BaseException:
                self.end()   # still holding Ctrl-C: the workers started so far all end
                raise

    def waitables(self, ranks) -> dict:
        """What to wait on for ``ranks``: each one's pipe, and its process's sentinel where there is
        one (it then wakes up too when the process dies without a word)."""
        waitables = {}
        for rank in ranks:
            r = self.ranks[rank]
            if r.conn is not None:
                waitables[r.conn] = rank
            if r.process is not None and r.exitcode is None:
                waitables[r.process.sentinel] = rank
        return waitables

    def wait_ready(self, deadline: float, what: str = "start") -> None:
        """Wait until every worker said it is ready; raises the first failure, or TimeoutError."""
        from .failures import primary_error
        pending = {r.rank for r in self.ranks}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: ranks {sorted(pending)} did not {what} in time")
            waitables = self.waitables(pending)
            for ready in mpc.wait(list(waitables), timeout=min(left, 0.5)):
                rank = waitables[ready]
                msg = self._receive(rank, ready)
                if msg is None:
                    info = self._death(rank)
                    info["message"] += " while starting"
                    raise primary_error({rank: info})
                if msg[0] == "ready":
                    self.ranks[rank].info = msg[1]
                    pending.discard(rank)
                elif msg[0] == "error":
                    msg[1]["message"] = f"while starting: {msg[1]['message']}"
                    raise primary_error({rank: msg[1]})

    # ---- hearing from the workers
    def collect(self, ranks=None, *, on_output: Callable | None = None, on_message: Callable | None = None,
                on_tick: Callable | None = None, grace: float = 0.5) -> tuple[list, dict, set]:
        """Read the workers' messages until each of ``ranks`` (default all) finished its task.

        ``on_output(rank, stream, text)`` gets what they print, ``on_message(rank, obj)`` what they
        send; ``on_tick()`` runs about every 0.1 s. Returns ``(results, errors, pending)``: each
        rank's ``(payload, data)`` (None where it failed), ``{rank: failure info}``, and the ranks
        still running when ``grace`` seconds after the first failure had passed. Progress bars the
        workers left open (a rank interrupted or failed mid-loop) are drawn stopped as it returns.
        """
        try:
            return self._collect(ranks, on_output, on_message, on_tick, grace)
        finally:
            stop_open_bars()

    def _collect(self, ranks, on_output, on_message, on_tick, grace: float) -> tuple[list, dict, set]:
        state = _Collection(set(range(self.world_size) if ranks is None else ranks), [None] * self.world_size)
        last_tick = 0.0
        while state.pending:
            waitables = self.waitables(state.pending)
            for ready in mpc.wait(list(waitables), timeout=0.1):
                rank = waitables[ready]
                if rank in state.pending and self._take(rank, ready, state, on_output, on_message):
                    state.pending.discard(rank)
                    if rank in state.errors and state.first_error_at is None:
                        state.first_error_at = time.monotonic()
            now = time.monotonic()
            if on_tick is not None and now - last_tick >= 0.1:
                last_tick = now
                on_tick()
            if state.first_error_at is not None and state.pending and now - state.first_error_at > grace:
                break
        return state.results, state.errors, state.pending

    def _take(self, rank: int, ready, state: _Collection, on_output, on_message) -> bool:
        """Take one message from ``rank``; True where the rank is finished (done, failed or gone)."""
        msg = self._receive(rank, ready)
        if msg is None:
            state.errors[rank] = self._death(rank)
            return True
        kind = msg[0]
        if kind == "out" and on_output is not None:
            on_output(rank, msg[1], msg[2])
        elif kind == "msg" and on_message is not None:
            on_message(rank, msg[1])
        elif kind in ("display", "clear"):
            show(msg)   # what the cell displayed on a rank whose output the cell shows
        elif kind == "done":
            self._result(rank, msg, state)
            return True
        elif kind == "error":
            state.errors[rank] = msg[1]
            return True
        return False

    def _result(self, rank: int, msg, state: _Collection) -> None:
        """A rank's result, with the bytes it sent after it."""
        try:
            data = self._incoming_for(rank).receive(self.ranks[rank].conn, msg[2])
        except (EOFError, OSError):
            # it died between its result and the result's bytes (killed while sending them)
            logger.debug("rank %s went away while sending its result", rank, exc_info=True)
            state.errors[rank] = self._death(rank)
        else:
            state.results[rank] = (msg[1], data)

    def _receive(self, rank: int, ready):
        """The next message from ``rank``, or None when it went away (closed pipe, or ended)."""
        r = self.ranks[rank]
        if r.process is not None and ready is r.process.sentinel and not r.conn.poll():
            return None
        try:
            return r.conn.recv()
        except (EOFError, OSError):
            return None

    def _death(self, rank: int) -> dict:
        r = self.ranks[rank]
        code = None
        if r.process is not None:
            r.process.join(1.0)
            code = r.process.exitcode
        return death_info(rank, r.pid, code)

    def _incoming_for(self, rank: int):
        incoming = self._incoming.get(rank)
        if incoming is None:
            from .bulk import Incoming
            incoming = self._incoming[rank] = Incoming()
        return incoming

    # ---- ending
    def end(self, wait: float = 0.0, grace: float = STOP_GRACE) -> list:
        """End every worker (see :func:`~.teardown.end_processes`), close the pipes; returns exit codes."""
        live = [r for r in self.ranks if r.process is not None]
        codes = end_processes([r.process for r in live], wait=wait, grace=grace)
        for r, code in zip(live, codes):
            r.exitcode = code
            r.process = None
        for r in self.ranks:
            if r.conn is not None:
                r.conn.close()
                r.conn = None
        for incoming in self._incoming.values():
            incoming.close()
        self._incoming.clear()
        return [r.exitcode for r in self.ranks]
