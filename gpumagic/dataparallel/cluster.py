"""``%%dataparallel --cluster``: the ranks are the engines of an ipyparallel cluster, on any machines.

ipyparallel starts and places engines (locally, over SSH, MPI, Slurm, PBS,
LSF: ``ipp.Cluster(engines=...)``), keeps them between cells, relays their
output and signals, and authenticates every message (HMAC with the key in the
cluster's connection files, which only their owner can read). Here the
engines become ``%%dataparallel`` ranks:

* :func:`connect` finds a cluster (a profile, a cluster file, a client
  connection file) or :func:`start_cluster` starts one; each engine says what it
  is (:func:`.engine.describe`). Ranks go in host order, ``LOCAL_RANK`` counts
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

import logging
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import WorkerDied, WorkerError, usage_error

logger = logging.getLogger(__name__)

__all__ = ["ClusterRanks", "connect", "start_cluster", "stop_cluster", "current_cluster", "EngineRank"]

ENGINE = "gpumagic.dataparallel.engine"
INTERRUPT_GRACE = 3.0       # seconds engines get to end a cell after SIGINT before they are stopped
CONTROLLER_CHECK = 2.0      # seconds between checks that the controller is still there


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
    held: set = field(default_factory=set)       # tensor keys every rank holds (as a pool's)
    fsdp_records: Any = None
    tasks_run: int = 0
    name: str = "cluster"
    _outgoing: Any = None

    # ---- what run.py uses of a pool
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
            from ..procs.bulk import Outgoing
            self._outgoing = Outgoing(shared=False)   # bytes go through ipyparallel's messages
        return self._outgoing

    def run(self, task: str, meta=None, data=None, *, on_output=None, on_message=None, on_tick=None,
            grace: float = 0.5) -> list:
        """Run ``task`` on every engine; returns each rank's ``(payload, buffer)`` (see the pool's ``run``)."""
        from ..procs.failures import primary_error, same_failure
        if not self.alive:
            raise WorkerDied(-1, None, "WorkerDied", f"the cluster's ranks ({self.source}) are not formed")
        bulk = data.numpy() if hasattr(data, "numpy") else data
        show = bool(isinstance(meta, dict) and meta.get("all_output"))
        futures = [self.client[r.engine].apply_async(_call, "run_task", task, meta, bulk, show or r.rank == 0)
                   for r in self.ranks]
        self.tasks_run += 1
        try:
            results, errors, pending = self._collect(futures, on_output, on_message, on_tick, grace)
        except WorkerDied as exc:
            if exc.exc_type != "ControllerLost":
                self._stop_busy(futures, "interrupted")
            self.formed = False
            raise
        except BaseException:
            self._stop_busy(futures, "interrupted")
            raise
        if errors:
            if pending or not same_failure(errors, self.world_size):
                self._stop_busy(futures, "waiting for the failed rank")
            raise primary_error(errors)
        return results

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
        from ..display import note
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
        try:
            registered = set(self.client.ids)
        except Exception:  # noqa: BLE001 - the hub is gone: nothing is alive
            registered = set()
        return {"state": "formed" if self.alive else "not formed", "source": self.source,
                "backend": self.backend, "world_size": self.world_size, "tasks_run": self.tasks_run,
                "ranks": [{"rank": r.rank, "host": r.host, "engine": r.engine, "device": r.device,
                           "local_rank": r.local_rank, "pid": r.pid,
                           "alive": r.alive and r.engine in registered} for r in self.ranks]}

    def launch_address(self) -> tuple[str, int]:
        """Launch mode's ``MASTER_ADDR`` and ``MASTER_PORT``: rank 0's address and a port free there."""
        first = self.ranks[0]
        return first.address, int(self.client[first.engine].apply_sync(_call, "free_port"))

    def stop(self) -> None:
        """Leave the engines' process group; the engines stay (they belong to the cluster)."""
        self.formed = False

    def kill(self) -> None:
        self.formed = False


def _call(name: str, *args):
    """Runs in an engine: ``gpumagic.dataparallel.engine.<name>(*args)``."""
    import importlib
    return getattr(importlib.import_module("gpumagic.dataparallel.engine"), name)(*args)


