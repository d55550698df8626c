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

import contextlib
import logging
import subprocess
import time
from typing import NoReturn

from ...errors import UsageError, WorkerError, usage_error
from . import cluster_watch
from .cluster import ClusterRanks, EngineRank, call_engine

logger = logging.getLogger(__name__)

__all__ = ["connect", "form", "start_cluster", "stop_cluster", "current_cluster", "STARTED"]


_current: ClusterRanks | None = None   # what the last --cluster cell (or cluster start) used
_started: ClusterRanks | None = None   # the cluster %dataparallel cluster start started
_starting = None                               # the ipp.Cluster cluster start is starting now
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
    # The last cell's cluster, while its controller answers; a controller that went away may have been
    # started again under the same profile or file (new ports, a new key): look again.
    last = _current
    stale = last is not None and source in (last.source, *last.aliases)
    if last is not None and stale and last.controller_alive():
        return last
    try:
        cluster, make_client = _find(ipp, source)
    except UsageError as exc:
        if not stale:
            raise
        # (ipyparallel removes a stopped cluster's files: say what became of the one the last cell used)
        raise UsageError(f"--cluster {source}: the ipyparallel controller the last cell used is gone; "
                         + str(exc).removeprefix(f"--cluster {source}: ")) from None
    if cluster is not None and _started is not None and cluster.cluster_file == _started.cluster.cluster_file:
        _started.aliases.add(source)   # the one started here, named by its profile or file: its ranks as they are
        _replace(_started)
        return _started
    with _leaving_px_alone():
        client = _reach(source, make_client)
    _replace(ClusterRanks(client=client, source=source, cluster=cluster))
    assert _current is not None
    return _current


def _not_px(line=""):   # pragma: no cover - stands in for %px only while a client connects
    raise RuntimeError("%px is not set up yet")


@contextlib.contextmanager
def _leaving_px_alone():
    """The first ipyparallel Client made in an IPython session binds ``%px`` to itself. gpumagic's clients
    are closed when the notebook moves to another cluster or lets one go, which would leave ``%px`` on a
    closed client (and a Client the notebook makes after ours does not bind it again): so ``%px`` looks
    taken while ours connect, and stays the notebook's own client's."""
    from IPython import get_ipython
    shell = get_ipython()
    line = shell.magics_manager.magics["line"] if shell is not None else None
    if line is None or "px" in line:
        yield
        return
    line["px"] = _not_px
    try:
        yield
    finally:
        if line.get("px") is _not_px:
            del line["px"]


def _find(ipp, source: str):
    """``(cluster or None, a function that connects a client to it)``: ``UsageError`` when none runs there."""
    from pathlib import Path
    path = Path(source).expanduser()
    looks_like_file = path.suffix == ".json" or "/" in source
    return _reach(source, lambda: _by_file(ipp, source, path) if looks_like_file else _by_profile(ipp, source))


def _reach(source: str, attempt):
    try:
        return attempt()
    except Exception as exc:  # every way of not reaching one says the same
        if type(exc).__name__ == "UsageError":
            raise
        raise usage_error(f"--cluster {source}: no ipyparallel cluster reachable there ({type(exc).__name__}: {exc})",
                          _choices()) from None


def _by_file(ipp, source: str, path):
    """A cluster file (``cluster-*.json``: the controller's launcher too) or a client connection file."""
    import json
    if not path.is_file():
        raise usage_error(f"--cluster {source}: no such file", _choices())
    info = json.loads(path.read_text())
    if "cluster" in info:
        cluster = ipp.Cluster.from_file(str(path), log_level=50)
        if cluster.controller is None:   # ipyparallel found its process gone
            raise usage_error(f"--cluster {source}: that cluster's controller is gone (not running)", _choices())
        return cluster, cluster.connect_client_sync
    _check_answers(source, info)
    return None, lambda: ipp.Client(str(path), timeout=10)


