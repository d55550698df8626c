"""``%%dataparallel --cluster``: the ranks are the engines of an ipyparallel cluster, on any machines.

ipyparallel starts and places engines (locally, over SSH, MPI, Slurm, PBS,
LSF: ``ipp.Cluster(engines=...)``), keeps them between cells, relays their
output and signals, and authenticates every message (HMAC with the key in the
cluster's connection files, which only their owner can read). Here the
engines become ``%%dataparallel`` ranks:

* :mod:`.cluster_setup` finds a cluster (a profile, a cluster file, a client
  connection file) or starts one; each engine says what it is
  (:func:`.engine.describe`). Ranks go in host order, ``LOCAL_RANK`` counts
  within a host, and each rank takes that GPU of its host (the CPU on hosts
  without GPUs);
* rank 0 opens the rendezvous on its own host at a port it picked (as
  ``torchrun`` does) and every engine joins the process group (NCCL where every
  rank has a GPU, else gloo);
* :class:`ClusterRanks` runs a cell's task on every engine as a local pool
  runs it on its workers (the same :mod:`.rank` task, so the same modes): the
  cell, the notebook's values and the trained state go through ipyparallel's
  own messages; rank 0's output and progress stream into the cell.

An interrupt, an engine that dies, a rank error, a lost controller: the cell
ends with an error and the notebook's objects as they were. Engines still in
a collective after that are stopped and said to be gone (those of a cluster
started here are started again for the next cell).

In a notebook::

    %dataparallel cluster start --engines slurm -n 8
    %%dataparallel --cluster
    for x, y in loader: ...
"""
from __future__ import annotations

import gc
import logging
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from ...errors import WorkerDied
from ..protocol import CellOrder
from .kept import Kept

logger = logging.getLogger(__name__)

__all__ = ["ClusterRanks", "EngineRank", "call_engine"]

ENGINE = "gpumagic.dataparallel.ranks.engine"
INTERRUPT_GRACE = 3.0       # seconds engines get to end a cell after SIGINT before they are stopped
CONTROLLER_CHECK = 2.0      # seconds between checks that the controller is still there
BIG_TASK_BYTES = 64 << 20   # a cell that moved this much frees its tasks' buffers at once (see _forget)
STORE_TIMEOUT = 30.0        # seconds rank 0's engine may take to open or close the rendezvous store


@dataclass
class EngineRank:
    """One engine as a rank."""
    rank: int
    engine: int
    host: str
    address: str
    pid: int
    device: str
    local_rank: int
    alive: bool = True


