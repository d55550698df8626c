"""The kernel's side of a set of workers (gpumagic.procs.group) and the worker loop they run
(gpumagic.procs.worker), with real processes: started by fork and spawn, heard from, ended."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from gpumagic.errors import WorkerDied, WorkerError
from gpumagic.procs.failures import primary_error
from gpumagic.procs.group import WorkerGroup
from gpumagic.procs.worker import WorkerConfig

THIS = "tests.test_procs_group"


# ---------------------------------------------------------------- tasks (run in the workers)

def report_task(ctx, meta, data):
    print(f"hello from {ctx.rank}")
    ctx.send({"rank": ctx.rank, "note": meta["note"]})
    return {"rank": ctx.rank, "world": ctx.world_size, "pid": os.getpid(), "pgid": os.getpgrp(),
            "threads": torch.get_num_threads(), "env": os.environ.get("GPUMAGIC_TEST_VALUE"),
            "data": None if data is None else bytes(data.numpy()).decode()}


def descriptor_task(ctx, meta, data):
    """Writes below Python: a raw write, C's buffered printf, a subprocess, then fails where asked."""
    import ctypes
    os.write(1, f"fd out {ctx.rank}\n".encode())
    os.write(2, f"fd err {ctx.rank}\n".encode())
    ctypes.CDLL(None).printf(f"printf {ctx.rank}\n".encode())   # held in C's buffer until flushed
    subprocess.run(["echo", f"child {ctx.rank}"], check=True)
    if ctx.rank == meta.get("bad_rank"):
        raise ValueError("after writing")
    return ctx.rank


def failing_task(ctx, meta, data):
    if ctx.rank == meta["bad_rank"]:
        raise ValueError(f"rank {ctx.rank} refuses")
    return "fine"


def dying_task(ctx, meta, data):
    if ctx.rank == 1:
        os._exit(3)
    time.sleep(30)


def stubborn_task(ctx, meta, data):
    """Ignores SIGTERM and leaves a child in its process group: only SIGKILL to the group ends both."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ctx.send(child.pid)
    time.sleep(60)


def _configs(n, method, **kw):
    return [WorkerConfig(rank=r, world_size=n, method=method, parent_pid=os.getpid(), **kw) for r in range(n)]


def _alive(pid) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------- workers with one task

@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_run_their_first_task_report_and_exit(method, monkeypatch):
    from gpumagic.procs.bulk import Outgoing
    monkeypatch.setenv("GPUMAGIC_TEST_VALUE", "from the kernel")
    out = Outgoing()
    data = out.get(5)
    data.copy_(torch.frombuffer(bytearray(b"bytes"), dtype=torch.uint8))   # reaches them through shared memory
    meta = {"note": "n", "all_output": True}
    group = WorkerGroup(["cpu", "cpu"], name="test")
    printed, messages = [], []
    try:
        group.start(method, _configs(2, method, threads=1), first=[f"{THIS}:report_task", meta, out.handle(data)])
        out.close()
        results, errors, pending = group.collect(on_output=lambda r, s, t: printed.append((r, s, t)),
                                                 on_message=lambda r, m: messages.append((r, m)))
    finally:
        codes = group.end(wait=5.0)
    assert errors == {} and pending == set()
    payloads = [p for p, _ in results]
    assert [p["rank"] for p in payloads] == [0, 1] and {p["world"] for p in payloads} == {2}
    assert all(p["pgid"] == p["pid"] != os.getpid() for p in payloads)   # each leads its own process group
    assert {p["threads"] for p in payloads} == {1}
    assert {p["env"] for p in payloads} == {"from the kernel"} and {p["data"] for p in payloads} == {"bytes"}
    assert sorted(messages) == [(0, {"rank": 0, "note": "n"}), (1, {"rank": 1, "note": "n"})]
    text = {r: "".join(t for rr, s, t in printed if rr == r and s == "stdout") for r in (0, 1)}
    assert text == {0: "hello from 0\n", 1: "hello from 1\n"}
    assert codes == [0, 0] and not any(_alive(p["pid"]) for p in payloads)


def _sockets() -> set:
    """This process's open sockets (a duplex pipe is a socket pair)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                out.add(fd)
        except OSError:
            continue
    return out


def test_a_worker_that_cannot_start_leaves_no_pipe_open():
    """Spawn pickles each worker's arguments: a lock among them fails the start, and the kernel's
    end of that worker's pipe is closed with the rest, even while the error is kept (a notebook
    keeps the last one, frames and all, for ``%debug``)."""
    import threading
    group = WorkerGroup(["cpu", "cpu"], name="test")
    before = _sockets()
    with pytest.raises(TypeError, match="pickle") as kept:
        group.start("spawn", _configs(2, "spawn"), first=[f"{THIS}:report_task", {"lock": threading.Lock()}, None])
    assert [r.process for r in group.ranks] == [None, None]
    assert _sockets() <= before
    del kept