def _as_tensor(buffer):
    if buffer is None:
        return None
    import warnings

    import numpy as np
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # read-only message bytes, only ever read from
        return torch.from_numpy(np.asarray(buffer, dtype=np.uint8).reshape(-1))


# ---------------------------------------------------------------- finding, starting, forming

_current: ClusterRanks | None = None   # what the last --cluster cell (or cluster start) used
_started: ClusterRanks | None = None   # the cluster %dataparallel cluster start started
STARTED = "started"   # --cluster without a value: the cluster %dataparallel cluster start started


def current_cluster() -> ClusterRanks | None:
    """The cluster the last ``--cluster`` cell or ``%dataparallel cluster start`` used, or None."""
    return _current


def _ipyparallel():
    try:
        import ipyparallel
    except ImportError:
        raise usage_error("--cluster runs the ranks on the engines of an ipyparallel cluster, and ipyparallel is "
                          "not installed here: pip install 'gpumagic[cluster]' (in the engines' environment too)",
                          ["pip install 'gpumagic[cluster]'", "drop --cluster (this machine's GPUs)"]) from None
    return ipyparallel


def connect(source: str) -> ClusterRanks:
    """The cluster named by ``source``: an ipyparallel profile, a cluster file (``cluster-*.json``),
    a client connection file (``ipcontroller-client.json``), or :data:`STARTED`. ``UsageError``
    when there is none to reach."""
    ipp = _ipyparallel()
    if source == STARTED:
        if _started is None:
            raise usage_error("--cluster without a value uses the cluster '%dataparallel cluster start' started, and "
                              "none is running", ["%dataparallel cluster start --engines local -n 2",
                                                  "--cluster PROFILE", "--cluster path/to/ipcontroller-client.json"])
        _replace(_started)
        return _started
    if _current is not None and _current.source == source:
        return _current
    client, cluster = _client_for(ipp, source)
    _replace(ClusterRanks(client=client, source=source, cluster=cluster))
    assert _current is not None
    return _current


def _client_for(ipp, source: str):
    import json
    from pathlib import Path
    path = Path(source).expanduser()
    looks_like_file = path.suffix == ".json" or "/" in source
    try:
        if looks_like_file:
            if not path.is_file():
                raise usage_error(f"--cluster {source}: no such file", _choices())
            if "cluster" in json.loads(path.read_text()):
                cluster = ipp.Cluster.from_file(str(path))
                return cluster.connect_client_sync(), cluster
            return ipp.Client(str(path), timeout=10), None
        from IPython.core.profiledir import ProfileDir, ProfileDirError
        from IPython.paths import get_ipython_dir
        try:
            ProfileDir.find_profile_dir_by_name(get_ipython_dir(), source)
        except ProfileDirError:
            raise usage_error(f"--cluster {source}: no ipyparallel cluster reachable there (no profile {source!r} "
                              f"in {get_ipython_dir()})", _choices()) from None
        try:
            cluster = ipp.Cluster.from_file(profile=source)
        except (OSError, ValueError, KeyError):
            cluster = None   # started by ipcluster of an older ipyparallel, or by hand: its client file
        if cluster is not None:
            return cluster.connect_client_sync(), cluster
        return ipp.Client(profile=source, timeout=10), None
    except Exception as exc:  # every way of not reaching one says the same
        if type(exc).__name__ == "UsageError":
            raise
        raise usage_error(f"--cluster {source}: no ipyparallel cluster reachable there ({type(exc).__name__}: {exc})",
                          _choices()) from None


def _choices() -> list[str]:
    return ["%dataparallel cluster start --engines local -n 2", "--cluster PROFILE (ipcluster start --profile PROFILE)",
            "--cluster ~/.ipython/profile_default/security/ipcontroller-client.json"]


def _replace(ranks: ClusterRanks | None) -> None:
    global _current
    old, _current = _current, ranks
    if old is not None and old is not ranks and old is not _started:
        try:
            old.client.close()
        except Exception:  # closing a client that lost its hub
            logger.debug("closing the previous cluster's client failed", exc_info=True)


