"""The persistent pool (gpumagic.procs.pool): spawned ranks in a gloo process group, tasks, and what
a failure leaves: a symmetric error keeps the pool, anything else ends it."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile

import psutil
import pytest
import torch

from gpumagic.errors import WorkerDied, WorkerError
from gpumagic.procs.pool import WorkerPool

THIS = "tests.test_procs_pool"


def all_reduce_task(ctx, meta, data):
    import torch.distributed as dist
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    received = None if data is None else data.clone()
    out = ctx.outgoing.get(4)
    out.copy_(torch.tensor([ctx.rank] * 4, dtype=torch.uint8))
    return {"sum": t.item(), "received": received, "pid": os.getpid()}, out


def raise_everywhere(ctx, meta, data):
    raise KeyError("same on every rank")


def raise_on_rank_1(ctx, meta, data):
    import torch.distributed as dist
    if ctx.rank == 1:
        raise RuntimeError("only rank 1")
    dist.barrier()   # rank 0 would wait here forever: the pool must not be reused


def die_on_rank_0(ctx, meta, data):
    if ctx.rank == 0:
        os._exit(7)
    return "survived"


@pytest.fixture
def pool():
    pool = WorkerPool(["cpu", "cpu"], "gloo", name="test", start_timeout=120).start()
    yield pool
    pool.kill()


def _alive(pid) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_tasks_run_in_a_process_group_and_bulk_bytes_travel_both_ways(pool):
    data = pool.outgoing.get(3)
    data.copy_(torch.tensor([7, 8, 9], dtype=torch.uint8))
    results = pool.run(f"{THIS}:all_reduce_task", data=data)
    assert [p["sum"] for p, _ in results] == [3.0, 3.0]                     # 1 + 2 through gloo
    assert all(p["received"].tolist() == [7, 8, 9] for p, _ in results)
    assert [back.tolist() for _, back in results] == [[0] * 4, [1] * 4]    # each rank's own buffer
    assert [p["pid"] for p, _ in results] == pool.pids
    status = pool.status()
    assert status["state"] == "running" and status["tasks_run"] == 1 and status["backend"] == "gloo"
    # The ranks met in a file in a directory only this user can enter; the kernel listens nowhere.
    kind, path = status["rendezvous"].split(" ", 1)
    directory = os.stat(os.path.dirname(path))
    assert kind == "file" and os.path.exists(path)
    assert directory.st_uid == os.getuid() and stat.S_IMODE(directory.st_mode) == 0o700
    assert [c for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN] == []


def test_the_same_error_on_every_rank_keeps_the_pool(pool):
    with pytest.raises(WorkerError) as err:
        pool.run(f"{THIS}:raise_everywhere")
    assert err.value.exc_type == "KeyError" and err.value.rank == 0 and err.value.all_errors.keys() == {0, 1}
    assert pool.alive
    assert [p["sum"] for p, _ in pool.run(f"{THIS}:all_reduce_task")] == [3.0, 3.0]


def test_an_error_on_one_rank_ends_the_pool(pool):
    pids = list(pool.pids)
    with pytest.raises(WorkerError) as err:
        pool.run(f"{THIS}:raise_on_rank_1")
    assert err.value.rank == 1 and err.value.message == "only rank 1"
    assert not pool.alive and pool.state == "dead" and not any(_alive(p) for p in pids)
    with pytest.raises(WorkerDied, match="not running"):
        pool.run(f"{THIS}:all_reduce_task")


def test_a_rank_that_dies_ends_the_pool(pool):
    pids = list(pool.pids)
    with pytest.raises(WorkerDied) as err:
        pool.run(f"{THIS}:die_on_rank_0")
    assert err.value.rank == 0 and err.value.message == "the worker exited with code 7"
    assert pool.state == "dead" and not any(_alive(p) for p in pids)


def test_stop_asks_the_ranks_to_leave_and_removes_the_rendezvous(pool):
    pids = list(pool.pids)
    directory = os.path.dirname(pool.status()["rendezvous"].split(" ", 1)[1])
    assert os.path.isdir(directory)
    pool.stop()
    assert pool.state == "stopped" and not any(_alive(p) for p in pids)
    assert [r.exitcode for r in pool.ranks] == [0, 0]      # they left by themselves
    assert not os.path.exists(directory)


def test_a_killed_kernels_rendezvous_is_removed_by_the_next_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = tmp_path / f"gpumagic-rendezvous-{int(dead.stdout)}-abc123"
    stale.mkdir(mode=0o700)
    (stale / "store").write_bytes(b"left by a kernel killed outright")
    live = tmp_path / f"gpumagic-rendezvous-{os.getpid()}-def456"
    live.mkdir(mode=0o700)
    pool = WorkerPool(["cpu", "cpu"], "gloo", name="test", start_timeout=120).start()
    try:
        ours = os.path.dirname(pool.status()["rendezvous"].split(" ", 1)[1])
        assert os.path.dirname(ours) == str(tmp_path)
        assert not stale.exists() and live.exists()          # a running kernel's stays
    finally:
        pool.stop()
    assert not os.path.exists(ours)
