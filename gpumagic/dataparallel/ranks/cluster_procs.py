"""The processes a cluster started here runs on this machine: found, and ended, however the cluster went.

ipyparallel gives every process it launches on this machine (the controller, each engine, an
``mpiexec``) the cluster's ``IPP_CLUSTER_ID`` and ``IPP_PROFILE_DIR`` in its environment, and the
processes those start (the controller's schedulers, an engine's nanny) inherit them. So they are
found by that environment, whoever their parent is now: after a start that was interrupted or
failed before ipyparallel recorded them, after the controller died (its schedulers, reparented,
would keep running), and from the watcher once the kernel is gone (:mod:`.cluster_watch`).
Processes on other hosts are the cluster's launchers' to stop (``stop_cluster_sync``).

Runs in the kernel and in the watcher: no IPython.
"""
from __future__ import annotations

import logging
import os

import psutil

logger = logging.getLogger(__name__)

__all__ = ["processes", "end", "GRACE"]

GRACE = 3.0   # seconds between SIGTERM and SIGKILL


def processes(cluster_id: str, profile_dir: str) -> list[psutil.Process]:
    """This user's processes launched for the cluster ``cluster_id`` of ``profile_dir`` (never this
    process or its parents). None for a cluster without an id: the environment would not tell it apart."""
    if not cluster_id:
        return []
    profile = os.path.realpath(profile_dir)
    own = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    uid = os.getuid()
    found = []
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.pid in own or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue   # gone, or not ours to read
        if env.get("IPP_CLUSTER_ID") == cluster_id and os.path.realpath(env.get("IPP_PROFILE_DIR", "")) == profile:
            found.append(proc)
    return found


def end(procs: list[psutil.Process], grace: float = GRACE) -> list[int]:
    """SIGTERM each of ``procs``, SIGKILL those still running ``grace`` seconds later, and reap the
    kernel's own children among them; returns the pids still running after that (none, normally)."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass   # gone already
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=2.0)
    if alive:   # pragma: no cover - uninterruptible sleep
        logger.warning("cluster processes %s did not end after SIGKILL", [p.pid for p in alive])
    return [p.pid for p in alive]
