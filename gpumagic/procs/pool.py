"""A persistent pool of worker processes, one per device, joined in a process group.

The first ``%%dataparallel`` cell starts the pool; later cells reuse it, so
only the first pays for starting Python, importing torch, creating CUDA
contexts and connecting NCCL. Workers are started with ``spawn`` (a fresh
interpreter: safe even after the kernel has used CUDA, unlike ``fork``) and
are the :mod:`.worker` main loop: they die with the kernel, ignore Ctrl-C
(the kernel stops them) and lead their own process group, so that ending one
also ends the DataLoader workers it started.

The ranks meet in a ``FileStore`` in a directory only this user can enter
(:mod:`.rendezvous`);
gloo and NCCL are told to use the loopback interface. Bulk bytes travel through anonymous
shared memory (:mod:`.bulk`): nothing has a name in ``/dev/shm``.

In a notebook::

    pool = WorkerPool(["cuda:0", "cuda:1"], backend="nccl").start()
    results = pool.run("mypackage.tasks:train", meta)
    pool.stop()
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any

from .. import session
from .cpus import usable_cpus
from .failures import primary_error, same_failure
from .follow_kernel import KernelView
from .group import WorkerGroup
from .teardown import interrupts_deferred
from .worker import WorkerConfig

logger = logging.getLogger(__name__)

__all__ = ["WorkerPool", "get_pool", "stop_pool", "current_pool", "LOOPBACK"]

LOOPBACK = "127.0.0.1"


class WorkerPool(WorkerGroup):
    """A persistent :class:`~.group.WorkerGroup`: one spawned worker per entry of ``devices``.

    ``backend`` ("nccl", "gloo" or None for no process group) and ``timeout``
    (seconds a collective may wait) go to ``torch.distributed``. ``env`` is
    added to every worker's environment; ``preload`` are modules each worker
    imports while starting (what a first task would import anyway).
    The rendezvous is a private file store and the process group listens on
    loopback only (ranks on other machines are ipyparallel engines:
    :mod:`gpumagic.dataparallel.ranks.cluster`).
    """

    def __init__(self, devices, backend: str | None = "gloo", *, timeout: float = 1800.0,
                 name: str = "pool", env: dict | None = None, start_timeout: float = 180.0, preload: tuple = ()):
        super().__init__([str(d) for d in devices], name=name)
        self.backend = backend
        self.timeout = float(timeout)
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.preload = tuple(preload)
        self.started_at: float | None = None
        self.start_seconds: float | None = None
        self.tasks_run = 0
        self.kernel_view: KernelView | None = None   # the kernel's directory and environment, as the workers know it
        self.state = "new"              # new | running | stopped | dead
        self._store: Any = None      # the rendezvous (see .rendezvous) while running
        self._outgoing: Any = None   # the kernel's bulk buffer, made on first use
        self._lock = threading.Lock()
        self._busy = False

    @property
    def key(self) -> tuple:
        return (tuple(self.devices), self.backend)

    def serves(self, devices, backend, timeout: float | None = None) -> bool:
        """Whether a task asking for these devices and backend (and ``timeout``) runs on this pool as it is."""
        return self.alive and self.key == (tuple(str(d) for d in devices), backend) \
            and timeout in (None, self.timeout)

    @property
    def alive(self) -> bool:
        return self.state == "running" and all(r.alive for r in self.ranks)

    # ---- lifecycle
    def start(self) -> WorkerPool:  # type: ignore[override]
        """Start every worker and wait until all have joined the process group."""
        if self.state != "new":
            raise RuntimeError(f"pool already {self.state}")
        t0 = time.monotonic()
        self._store = self._serve_rendezvous() if self.backend else None
        _live_pools.add(self)
        self.state = "running"
        try:
            configs = [self._config(r.rank, r.device) for r in self.ranks]
            self.kernel_view = KernelView()   # (spawned workers start in the kernel's directory and environment)
            super().start("spawn", configs)
            self.wait_ready(t0 + self.start_timeout, what=f"start within {self.start_timeout:.0f} s")
        except BaseException:
            self.kill()
            raise
        self.started_at = time.time()
        self.start_seconds = time.monotonic() - t0
        return self

    def _config(self, rank: int, device: str) -> WorkerConfig:
        cpu_ranks = sum(1 for d in self.devices if d == "cpu")
        cores = usable_cpus()
        return WorkerConfig(rank=rank, world_size=self.world_size, device=device, method="spawn",
                            parent_pid=os.getpid(), backend=self.backend,
                            rendezvous=self._store.rendezvous if self._store is not None else None,
                            timeout=self.timeout, env=self._worker_env(), preload=self.preload, bind_cpus=True,
                            threads=max(1, cores // max(1, cpu_ranks)) if device == "cpu" else None)

    def _serve_rendezvous(self):
        from .rendezvous import private_file_store
        return private_file_store()

    def _worker_env(self) -> dict:
        # gloo and NCCL would otherwise pick the host's first interface and listen on it.
        env = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        env.update(self.env)
        return env

    def stop(self, timeout: float = 3.0) -> None:
        """Ask every worker to leave, then end them (SIGTERM, then SIGKILL, after ``timeout``)."""
        if self.state == "new" or (self.state != "running" and not any(r.process for r in self.ranks)):
            return
        for r in self.ranks:
            if r.conn is not None and r.alive:
                try:
                    r.conn.send(("stop",))
                except OSError:
                    logger.debug("rank %s is already gone", r.rank, exc_info=True)
        self._close("stopped", wait=timeout)

    def kill(self) -> None:
        """End every worker (and its children) now: for interrupts and failures."""
        self._close("dead", wait=0.0)

    def _close(self, state: str, wait: float) -> None:
        # An interrupt (often the user's second) is held until the ranks are gone: cut short, it
        # would leave a rank that ignores SIGTERM running the cell in a pool still marked running,
        # and the next cell would wait on it forever.
        with interrupts_deferred() as interrupted:
            self.end(wait=wait)
            if self._store is not None:
                self._store.close()
            self._store = None
            if self._outgoing is not None:
                self._outgoing.close()
                self._outgoing = None
            self.state = state
            _live_pools.discard(self)
        if interrupted:
            raise KeyboardInterrupt

    # ---- running tasks
    @property
    def outgoing(self):
        """The kernel's bulk buffer (shared memory): fill ``outgoing.get(n)`` and pass it to :meth:`run`."""
        if self._outgoing is None:
            from .bulk import Outgoing
            self._outgoing = Outgoing(shared=True)
        return self._outgoing

    def run(self, task: str, meta=None, data=None, *, on_output=None, on_message=None,
            on_tick=None, grace: float = 0.5) -> list:
        """Run ``task`` on every rank; returns each rank's ``(payload, data)``.

        ``data`` is a byte-like object sent to every rank after ``meta`` (one
        copy in shared memory for all local ranks). Callbacks are those of
        :meth:`~.group.WorkerGroup.collect`. An exception on any rank raises
        :class:`~gpumagic.errors.WorkerError` for it. When every rank raised the
        same exception at the same line, the ranks made the same collective
        calls and the pool is kept; otherwise it is ended (ranks may be stuck in
        a collective) and the next call needs a new pool, as after an interrupt.
        """
        from ..errors import WorkerDied
        if not self.alive:
            raise WorkerDied(-1, None, "WorkerDied", f"the {self.name} pool is not running")
        with self._lock:
            if self._busy:
                raise RuntimeError(f"the {self.name} pool is already running a task")
            self._busy = True
        try:
            senders = self._send_task(task, meta, data)
            results, errors, pending = self.collect(on_output=on_output, on_message=on_message,
                                                    on_tick=on_tick, grace=grace)
            for t in senders:
                t.join(timeout=5.0)
        except BaseException:
            self.kill()   # an interrupt, or a failure while listening: ranks may be mid-task
            raise
        finally:
            self._busy = False
            self.tasks_run += 1
        if errors:
            if pending or not same_failure(errors, self.world_size):
                self.kill()
            raise primary_error(errors, still_running=pending)
        return results

    def _send_task(self, task: str, meta, data) -> list:
        out = self.outgoing
        senders = []
        # %cd, sys.path and %env since the last task: each rank follows the kernel there first
        changes = self.kernel_view.changes() if self.kernel_view is not None else None
        for r in self.ranks:
            ref, new = out.reference(data, peer=(r.rank, r.pid), can_share=True)
            r.conn.send(("run", task, meta, ref, changes))
            if ref is not None and ref[0] == "bytes":
                # Socket writes release the GIL: such ranks receive at once.
                t = threading.Thread(target=_send_bytes, args=(out, r, ref, data), daemon=True)
                t.start()
                senders.append(t)
            else:
                out.send(r.conn, ref, new, data, (r.rank, r.pid), r.pid)
        return senders

    # ---- status
    def status(self) -> dict:
        """Pool and per-rank facts: state, backend, rendezvous, pids, devices, memory."""
        import psutil
        ranks = []
        for r in self.ranks:
            alive = r.alive
            rss = None
            if alive:
                try:
                    rss = psutil.Process(r.pid).memory_info().rss
                except psutil.Error:
                    logger.debug("no memory figure for rank %s", r.rank, exc_info=True)
            ranks.append({"rank": r.rank, "device": r.device, "pid": r.pid, "alive": alive, "rss": rss,
                          "device_name": r.info.get("device_name"), "host": r.info.get("host")})
        return {"name": self.name, "state": self.state if self.state != "running" or self.alive else "broken",
                "backend": self.backend, "world_size": self.world_size,
                "rendezvous": self._store.describe() if self._store is not None else None,
                "started_at": self.started_at, "start_seconds": self.start_seconds,
                "tasks_run": self.tasks_run, "ranks": ranks}


