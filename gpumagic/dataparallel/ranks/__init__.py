"""The ranks a ``%%dataparallel`` cell runs on: this machine's worker pool, or an ipyparallel cluster's engines.

Both answer the :class:`Ranks` protocol, all that the rest of ``%%dataparallel`` knows of them; what it keeps
about them between cells (the tensors every rank holds, the shards ``--strategy fsdp`` left there) is their
:class:`~.kept.Kept`, which starts empty whenever the ranks start or form again.

* :mod:`.local` - this machine's pool (:class:`gpumagic.procs.pool.WorkerPool`) as the ranks;
* :mod:`.cluster` - an ipyparallel cluster's engines as the ranks; :mod:`.cluster_setup` - finding, starting and
  forming a cluster; :mod:`.engine` - a rank inside an engine; :mod:`.cell_store` - the cluster's rendezvous
  store, open only during a cell; :mod:`.cluster_watch` - a started cluster ends with the kernel;
  :mod:`.cluster_procs` - its processes on this machine, found and ended.

In a notebook::

    %dataparallel status         # the pool's ranks (and the cluster's, where --cluster cells use one)
"""
from __future__ import annotations

from typing import Protocol

from .kept import Kept

__all__ = ["Ranks"]


class Ranks(Protocol):
    """What a ``%%dataparallel`` cell asks of the ranks it runs on."""

    kept: Kept                          # what the ranks hold between cells, as far as the kernel counts on it

    @property
    def devices(self) -> list[str]: ...          # one per rank, in rank order

    @property
    def world_size(self) -> int: ...

    @property
    def pids(self) -> list: ...

    @property
    def alive(self) -> bool: ...

    @property
    def outgoing(self): ...                      # the kernel's bulk buffer (procs.bulk.Outgoing)

    def run(self, task: str, meta=None, data=None, *, on_output=None, on_message=None, on_tick=None,
            grace: float = 0.5) -> list:
        """Run ``task`` on every rank; each rank's ``(payload, buffer)``, or the first rank's error raised."""

    def launch_address(self) -> tuple[str, int]:
        """Launch mode's ``MASTER_ADDR`` and a ``MASTER_PORT`` free there (rank 0's host)."""

    def interrupted_note(self) -> str:
        """What the cell's note says after an interrupt: what became of the ranks."""
