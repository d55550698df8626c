"""A cluster started by ``%dataparallel cluster start`` ends with the kernel, however the kernel ends.

ipyparallel stops the clusters it started from an ``atexit`` hook, but a kernel
that Jupyter shuts down or restarts often never runs it: once multiprocessing's
resource tracker runs (any local worker pool starts it), ipykernel's shutdown
waits on that child, which ignores SIGTERM, and Jupyter SIGTERMs the kernel
first. The controller and engines were then left running with no owner.

So :func:`watch` starts a small watcher, detached from the kernel (not its
child, so the kernel's shutdown does not signal it), that reads a pipe from the
kernel. It starts before the cluster does, so that a kernel killed while the
cluster starts leaves nothing either. ``%dataparallel cluster stop`` tells it the
cluster is stopped (:meth:`Watch.release`); if the pipe closes without that, the
kernel is gone, and the watcher stops the cluster through ipyparallel's own
cluster file (so remote launchers, Slurm's included, stop their engines as they
would on ``cluster stop``), then ends what the cluster still runs on this machine,
found by its environment (:mod:`.cluster_procs`): what ipyparallel had not yet
recorded in that file, and a dead controller's schedulers.

Run as ``python -m gpumagic.dataparallel.ranks.cluster_watch CLUSTER_FILE CLUSTER_ID PROFILE_DIR``,
it is the watcher itself.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

logger = logging.getLogger(__name__)

__all__ = ["Watch", "watch", "main"]

RELEASE = b"released\n"   # what the kernel writes when it stopped the cluster itself


class Watch:
    """The kernel's end of a watcher's pipe."""

    def __init__(self, pipe):
        self._pipe = pipe

    def release(self) -> None:
        """The cluster was stopped here: the watcher leaves without doing anything."""
        if self._pipe is None:
            return
        try:
            self._pipe.write(RELEASE)
            self._pipe.close()
        except OSError:   # the watcher is gone already
            logger.debug("the cluster watcher was gone", exc_info=True)
        self._pipe = None


def watch(cluster_file: str, cluster_id: str, profile_dir: str) -> Watch:
    """Start a watcher that stops the cluster ``cluster_id`` of ``profile_dir`` (its file: ``cluster_file``)
    when this process ends."""
    # The launcher forks the watcher and exits at once, so the watcher is nobody's child here.
    launcher = subprocess.Popen([sys.executable, "-m", __name__, cluster_file, cluster_id, profile_dir],
                                stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                close_fds=True)
    launcher.wait(timeout=30)
    pipe = launcher.stdin
    launcher.stdin = None   # ours to close; Popen must not close it when the launcher is collected
    return Watch(pipe)


def _stop(cluster_file: str, cluster_id: str, profile_dir: str) -> bool:
    """Stop the cluster through its file, then end what it runs here; whether all of it went."""
    from .cluster_procs import end, processes
    stopped = True
    if os.path.exists(cluster_file):
        try:
            import ipyparallel as ipp
            ipp.Cluster.from_file(cluster_file).stop_cluster_sync()
        except Exception:  # noqa: BLE001 - a file half written, a controller gone: ended below all the same
            stopped = False
    return not end(processes(cluster_id, profile_dir)) and stopped


def main(argv: list[str]) -> int:
    cluster_file, cluster_id, profile_dir = argv[:3]
    if os.fork():
        return 0   # the launcher: done, so that the watcher below is reparented away from the kernel
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)   # the kernel's group and session are not ours to follow
    said = sys.stdin.buffer.read(len(RELEASE))
    if said == RELEASE:
        return 0
    return 0 if _stop(cluster_file, cluster_id, profile_dir) else 1   # (nobody is left to tell)


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))