def _by_profile(ipp, source: str):
    """The cluster running in profile ``source``. ipyparallel writes a cluster file for each cluster it
    starts there (``ipcluster start``'s id is "", ``ipp.Cluster()``'s a random one, so its client file is
    not ``ipcontroller-client.json``); a controller started by hand writes only the client file."""
    import json
    from pathlib import Path

    from IPython.core.profiledir import ProfileDir, ProfileDirError
    from IPython.paths import get_ipython_dir
    try:
        profile_dir = ProfileDir.find_profile_dir_by_name(get_ipython_dir(), source).location
    except ProfileDirError:
        raise usage_error(f"--cluster {source}: no ipyparallel cluster reachable there (no profile {source!r} "
                          f"in {get_ipython_dir()})", _choices()) from None
    running = _running_clusters(ipp, profile_dir)
    if len(running) == 1:
        return running[0], running[0].connect_client_sync
    if len(running) > 1:
        files = [c.cluster_file for c in running]
        raise usage_error(f"--cluster {source}: {len(running)} clusters run in profile {source!r}; name one by its "
                          "cluster file", [f"--cluster {f}" for f in files])
    client_file = Path(profile_dir) / "security" / "ipcontroller-client.json"
    if not client_file.is_file():   # (ipyparallel's Client would wait for one to appear)
        raise usage_error(f"--cluster {source}: no cluster is running in profile {source!r} ({profile_dir})",
                          _choices())
    _check_answers(source, json.loads(client_file.read_text()))
    return None, lambda: ipp.Client(profile=source, timeout=10)


def _running_clusters(ipp, profile_dir: str) -> list:
    """The clusters whose controller runs, of the cluster files in ``profile_dir`` (ipyparallel removes a
    stopped cluster's file; a killed kernel's stays, its controller gone)."""
    import glob
    import os
    running = []
    for path in sorted(glob.glob(os.path.join(profile_dir, "security", "cluster-*.json"))):
        try:
            cluster = ipp.Cluster.from_file(path, log_level=50)
        except Exception:  # a file being written, or another version's: not a running cluster
            logger.debug("reading the cluster file %s failed", path, exc_info=True)
            continue
        if cluster.controller is not None:
            running.append(cluster)
    return running


def _check_answers(source: str, info: dict) -> None:
    """``UsageError`` at once when nothing listens at a client file's registration address (a stale file:
    ipyparallel's Client would wait its whole timeout). Tunnelled connections are left to the Client."""
    import socket
    if info.get("ssh") or not str(info.get("interface", "")).startswith("tcp://") or not info.get("registration"):
        return
    host = info["interface"].split("://", 1)[1]
    host = "127.0.0.1" if host in ("*", "0.0.0.0") else host
    try:
        with socket.create_connection((host, int(info["registration"])), timeout=2.0):
            return
    except (OSError, ValueError):
        raise usage_error(f"--cluster {source}: the ipyparallel controller is gone (nothing answers at "
                          f"{host}:{info['registration']}); start the cluster again", _choices()) from None


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


def start_cluster(engines: str = "local", n: int | None = None, profile: str | None = None,
                  oversubscribe: bool = False) -> ClusterRanks:
    """Start a cluster (``ipp.Cluster(engines=..., n=...)``) and use it for ``--cluster`` cells."""
    ipp = _ipyparallel()
    if n is not None and n < 1:
        raise usage_error(f"%dataparallel cluster start -n {n}: a cluster needs at least one engine",
                          ["-n 1", "-n 2", "no -n (ipyparallel's default: one engine per core)"])
    _check_engine_count(engines, n, oversubscribe)
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
    stop_cluster()   # (only once the new one's options are known good: a misspelling keeps the running one)
    from ... import session
    session.register_closer("cluster", stop_cluster)   # %unload_ext and exit stop it too
    global _starting, _started
    _starting = cluster   # (stop_cluster, from an exit hook, stops one that is starting too)
    _watch(cluster)   # before anything starts: a kernel killed while it starts leaves nothing either
    client = None
    try:
        with _leaving_px_alone():
            client = cluster.start_and_connect_sync()
        client.wait_for_engines(n or 1, timeout=600)
    except BaseException as exc:  # noqa: BLE001 - an interrupt too: whatever started is stopped, then said
        _abandon(cluster, client, exc, engines)
    finally:
        _starting = None
    assert client is not None   # (_abandon raised otherwise)
    _started = ClusterRanks(client=client, source=f"the cluster started here ({engines}, {len(client.ids)} engines)",
                            cluster=cluster, owned=True)
    _replace(_started)
    return _started


def _watch(cluster) -> None:
    """The watcher that stops ``cluster`` if the kernel ends without stopping it (:mod:`.cluster_watch`)."""
    global _watcher
    try:
        _watcher = cluster_watch.watch(cluster.cluster_file, cluster.cluster_id, str(cluster.profile_dir))
    except (OSError, subprocess.SubprocessError):
        logger.warning("could not start the watcher that stops the cluster with the kernel", exc_info=True)