def start_cluster(engines: str = "local", n: int | None = None, profile: str | None = None) -> ClusterRanks:
    """Start a cluster (``ipp.Cluster(engines=..., n=...)``) and use it for ``--cluster`` cells."""
    ipp = _ipyparallel()
    stop_cluster()
    kwargs: dict = {"engines": engines, "log_level": 40}
    if n:
        kwargs["n"] = n
    if profile:
        kwargs["profile"] = profile
    try:
        cluster = ipp.Cluster(**kwargs)
    except Exception as exc:  # noqa: BLE001 - ipyparallel names the launchers it knows
        raise usage_error(f"%dataparallel cluster start --engines {engines}: {exc}",
                          ["--engines local", "--engines mpi", "--engines slurm", "--engines pbs", "--engines lsf",
                           "--engines ssh"]) from None
    from .. import session
    client = cluster.start_and_connect_sync()
    session.register_closer("cluster", stop_cluster)   # %unload_ext and exit stop it too
    client.wait_for_engines(n or 1, timeout=600)
    global _started
    _started = ClusterRanks(client=client, source=f"the cluster started here ({engines}, {len(client.ids)} engines)",
                            cluster=cluster, owned=True)
    _replace(_started)
    return _started


def stop_cluster() -> bool:
    """Stop the cluster started here (its engines and controller) and forget the one in use. Returns
    whether there was either."""
    global _started
    ranks, started = _current, _started
    _started = None
    _replace(None)
    if started is not None:
        try:
            started.client.close()
            started.cluster.stop_cluster_sync()
        except Exception:  # stopping what is already gone
            logger.debug("stopping the cluster failed", exc_info=True)
    return ranks is not None or started is not None


