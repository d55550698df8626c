"""This machine's ``%%dataparallel`` worker pool as the ranks (:class:`LocalRanks`).

The pool itself (spawned ranks in one process group, meeting in a private file store, dying with the
kernel) is :class:`gpumagic.procs.pool.WorkerPool`; this wraps the one ``%%dataparallel`` keeps, started by
the first cell and reused by later ones, with what the kernel keeps about it (:class:`~.kept.Kept`).

In a notebook::

    %dataparallel status        # this pool
    %dataparallel stop          # ends it
"""
from __future__ import annotations

from ...procs import pool as poolmod
from ...procs.rendezvous import free_loopback_port
from .kept import Kept

__all__ = ["LocalRanks", "POOL_NAME", "RANK_PRELOAD", "local_ranks", "current", "stop"]

POOL_NAME = "dataparallel"
LOOPBACK = "127.0.0.1"
# Modules each rank imports while the pool starts: DistributedDataParallel's constructor imports
# torch._dynamo (over a second), better paid then than in the user's first cell.
RANK_PRELOAD = ("gpumagic.dataparallel.rank.task", "torch._dynamo", "torch.nn.parallel")


class LocalRanks:
    """This machine's pool, answering :class:`~gpumagic.dataparallel.ranks.Ranks`."""

    def __init__(self, pool: poolmod.WorkerPool):
        self.pool = pool
        self.kept = Kept()

    @property
    def devices(self) -> list[str]:
        return list(self.pool.devices)

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    @property
    def pids(self) -> list:
        return list(self.pool.pids)

    @property
    def alive(self) -> bool:
        return self.pool.alive

    @property
    def outgoing(self):
        return self.pool.outgoing

    def run(self, task: str, meta=None, data=None, *, on_output=None, on_message=None, on_tick=None,
            grace: float = 0.5) -> list:
        return self.pool.run(task, meta, data, on_output=on_output, on_message=on_message, on_tick=on_tick,
                             grace=grace)

    def launch_address(self) -> tuple[str, int]:
        return LOOPBACK, free_loopback_port()

    def interrupted_note(self) -> str:
        return ("%%dataparallel: interrupted; the ranks were stopped, and the notebook's objects are as they were "
                "before the cell")

    def serves(self, devices, backend, timeout: float | None = None) -> bool:
        return self.pool.serves(devices, backend, timeout)


_current: LocalRanks | None = None


def local_ranks(devices: list[str], backend: str | None, timeout: float) -> tuple[LocalRanks, bool]:
    """The pool for these devices (started, or a running one reused); and whether it started now."""
    global _current
    pool, started = poolmod.get_pool(POOL_NAME, devices, backend, timeout=timeout, preload=RANK_PRELOAD)
    if _current is None or _current.pool is not pool:
        _current = LocalRanks(pool)
    return _current, started


def current() -> LocalRanks | None:
    """The pool the last cell ran on, while it is the pool (stopped or not); None before any."""
    pool = poolmod.current_pool(POOL_NAME)
    return _current if _current is not None and pool is not None and _current.pool is pool else None


def stop() -> bool:
    """End the pool; whether one was running."""
    global _current
    _current = None
    return poolmod.stop_pool(POOL_NAME)