def _abandon(cluster, client, exc: BaseException, engines: str) -> NoReturn:
    """A start that failed or was interrupted: stop what it had started (every process of it on this
    machine too, recorded by ipyparallel or not), then say so: ``CellInterrupted`` or ``UsageError``."""
    from ...errors import CellInterrupted
    from ...procs.teardown import no_interrupts
    with no_interrupts():   # (a second interrupt must not leave half of it running)
        _end(cluster, client)
        _release_watcher()
    if isinstance(exc, KeyboardInterrupt):
        _retrieve_interrupted_tasks()
        raise CellInterrupted("%dataparallel cluster start was interrupted; every process it had started was "
                              "stopped") from None
    raise usage_error(f"%dataparallel cluster start --engines {engines}: the cluster did not start "
                      f"({type(exc).__name__}: {exc}); every process it had started was stopped",
                      ["--engines local", f"--engines {engines} once its launcher works here (mpiexec, sbatch, "
                                          "ssh... on the PATH)"]) from None


def _retrieve_interrupted_tasks() -> None:
    """The interrupt ended ipyparallel's start inside its event loop, leaving its asyncio task done with
    the KeyboardInterrupt unread: asyncio would print "Task exception was never retrieved" and the
    traceback into some later cell, whenever the task is collected. Read it now."""
    import asyncio
    import gc
    for task in gc.get_objects():   # (by type: isinstance would ask deprecated objects for their __class__)
        if issubclass(type(task), asyncio.Task) and task.done() and not task.cancelled() \
                and getattr(task.get_coro(), "__qualname__", "").startswith("Cluster."):
            task.exception()


def _end(cluster, client=None) -> None:
    """Stop ``cluster`` through ipyparallel (its launchers stop engines on other hosts too), then end
    what it still runs on this machine: what ipyparallel did not record, a dead controller's schedulers."""
    from .cluster_procs import end, processes
    try:
        if client is not None:
            client.close()
        cluster.stop_cluster_sync()
    except Exception:  # stopping what is already gone; ended below all the same
        logger.debug("stopping the cluster through ipyparallel failed", exc_info=True)
    left = end(processes(cluster.cluster_id, str(cluster.profile_dir)))
    if left:
        logger.warning("processes of the cluster still running after SIGKILL: %s", left)


def _release_watcher() -> None:
    global _watcher
    if _watcher is not None:
        _watcher.release()
        _watcher = None


def _check_engine_count(engines: str, n: int | None, oversubscribe: bool) -> None:
    """Local engines are processes of this machine, as the local pool's ranks are: the same bound, before
    anything starts (``UsageError`` unless ``oversubscribe``; a note above the cores)."""
    from ...procs.cpus import check_process_count
    if engines != "local":
        if oversubscribe:
            raise usage_error(f"--oversubscribe is about this machine's cores, and --engines {engines} places its "
                              "engines elsewhere", ["drop --oversubscribe", "--engines local --oversubscribe"])
        return
    crowded = check_process_count(n, oversubscribe, flag="-n") if n is not None else None
    if crowded:
        from ...display import note
        note(crowded)


def stop_cluster() -> str:
    """Stop the cluster started here (its engines and controller) and forget the one in use. Returns
    what was done, for the user ("" where there was neither)."""
    global _started
    ranks, started, starting = _current, _started, _starting
    _started = None
    _replace(None)
    if started is not None:
        _end(started.cluster, started.client)
    if starting is not None:
        _end(starting)
    _release_watcher()
    if started is not None:
        return "the cluster was stopped"
    if ranks is not None:
        # not ours to stop: the notebook's ipp.Cluster, or ipcluster's, goes on serving its %px and clients
        return (f"no longer uses {ranks.source}; it was not started here, so it keeps running (stop it where it "
                "was started: cluster.stop_cluster_sync(), or ipcluster stop)")
    return ""


