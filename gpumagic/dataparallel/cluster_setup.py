"""Finding, starting and forming a ``--cluster``'s ranks (:mod:`.cluster` runs cells on them).

* :func:`connect` finds the cluster a ``--cluster`` names (a profile, a cluster
  file, a client connection file, or the one started here);
* :func:`start_cluster` / :func:`stop_cluster`: ``%dataparallel cluster start|stop``;
* :func:`form` makes its engines ranks: each says what it is
  (:func:`.engine.describe`), ranks go in host order with ``LOCAL_RANK`` within
  a host, rank 0 opens the rendezvous and every engine joins the process group.

``UsageError`` before anything of a cell travels wherever that cannot be done.
"""
from __future__ import annotations

import logging
import subprocess
import time

from ..errors import WorkerError, usage_error
from . import cluster_watch
from .cluster import ClusterRanks, EngineRank, call_engine

logger = logging.getLogger(__name__)

__all__ = ["connect", "form", "start_cluster", "stop_cluster", "current_cluster", "STARTED"]


_current: ClusterRanks | None = None   # what the last --cluster cell (or cluster start) used
_started: ClusterRanks | None = None   # the cluster %dataparallel cluster start started
_watcher: cluster_watch.Watch | None = None   # stops _started if the kernel ends without stopping it
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
    global _watcher
    try:   # ... and a kernel that Jupyter ends before its exit hooks run (cluster_watch)
        _watcher = cluster_watch.watch(cluster.cluster_file)
    except (OSError, subprocess.SubprocessError):
        logger.warning("could not start the watcher that stops the cluster with the kernel", exc_info=True)
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
    global _watcher
    if _watcher is not None:
        _watcher.release()
        _watcher = None
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
        described = view.apply_async(call_engine, "describe", controller).get(timeout=120)
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
    port = client[first.engine].apply_async(call_engine, "open_store", ranks.world_size, ranks.timeout).get(timeout=120)
    nodes = sorted(hosts)
    local_world = {h: sum(r.host == h for r in ranks.ranks) for h in hosts}
    joins = [client[r.engine].apply_async(
        call_engine, "join", r.rank, ranks.world_size, r.local_rank, r.device, ranks.backend, first.address, port,
        ranks.timeout, {"LOCAL_RANK": str(r.local_rank), "LOCAL_WORLD_SIZE": str(local_world[r.host]),
                        "GROUP_RANK": str(nodes.index(r.host)), "GROUP_WORLD_SIZE": str(len(nodes))})
        for r in ranks.ranks]
    try:
        for r, j in zip(ranks.ranks, joins):
            r.pid = j.get(timeout=ranks.timeout if ranks.timeout < 600 else 600)["pid"]
    except Exception as exc:  # noqa: BLE001 - the engines' own error, said as theirs
        raise WorkerError(-1, None, type(exc).__name__,
                          f"the engines could not form the process group at {first.address}:{port}: {exc}") from None