@dataclass
class ClusterRanks:
    """The engines of one cluster as ``%%dataparallel``'s ranks; answers as a local pool does."""
    client: Any
    source: str                                  # what it was found by, for messages
    cluster: Any = None                          # the ipp.Cluster, where known (started here, or from a file)
    owned: bool = False                          # started by %dataparallel cluster start
    ranks: list = field(default_factory=list)    # EngineRank, in rank order
    backend: str = ""
    timeout: float = 1800.0
    formed: bool = False
    kept: Kept = field(default_factory=Kept)     # what the kernel counts on the engines holding
    tasks_run: int = 0
    aliases: set = field(default_factory=set)    # other --cluster values found to be this cluster
    store_host: str = "0.0.0.0"                  # where rank 0 serves the store: loopback if every engine is here
    store_address: str = ""                      # where the other ranks reach it
    last_store: tuple | None = None              # (address, port) of the last cell's store, closed since
    _outgoing: Any = None
    _errands: list = field(default_factory=list)  # the store's open and close tasks, for _forget

    # ---- the Ranks protocol
    @property
    def devices(self) -> list[str]:
        return [r.device for r in self.ranks]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def pids(self) -> list:
        return [r.pid for r in self.ranks]

    @property
    def alive(self) -> bool:
        return self.formed and all(r.alive for r in self.ranks)

    @property
    def outgoing(self):
        if self._outgoing is None:
            from ...procs.bulk import Outgoing
            self._outgoing = Outgoing(shared=False)   # bytes go through ipyparallel's messages
        return self._outgoing

    def run(self, task: str, meta=None, data=None, *, on_output=None, on_message=None, on_tick=None,
            grace: float = 0.5) -> list:
        """Run ``task`` on every engine; returns each rank's ``(payload, buffer)`` (see the pool's ``run``)."""
        from ...procs.failures import primary_error, same_failure
        if not self.alive:
            raise WorkerDied(-1, None, "WorkerDied", f"the cluster's ranks ({self.source}) are not formed")
        bulk = data.numpy() if hasattr(data, "numpy") else data
        show = isinstance(meta, CellOrder) and meta.all_output   # (other tasks: rank 0's output only)
        rendezvous = self._open_store()
        futures = [self.client[r.engine].apply_async(call_engine, "run_task", task, meta, bulk, show or r.rank == 0,
                                                     rendezvous)
                   for r in self.ranks]
        self.tasks_run += 1
        try:
            results, errors, pending = self._collect(futures, on_output, on_message, on_tick, grace)
            if errors and (pending or not same_failure(errors, self.world_size)):
                self._stop_busy(futures, "waiting for the failed rank")
        except WorkerDied as exc:
            if exc.exc_type != "ControllerLost":
                self._stop_busy(futures, "interrupted")
            self.formed = False
            raise
        except BaseException:
            self._stop_busy(futures, "interrupted")
            raise
        finally:
            # (queued behind rank 0's task: it closes once that has ended; waited for where every task has)
            self.close_store(wait=all(f.ready() for f in futures))
            moved = self._forget(futures) + (getattr(bulk, "nbytes", 0) or 0)
            # Forgotten, the tasks' futures are garbage in reference cycles that still hold their
            # buffers (the cell's tensors, the trained weights): with this frame's references gone,
            # free them now rather than at some later collection, which may come cells later, after
            # several models' worth of memory. (The results keep what the kernel loads.)
            del futures, bulk, data
            if moved >= BIG_TASK_BYTES:
                gc.collect()
        if errors:
            raise primary_error(errors, still_running=pending)   # (ranks a timed-out collective waited on)
        return results

    def _open_store(self) -> tuple:
        """Rank 0 serves a rendezvous store for this cell (:mod:`.cell_store`); where the others reach it."""
        first = self.ranks[0]
        try:
            opening = self.client[first.engine].apply_async(call_engine, "open_store", self.world_size, self.timeout,
                                                            self.store_host, False)
            self._errands.append(opening)
            port = opening.get(timeout=STORE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - an engine gone or restarted: the ranks form again
            self.formed = False
            raise WorkerDied(0, first.pid, "WorkerDied", f"engine {first.engine} on {first.host} (rank 0) could not "
                             f"open the cell's rendezvous ({type(exc).__name__}: {exc}); run the cell again to "
                             "form the ranks anew") from None
        self.last_store = (self.store_address, int(port))
        return self.last_store

    def close_store(self, engines: list | None = None, wait: bool = True) -> None:
        """Close the store on ``engines`` (rank 0's, by default: its server): between cells nothing listens
        there. Sent to the engines' queues, so that each closes once its task has ended; ``wait``: until
        then (not where a task may still be stuck, which an interrupt must not wait for)."""
        targets = engines if engines is not None else [self.ranks[0].engine]
        try:
            if self.controller_alive():
                closing = self.client[targets].apply_async(call_engine, "close_store")
                self._errands.append(closing)
                if wait:
                    closing.get(timeout=STORE_TIMEOUT)
        except Exception:  # an engine stopped or killed: its store went with its process
            logger.debug("closing the rendezvous store on engines %s failed", targets, exc_info=True)

    def _forget(self, futures) -> int:
        """The controller keeps every task's request and result (the cell's tensors, the trained
        weights) in its database until it culls them (about 1 GB by default): the finished ones
        are dropped now, so it holds no model between cells. Returns the bytes they brought back."""
        done = [f for f in futures if f.ready()]
        # (and the store's errands: opened and closed each cell, they would pile up there too)
        errands, self._errands = self._errands, [f for f in self._errands if not f.ready()]
        done += [f for f in errands if f.ready()]
        if not done or not self.controller_alive():   # (one that is gone keeps nothing, and would not answer)
            return 0
        try:
            self.client.purge_hub_results(jobs=done)
            self.client.purge_local_results(jobs=done)
        except Exception:  # a controller that is gone keeps nothing
            logger.debug("purging the cell's tasks from the controller failed", exc_info=True)
        return sum(_nbytes(f) for f in done)

    def _collect(self, futures, on_output, on_message, on_tick, grace):
        seen_out: dict = {}
        seen_msg: dict = {}
        pending = set(range(len(futures)))
        results: list = [None] * len(futures)
        errors: dict[int, dict] = {}
        first_error_at = None
        next_check = time.monotonic() + CONTROLLER_CHECK
        while pending:
            for rank in sorted(pending):
                future = futures[rank]
                self._relay(rank, future, seen_out, seen_msg, on_output, on_message)
                if not future.ready():
                    continue
                pending.discard(rank)
                outcome = self._outcome(rank, future)
                if outcome[0] == "done":
                    results[rank] = (outcome[1], _as_tensor(outcome[2]))
                else:
                    errors[rank] = outcome[1]
                    first_error_at = first_error_at or time.monotonic()
            if on_tick is not None:
                on_tick()
            now = time.monotonic()
            if first_error_at is not None and pending and now - first_error_at > grace:
                break
            if now >= next_check:
                next_check = now + CONTROLLER_CHECK
                if not self.controller_alive():
                    raise WorkerDied(-1, None, "ControllerLost",
                                     f"the ipyparallel controller of {self.source} is gone; the engines cannot be "
                                     "reached. Start the cluster again (%dataparallel cluster start, or ipcluster)")
            time.sleep(0.02)
        for rank in range(len(futures)):
            self._relay(rank, futures[rank], seen_out, seen_msg, on_output, on_message)
        return results, errors, pending

    def _relay(self, rank, future, seen_out, seen_msg, on_output, on_message) -> None:
        """New output and messages of ``rank``'s engine into the cell."""
        if on_output is not None:
            for stream in ("stdout", "stderr"):
                text = getattr(future, stream, "") or ""
                if isinstance(text, list):
                    text = "".join(text)
                start = seen_out.get((rank, stream), 0)
                if len(text) > start:
                    on_output(rank, stream, text[start:])
                    seen_out[(rank, stream)] = len(text)
        if on_message is not None:
            data = future.data if isinstance(future.data, dict) else {}
            sent = data.get("gpumagic") or []
            for msg in sent[seen_msg.get(rank, 0):]:
                on_message(rank, msg)
            seen_msg[rank] = max(seen_msg.get(rank, 0), len(sent))

    def _outcome(self, rank: int, future) -> tuple:
        """``("done", payload, buffer)`` or ``("error", info)`` of a finished task."""
        import ipyparallel as ipp
        r = self.ranks[rank]
        try:
            return future.get(0)
        except (ipp.error.EngineError, ipp.error.RemoteError) as exc:
            if isinstance(exc, ipp.error.RemoteError) and exc.ename != "EngineError":
                return ("error", {"rank": rank, "pid": r.pid, "exc_type": type(exc).__name__,
                                  "message": f"engine {r.engine} on {r.host}: {exc}", "traceback": ""})
            r.alive = False
            return ("error", {"rank": rank, "pid": r.pid, "exc_type": "WorkerDied",
                              "message": f"engine {r.engine} on {r.host} died during the cell ({exc})",
                              "traceback": "", "died": True})
        except Exception as exc:  # noqa: BLE001 - ipyparallel's own failures (serialising, the hub)
            return ("error", {"rank": rank, "pid": r.pid, "exc_type": type(exc).__name__,
                              "message": f"engine {r.engine} on {r.host}: {exc}", "traceback": ""})

    def _stop_busy(self, futures, why: str) -> None:
        """Interrupt the engines still running the cell; stop those that do not end (stuck in a
        collective): they are gone, and the ranks must form again."""
        from ...display import note
        busy = [r for r, f in zip(self.ranks, futures) if not f.ready() and r.alive]
        self.formed = False   # the process group may be mid-collective anywhere: form it anew
        if not busy:
            return
        self._signal(busy, signal.SIGINT)
        deadline = time.monotonic() + INTERRUPT_GRACE
        while time.monotonic() < deadline and any(not futures[r.rank].ready() for r in busy):
            time.sleep(0.05)
        stuck = [r for r in busy if not futures[r.rank].ready()]
        if stuck:
            self._signal(stuck, signal.SIGKILL)
            for r in stuck:
                r.alive = False
            names = ", ".join(f"engine {r.engine} (rank {r.rank}, {r.host})" for r in stuck)
            again = ("they are started again for the next cell" if self.owned else
                     "start them again (ipcluster, or %dataparallel cluster start)")
            note(f"%%dataparallel --cluster: {names} did not end after the cell was {why} (a collective "
                 f"waiting for the others) and were stopped; {again}")

    def _signal(self, ranks, signum) -> None:
        try:
            self.client.send_signal(signum, targets=[r.engine for r in ranks], block=False).result(timeout=5)
        except Exception:  # an engine already gone cannot be signalled
            logger.debug("signalling engines %s failed", [r.engine for r in ranks], exc_info=True)

    def controller_alive(self) -> bool:
        """Whether the controller still answers at its registration address."""
        launcher = getattr(self.cluster, "controller", None) if self.cluster is not None else None
        if launcher is not None and callable(getattr(launcher, "poll", None)):
            try:
                return launcher.poll() is None   # a local process: whether it still runs
            except Exception:  # a launcher that cannot tell (a batch job): ask the address below
                logger.debug("the controller's launcher cannot say whether it runs", exc_info=True)
        url = getattr(self.client, "_config", {}).get("registration", "")   # tcp://host:port
        try:
            host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except (OSError, ValueError, IndexError):
            return False

    def status(self) -> dict:
        """What ``%dataparallel status`` shows: each rank's host, engine, GPU and whether it is alive."""
        # The client's engine list is the last the controller sent: with the controller gone it still
        # names every engine, so nothing is alive then.
        reachable = self.controller_alive()
        try:
            registered = set(self.client.ids) if reachable else set()
        except Exception:  # noqa: BLE001 - the hub is gone: nothing is alive
            registered = set()
        state = ("controller gone" if not reachable else
                 "formed" if self.alive and all(r.engine in registered for r in self.ranks) else "not formed")
        return {"state": state, "source": self.source,
                "backend": self.backend, "world_size": self.world_size, "tasks_run": self.tasks_run,
                "ranks": [{"rank": r.rank, "host": r.host, "engine": r.engine, "device": r.device,
                           "local_rank": r.local_rank, "pid": r.pid,
                           "alive": r.alive and r.engine in registered} for r in self.ranks]}

    def launch_address(self) -> tuple[str, int]:
        """Launch mode's ``MASTER_ADDR`` and ``MASTER_PORT``: rank 0's address and a port free there."""
        first = self.ranks[0]
        return first.address, int(self.client[first.engine].apply_sync(call_engine, "free_port"))

    def interrupted_note(self) -> str:
        # a cluster's engines are signalled, not ended: they stay (a note names any that were stopped)
        return ("%%dataparallel --cluster: interrupted; the cell ended on the engines, and the notebook's objects "
                "are as they were before the cell")

    def stop(self) -> None:
        """Leave the engines' process group; the engines stay (they belong to the cluster)."""
        self.formed = False

    def kill(self) -> None:
        self.formed = False


def call_engine(name: str, *args):
    """Runs in an engine: ``gpumagic.dataparallel.ranks.engine.<name>(*args)``."""
    import importlib
    return getattr(importlib.import_module(ENGINE), name)(*args)


def _nbytes(future) -> int:
    """The size of the buffer a finished ``run_task`` brought back (0 for an error)."""
    try:
        outcome = future.get(0)
    except Exception:  # noqa: BLE001 - a failed task brought no buffer
        return 0
    buffer = outcome[2] if isinstance(outcome, tuple) and len(outcome) == 3 else None
    return int(getattr(buffer, "nbytes", 0) or 0)


def _as_tensor(buffer):
    if buffer is None:
        return None
    import warnings

    import numpy as np
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # read-only message bytes, only ever read from
        return torch.from_numpy(np.asarray(buffer, dtype=np.uint8).reshape(-1))