def form(ranks: ClusterRanks, nprocs: int | None, backend: str | None, timeout: float) -> ClusterRanks:
    """Make the engines ranks (once; again after a failure): ``UsageError`` before anything starts when
    there are too few, or they lack torch or gpumagic."""
    client = ranks.client
    if not ranks.controller_alive():   # (checked every cell: before anything of it travels)
        raise usage_error(f"--cluster {ranks.source}: the ipyparallel controller is gone; the engines cannot be "
                          "reached", _choices())
    registered = set(client.ids)
    # The formed ranks serve while every one is registered and they are what the cell asks for: without
    # --nprocs, every engine (not the last cell's --nprocs N, nor fewer than were added since).
    if ranks.formed and all(r.alive and r.engine in registered for r in ranks.ranks) \
            and (nprocs or len(registered)) == ranks.world_size \
            and (backend in (None, ranks.backend)) and timeout == ranks.timeout:
        return ranks
    gone = [r for r in ranks.ranks if not r.alive or r.engine not in registered]
    if ranks.owned and gone:
        old = set(client.ids) | {r.engine for r in ranks.ranks}
        ranks.cluster.restart_engines_sync()       # engines stopped or dead after the last cell: new ones
        deadline = time.monotonic() + 600
        while len(set(client.ids) - old) < len(ranks.ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
    engines = sorted(set(client.ids) - {r.engine for r in gone})
    if gone and not engines:
        names = ", ".join(f"engine {r.engine} ({r.host})" for r in gone)
        raise usage_error(f"--cluster {ranks.source}: the cluster has no engines left: {names} of the last cell's "
                          "ranks are gone (stopped, or they died); start them again", _restart_choices())
    if gone and nprocs is None and len(engines) < len(ranks.ranks):
        names = ", ".join(f"engine {r.engine} ({r.host})" for r in gone)
        raise usage_error(f"--cluster {ranks.source}: {names} of the last cell's ranks is gone (stopped, or it "
                          f"died); start it again, or run on the {len(engines)} left with --nprocs",
                          [*_restart_choices(), "--nprocs N"])
    if not engines:
        raise usage_error(f"--cluster {ranks.source}: the cluster has no engines", _restart_choices())
    if nprocs is not None and nprocs > len(engines):
        raise usage_error(f"--nprocs {nprocs}: the cluster ({ranks.source}) has {len(engines)} engine(s)",
                          [f"--nprocs {k}" for k in range(1, len(engines) + 1)])
    facts = _describe(client, engines, ranks.source)
    chosen = sorted(engines, key=lambda e: (facts[e]["host"], e))[: nprocs or len(engines)]
    ranks.ranks = _place(chosen, facts)
    ranks.backend = _backend(backend, ranks.ranks)
    ranks.timeout = timeout
    _join(ranks)
    ranks.formed = True
    ranks.kept.forget()
    return ranks


def _restart_choices() -> list[str]:
    """How to start engines again: ipcluster's command, or the notebook's own ``ipp.Cluster``."""
    return ["ipcluster engines -n N (a cluster ipcluster started)",
            "cluster.start_engines_sync(n=N) (an ipp.Cluster the notebook started)"]


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
    from ...display import note
    first = ranks.ranks[0]
    hosts = {r.host for r in ranks.ranks}
    if len(hosts) > 1 and first.address.startswith("127."):
        note(f"--cluster: rank 0's engine ({first.host}) reaches the controller over loopback, so the engines on "
             f"other hosts may not reach its rendezvous at {first.address}: start the controller on an address "
             "the other hosts reach (ipcontroller --ip ...)")
    client = ranks.client
    # Every engine on this host (loopback addresses, or one host name): the store listens on loopback only.
    here = len(hosts) == 1 or all(r.address.startswith("127.") for r in ranks.ranks)
    ranks.store_host, ranks.store_address = ("127.0.0.1", "127.0.0.1") if here else ("0.0.0.0", first.address)
    port = client[first.engine].apply_async(call_engine, "open_store", ranks.world_size, ranks.timeout,
                                            ranks.store_host).get(timeout=120)
    nodes = sorted(hosts)
    local_world = {h: sum(r.host == h for r in ranks.ranks) for h in hosts}
    joins = [client[r.engine].apply_async(
        call_engine, "join", r.rank, ranks.world_size, r.local_rank, r.device, ranks.backend, ranks.store_address,
        port, ranks.timeout, {"LOCAL_RANK": str(r.local_rank), "LOCAL_WORLD_SIZE": str(local_world[r.host]),
                              "GROUP_RANK": str(nodes.index(r.host)), "GROUP_WORLD_SIZE": str(len(nodes))})
        for r in ranks.ranks]
    try:
        for r, j in zip(ranks.ranks, joins):
            r.pid = j.get(timeout=ranks.timeout if ranks.timeout < 600 else 600)["pid"]
    except Exception as exc:  # noqa: BLE001 - the engines' own error, said as theirs
        ranks.close_store([r.engine for r in ranks.ranks], wait=False)
        raise WorkerError(-1, None, type(exc).__name__, f"the engines could not form the process group at "
                          f"{ranks.store_address}:{port}: {exc}") from None
    ranks.close_store([r.engine for r in ranks.ranks])   # formed: the store closes until a cell needs it