def test_only_rank_0_prints_unless_every_rank_is_asked_to():
    group = WorkerGroup(["cpu", "cpu"], name="test")
    printed = []
    try:
        group.start("fork", _configs(2, "fork"), first=[f"{THIS}:report_task", {"note": "n"}, None])
        group.collect(on_output=lambda r, s, t: printed.append(r))
    finally:
        group.end(wait=5.0)
    assert set(printed) == {0}


@pytest.mark.parametrize("all_output", [False, True])
def test_what_ranks_write_below_python_follows_their_prints(all_output):
    """C-level output and a subprocess's reach the kernel as the rank's output, before its result or
    error (before, they went straight to the kernel's descriptors: every rank's, into the cell)."""
    group = WorkerGroup(["cpu", "cpu"], name="test")
    printed: list = []
    try:
        group.start("spawn", _configs(2, "spawn"), first=[f"{THIS}:descriptor_task",
                                                         {"all_output": all_output, "bad_rank": 0}, None])
        _, errors, _ = group.collect(on_output=lambda r, s, t: printed.append((r, s, t)))
    finally:
        group.end(wait=5.0)
    assert primary_error(errors).message == "after writing" and errors.keys() == {0}
    for rank in (0, 1) if all_output else (0,):
        out = "".join(t for r, s, t in printed if r == rank and s == "stdout")
        err = "".join(t for r, s, t in printed if r == rank and s == "stderr")
        assert sorted(out.splitlines()) == sorted([f"fd out {rank}", f"printf {rank}", f"child {rank}"]), out
        assert err == f"fd err {rank}\n"
    if not all_output:
        assert {r for r, _, _ in printed} == {0}


def test_an_exception_is_reported_with_its_rank_and_the_others_finish():
    group = WorkerGroup(["cpu", "cpu"], name="test")
    try:
        group.start("fork", _configs(2, "fork"), first=[f"{THIS}:failing_task", {"bad_rank": 1}, None])
        results, errors, pending = group.collect()
    finally:
        group.end(wait=5.0)
    assert results[0] == ("fine", None) and results[1] is None and pending == set()
    error = primary_error(errors)
    assert type(error) is WorkerError and error.rank == 1 and error.exc_type == "ValueError"
    assert error.message == "rank 1 refuses" and error.pid == group.ranks[1].pid
    assert 'raise ValueError(f"rank {ctx.rank} refuses")' in error.remote_traceback
    assert error.all_errors.keys() == {1}


def test_a_worker_that_dies_without_a_word_is_a_worker_died():
    group = WorkerGroup(["cpu", "cpu"], name="test")
    t0 = time.monotonic()
    try:
        group.start("fork", _configs(2, "fork"), first=[f"{THIS}:dying_task", {}, None])
        results, errors, pending = group.collect(grace=0.3)
    finally:
        codes = group.end()
    # Rank 0 was still sleeping: collect gave up on it 0.3 s after rank 1 died, and end() stopped it.
    assert pending == {0} and time.monotonic() - t0 < 10
    error = primary_error(errors)
    assert isinstance(error, WorkerDied) and error.rank == 1
    assert error.message == "the worker exited with code 3"
    assert codes == [-signal.SIGTERM, 3]


def test_end_kills_a_worker_that_ignores_sigterm_and_its_process_group():
    group = WorkerGroup(["cpu"], name="test")
    try:
        group.start("fork", _configs(1, "fork"), first=[f"{THIS}:stubborn_task", {}, None])
        msg = group.ranks[0].conn.recv()
        while msg[0] != "msg":
            msg = group.ranks[0].conn.recv()
        child = msg[1]
        assert _alive(child)
    finally:
        t0 = time.monotonic()
        codes = group.end(grace=0.5)
    assert codes == [-signal.SIGKILL] and time.monotonic() - t0 < 5
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the worker's child outlived it"
    assert group.ranks[0].conn is None and group.ranks[0].process is None


def test_a_worker_whose_kernel_is_gone_exits():
    # die_with_parent: a worker started for a parent that is not its parent leaves at once.
    group = WorkerGroup(["cpu"], name="test")
    config = WorkerConfig(rank=0, world_size=1, method="fork", parent_pid=1)
    try:
        group.start("fork", [config], first=[f"{THIS}:report_task", {"note": "n"}, None])
        _, errors, _ = group.collect()
    finally:
        codes = group.end(wait=5.0)
    assert errors[0]["died"] and codes == [1]