def _send_bytes(out, r, ref, data) -> None:
    try:
        out.send(r.conn, ref, False, data, (r.rank, r.pid), r.pid)
    except OSError:
        logger.debug("rank %s died while receiving; the waiting loop reports it", r.rank, exc_info=True)


# ---- pools by name (the magics keep one each), stopped on %unload_ext and at exit

_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
_pools: dict[str, WorkerPool] = {}


def current_pool(name: str) -> WorkerPool | None:
    return _pools.get(name)


def get_pool(name: str, devices, backend, **kwargs) -> tuple[WorkerPool, bool]:
    """The running pool ``name`` for these devices and backend, started if needed.

    Returns ``(pool, started)``; a pool with other devices, or a dead one,
    is stopped and replaced.
    """
    pool = _pools.get(name)
    if pool is not None and pool.serves(devices, backend, kwargs.get("timeout")):
        return pool, False
    if pool is not None:
        pool.stop()
        _pools.pop(name, None)
    pool = WorkerPool(devices, backend, name=name, **kwargs)
    _pools[name] = pool
    session.register_closer(f"pool:{name}", lambda: stop_pool(name))
    pool.start()
    return pool, True


def stop_pool(name: str) -> bool:
    """Stop pool ``name``; returns whether one was running."""
    pool = _pools.pop(name, None)
    session.unregister_closer(f"pool:{name}")
    if pool is None:
        return False
    was = pool.alive
    pool.stop()
    return was


@atexit.register
def _kill_all_at_exit() -> None:
    # Registered after multiprocessing's own exit hook, so it runs first: that hook
    # would otherwise wait for our (non-daemonic) workers forever.
    for pool in list(_live_pools):
        try:
            pool.kill()
        except Exception:  # noqa: BLE001 - the interpreter is exiting: end the others regardless
            pass