def form(ranks: ClusterRanks, nprocs: int | None, backend: str | None, timeout: float) -> ClusterRanks:
    """Make the engines ranks (once; again after a failure): ``UsageError`` before anything starts when
    there are too few, or they lack torch or gpumagic."""
    if ranks.formed and all(r.alive for r in ranks.ranks) and (nprocs in (None, ranks.world_size)) \
            and (backend in (None, ranks.backend)) and timeout == ranks.timeout:
        return ranks
    client = ranks.client
    if not ranks.controller_alive():
        raise usage_error(f"--cluster {ranks.source}: the ipyparallel controller is gone; the engines cannot be "
                          "reached", _choices())
    gone = [r for r in ranks.ranks if not r.alive or r.engine not in client.ids]
    if ranks.owned and gone:
        old = set(client.ids) | {r.engine for r in ranks.ranks}
        ranks.cluster.restart_engines_sync()       # engines stopped or dead after the last cell: new ones
        deadline = time.monotonic() + 600
        while len(set(client.ids) - old) < len(ranks.ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
    elif gone and nprocs is None and len(set(client.ids) - {r.engine for r in gone}) < len(ranks.ranks):
        names = ", ".join(f"engine {r.engine} ({r.host})" for r in gone)
        raise usage_error(f"--cluster {ranks.source}: {names} of the last cell's ranks is gone (stopped, or it "
                          f"died); start it again (ipcluster engines), or run on the "
                          f"{len(ranks.ranks) - len(gone)} left with --nprocs", ["ipcluster engines", "--nprocs N"])
    engines = sorted(set(client.ids) - {r.engine for r in gone})
    if not engines:
        raise usage_error(f"--cluster {ranks.source}: the cluster has no engines", ["ipcluster engines -n 2",
                                                                                   "%dataparallel cluster start -n 2"])
    if nprocs is not None and nprocs > len(engines):
        raise usage_error(f"--nprocs {nprocs}: the cluster ({ranks.source}) has {len(engines)} engine(s)",
                          [f"--nprocs {k}" for k in range(1, len(engines) + 1)])
    facts = _describe(client, engines, ranks.source)
    chosen = sorted(engines, key=lambda e: (facts[e]["host"], e))[: nprocs or len(engines)]
    ranks.ranks = _place(chosen, facts)
    ranks.backend = _backend(backend, ranks.ranks)
    ranks.timeout = timeout
    _join(ranks)
    ranks.formed, ranks.held, ranks.fsdp_records = True, set(), None
    return ranks


def _describe(client, engines: list[int], source: str) -> dict:
    ip = getattr(client, "_config", {}).get("registration", "")   # tcp://host:port: the controller's address
    controller = ip.rsplit("//", 1)[-1].rsplit(":", 1)[0]
    view = client[engines]
    try:
        described = view.apply_async(_call, "describe", controller).get(timeout=120)
    except Exception as exc:  # noqa: BLE001 - a RemoteError names what the engines lack
        text = str(exc)
        missing = "gpumagic" if "gpumagic" in text else "torch" if "torch" in text else None
        if missing:
            raise usage_error(f"--cluster {source}: the engines cannot import {missing}; install gpumagic (and torch) "
                              "in the engines' Python environment, the same versions as here",
                              ["pip install gpumagic (on the engines' hosts)"]) from None
        raise usage_error(f"--cluster {source}: the engines did not answer ({type(exc).__name__}: {exc})",
                          _choices()) from None
    return dict(zip(engines, described))


def _place(engines: list[int], facts: dict) -> list[EngineRank]:
    """Ranks in host order; LOCAL_RANK within a host; GPU LOCAL_RANK of the host, or the CPU."""
    per_host: dict[str, int] = {}
    placed = []
    for rank, e in enumerate(engines):
        f = facts[e]
        local = per_host.get(f["host"], 0)
        per_host[f["host"]] = local + 1
        device = f"cuda:{local}" if local < f["gpus"] else "cpu"
        placed.append(EngineRank(rank, e, f["host"], f["address"], f["pid"], device, local))
    kinds = {r.device == "cpu" for r in placed}
    if len(kinds) > 1:
        short = sorted({r.host for r in placed if r.device == "cpu"})
        raise usage_error(f"--cluster: host(s) {', '.join(short)} run more engines than they have GPUs, so some ranks "
                          "would be on the CPU and some on GPUs; one kind per run",
                          ["as many engines per host as GPUs", "--nprocs N (fewer ranks)"])
    return placed


def _backend(backend: str | None, ranks: list[EngineRank]) -> str:
    on_gpu = ranks[0].device != "cpu"
    if backend is None:
        return "nccl" if on_gpu else "gloo"
    if backend == "nccl" and not on_gpu:
        raise usage_error("--backend nccl needs GPUs, and the cluster's ranks are on the CPU", ["gloo"])
    return backend


def _join(ranks: ClusterRanks) -> None:
    """Rank 0 opens the rendezvous at a port of its host; every engine joins the process group."""
    from ..display import note
    first = ranks.ranks[0]
    hosts = {r.host for r in ranks.ranks}
    if len(hosts) > 1 and first.address.startswith("127."):
        note(f"--cluster: rank 0's engine ({first.host}) reaches the controller over loopback, so the engines on "
             f"other hosts may not reach its rendezvous at {first.address}: start the controller on an address "
             "the other hosts reach (ipcontroller --ip ...)")
    client = ranks.client
    port = client[first.engine].apply_async(_call, "open_store", ranks.world_size, ranks.timeout).get(timeout=120)
    nodes = sorted(hosts)
    local_world = {h: sum(r.host == h for r in ranks.ranks) for h in hosts}
    joins = [client[r.engine].apply_async(
        _call, "join", r.rank, ranks.world_size, r.local_rank, r.device, ranks.backend, first.address, port,
        ranks.timeout, {"LOCAL_RANK": str(r.local_rank), "LOCAL_WORLD_SIZE": str(local_world[r.host]),
                        "GROUP_RANK": str(nodes.index(r.host)), "GROUP_WORLD_SIZE": str(len(nodes))})
        for r in ranks.ranks]
    try:
        for r, j in zip(ranks.ranks, joins):
            r.pid = j.get(timeout=ranks.timeout if ranks.timeout < 600 else 600)["pid"]
    except Exception as exc:  # noqa: BLE001 - the engines' own error, said as theirs
        raise WorkerError(-1, None, type(exc).__name__,
                          f"the engines could not form the process group at {first.address}:{port}: {exc}") from None
