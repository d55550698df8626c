"""Faults at awkward moments: interrupts while the pool or the fork server is in the middle of
something, and a rank that dies while its result travels."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpumagic.errors import WorkerDied
from gpumagic.procs.pool import WorkerPool
from tests.dataparallel_helpers import alive

THIS = "tests.test_procs_faults_interrupts"


def spin_ignoring_sigterm(ctx, meta, data):
    # as a framework's own SIGTERM handler would: the kernel's SIGTERM no longer ends the rank
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx.send("spinning")
    while True:
        time.sleep(0.01)


def rank_of(ctx, meta, data):
    return {"rank": ctx.rank}


def die_after_result(ctx, meta, data):
    if ctx.rank == 0:   # as if killed between its result and the descriptor of the result's bytes
        with ctx._send_lock:
            ctx.conn.send(("done", {"rank": 0}, ("shm", 1, 4096, 16, True)))
        os._exit(9)
    return {"rank": 1}


@pytest.fixture
def pool():
    pool = WorkerPool(["cpu", "cpu"], "gloo", name="faults", start_timeout=120).start()
    yield pool
    pool.kill()


def test_a_second_interrupt_during_teardown_still_ends_the_ranks(pool):
    pids = list(pool.pids)
    spinning = set()

    def on_message(rank, msg):
        spinning.add(rank)
        if len(spinning) == pool.world_size:
            # the first interrupt; the second lands in the 2 s between SIGTERM (ignored) and SIGKILL
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pool.run(f"{THIS}:spin_ignoring_sigterm", on_message=on_message)
    assert pool.state == "dead" and not pool.alive
    assert [p for p in pids if alive(p)] == []
    fresh = WorkerPool(["cpu", "cpu"], "gloo", name="faults", start_timeout=120).start()
    try:
        assert [p["rank"] for p, _ in fresh.run(f"{THIS}:rank_of")] == [0, 1]
    finally:
        fresh.kill()


def test_a_rank_that_dies_while_its_result_travels_is_reported_as_dead(pool):
    with pytest.raises(WorkerDied) as err:
        pool.run(f"{THIS}:die_after_result")
    assert err.value.rank == 0 and "exited with code 9" in err.value.message
    assert pool.state == "dead" and [p for p in pool.pids if alive(p)] == []


SERVER_SCRIPT = """
import multiprocessing, os, signal, sys, time
from gpumagic.procs import forkserver
forkserver.start_in_background(["torch"])
pid = forkserver.ours()
os.kill(pid, signal.SIGINT)   # Jupyter interrupts the kernel's whole process group, the server too
time.sleep(0.5)
alive = os.waitpid(pid, os.WNOHANG) == (0, 0)
p = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0,))
p.start()
p.join(60)
print(alive, p.exitcode, forkserver._pid() == pid)
forkserver.stop()
"""


def test_an_interrupt_while_the_fork_server_imports_torch_leaves_it_running():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", SERVER_SCRIPT], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["True", "0", "True"], out.stdout + out.stderr
