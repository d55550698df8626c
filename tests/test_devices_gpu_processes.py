"""``%gpumem --who``'s naming: the fake NVML lists real processes (this kernel, workers, orphans, another
user's, kernels under a real Jupyter server), and each must be named for what it is."""
from __future__ import annotations

import json
import os
import socket
import sys
import time

import psutil
import pytest

from gpumagic.devices import jupyter_servers
from gpumagic.devices.gpu_processes import who
from gpumagic.devices.process_names import Kind, name_processes
from gpumagic.procs import marks
from gpumagic.procs.kernel_files import connection_file, kernel_id
from tests.fake_nvml import NO_SUCH_PID, four_gpu_machine, installed
from tests.sharing_helpers import (
    JupyterServerProcess,
    Started,
    alive,
    detached,
    live_worker,
    multiprocessing_orphan,
    orphan_worker,
    other_users_process,
    wait_until,
)

GiB = 2**30


@pytest.fixture
def machine(monkeypatch):
    yield from installed(four_gpu_machine(), monkeypatch)



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real Jupyter server with one notebook's kernel; the kernel forks a child that lives on."""
    procs = Started()
    server = JupyterServerProcess(procs, tmp_path_factory.mktemp("jupyter"))
    try:
        server.start()
        kid, pid = server.start_kernel("work/analysis.ipynb")
        child = int(server.execute(kid, "import os, time\nchild = os.fork()\nif child == 0:\n    time.sleep(600)\n"
                                        "    os._exit(0)\nprint(child)").split()[-1])
        procs.add(child)
        yield server, kid, pid, child
    finally:
        server.stop()
        procs.end_all()


def test_the_kernel_connection_file_and_id_come_from_the_command_line():
    argv = ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "/run/jupyter/kernel-5e1f-77ab.json"]
    assert connection_file(argv) == "/run/jupyter/kernel-5e1f-77ab.json"
    assert kernel_id(connection_file(argv)) == "5e1f-77ab"
    assert connection_file(["python", "--f=/x/kernel-v2-12.json"]) == "/x/kernel-v2-12.json"
    assert connection_file(["python", "-f", "/x/notes.json"]) is None
    assert connection_file(["python", "train.py", "-f"]) is None and kernel_id(None) is None


def test_each_process_is_named_for_what_it_is(machine, started, tmp_path):
    me = os.getpid()
    worker = live_worker(started, tmp_path, rank=1)
    orphan, dead_kernel = orphan_worker(started, tmp_path, rank=0)
    spawned = multiprocessing_orphan(started, tmp_path)
    other, other_user = other_users_process(started)
    plain = detached(started, [sys.executable, "-c", "import time; time.sleep(600)", "train.py"])
    machine.gpus[0]["processes"] = [(me, 3 * GiB), (worker, GiB), (orphan, 5 * GiB), (other, 2 * GiB)]
    machine.gpus[1]["processes"] = [(spawned, 512 * 2**20), (plain, 256 * 2**20), (NO_SUCH_PID, GiB)]

    report = who()
    names = {(row.device, p.pid): p.who for row, p in report.processes()}
    assert names[("cuda:0", me)].kind is Kind.THIS_KERNEL and names[("cuda:0", me)].label == "this kernel"
    assert names[("cuda:0", worker)].kind is Kind.WORKER
    assert names[("cuda:0", worker)].label == "rank 1 of this kernel"
    assert names[("cuda:0", worker)].rank == 1 and names[("cuda:0", worker)].kernel_pid == me
    orphaned = names[("cuda:0", orphan)]
    assert orphaned.kind is Kind.ORPHAN and orphaned.rank == 0 and orphaned.kernel_pid == dead_kernel
    assert orphaned.label == f"orphan: rank 0 of kernel pid {dead_kernel}, which is gone"
    assert names[("cuda:1", spawned)].kind is Kind.ORPHAN
    assert names[("cuda:1", spawned)].label == "orphan: a multiprocessing child whose parent is gone"
    assert names[("cuda:1", plain)].kind is Kind.PROCESS and names[("cuda:1", plain)].label.endswith("train.py")
    assert names[("cuda:1", NO_SUCH_PID)].kind is Kind.UNKNOWN
    # Another user's process: its user, and nothing else read of it.
    theirs = next(p for row, p in report.processes() if p.pid == other).as_dict()
    assert theirs["kind"] == "other user" and theirs["user"] == other_user
    assert theirs["label"] == f"another user's process ({other_user})"
    assert theirs["cwd"] is None and theirs["kernel_id"] is None and theirs["started"] is None
    # Largest first, and the sums are NVML's figures.
    assert [p.pid for p in report["cuda:0"].processes] == [orphan, me, other, worker]
    assert report["cuda:0"].listed == 11 * GiB and report["cuda:1"].listed == GiB + 768 * 2**20
    assert report.by_kind() == {"this kernel": 3 * GiB, "worker": GiB, "orphan": 5 * GiB + 512 * 2**20,
                                "other user": 2 * GiB, "process": 256 * 2**20, "unknown": GiB}
    assert sorted(p.pid for p in report.orphans()) == sorted([orphan, spawned])
    assert report["cuda:2"].processes == [] and "(no process)" in report.text()


def test_a_worker_whose_kernel_lives_on_is_not_an_orphan_even_taken_over_by_init(machine, started, tmp_path):
    # A fork server's workers have the server, not the kernel, as parent: the mark's kernel decides.
    kernel = detached(started, [sys.executable, "-c", "import time; time.sleep(600)"])
    worker = live_worker(started, tmp_path, rank=3, kernel_pid=kernel)
    machine.gpus[0]["processes"] = [(worker, GiB)]
    named = who()["cuda:0"].processes[0].who
    assert named.kind is Kind.WORKER and named.label == f"rank 3 of kernel pid {kernel}"
    # The kernel ends: the same worker is an orphan now.
    os.kill(kernel, 9)
    wait_until(lambda: not alive(kernel), what="the kernel to end")
    named = who()["cuda:0"].processes[0].who
    assert named.kind is Kind.ORPHAN and named.label == f"orphan: rank 3 of kernel pid {kernel}, which is gone"


def test_a_mark_whose_pid_now_belongs_to_another_process_is_dropped(started, tmp_path):
    folder = tmp_path / "marks"
    folder.mkdir(exist_ok=True)
    pid = detached(started, [sys.executable, "-c", "import time; time.sleep(600)"])
    (folder / f"{pid}.json").write_text(json.dumps({"pid": pid, "started": 1.0, "rank": 0, "world_size": 1,
                                                    "kernel_pid": 1, "kernel_started": 1.0, "kernel_id": None}))
    assert marks.read_marks() == {}
    assert not (folder / f"{pid}.json").exists()


def test_kernels_under_a_real_jupyter_server_are_named_with_their_notebook(machine, started, server):
    srv, kid, kernel, child = server
    machine.gpus[1]["processes"] = [(kernel, 10 * GiB), (child, GiB)]
    started_at = time.monotonic()
    report = who()
    assert time.monotonic() - started_at < 2.0
    named = {p.pid: p.who for p in report["cuda:1"].processes}
    assert named[kernel].kind is Kind.KERNEL
    assert named[kernel].kernel_id == kid and named[kernel].notebook == "work/analysis.ipynb"
    assert named[kernel].label == f"kernel {kid[:8]} (work/analysis.ipynb)"
    assert named[kernel].cwd == str(srv.root / "work")
    assert named[child].kind is Kind.CHILD and named[child].label == f"child of kernel {kid[:8]} (work/analysis.ipynb)"
    assert report.notes == []
    assert report.as_dict()["devices"]["cuda:1"]["processes"][0]["notebook"] == "work/analysis.ipynb"


def test_a_process_of_a_kernel_its_server_runs_as_another_process_is_an_orphan(machine, started, server):
    # What a kernel that died and was restarted by its server leaves: a child forked from the old one,
    # naming the same connection file, taken over by init.
    srv, kid, kernel, _ = server
    left = detached(started, [sys.executable, "-c", "import time; time.sleep(600)", "-f",
                              str(srv.connection_file(kid))])
    machine.gpus[0]["processes"] = [(kernel, 10 * GiB), (left, 3 * GiB)]
    named = {p.pid: p.who for p in who()["cuda:0"].processes}
    assert named[kernel].kind is Kind.KERNEL
    assert named[left].kind is Kind.ORPHAN and named[left].notebook == "work/analysis.ipynb"
    assert named[left].label == f"orphan: a child of kernel {kid[:8]}, whose server runs that kernel as pid {kernel}"


def test_a_child_left_by_a_kernel_its_server_shut_down_is_an_orphan(machine, started, tmp_path):
    srv = JupyterServerProcess(started, tmp_path / "jupyter").start()
    kid, kernel = srv.start_kernel("b.ipynb")
    # A child in a session of its own: the server's shutdown (the kernel's process group) misses it.
    child = int(srv.execute(kid, "import os, time\nchild = os.fork()\nif child == 0:\n    os.setsid()\n"
                                 "    time.sleep(600)\n    os._exit(0)\nprint(child)").split()[-1])
    started.add(child)
    srv.shut_down_kernel(kid)
    wait_until(lambda: not alive(kernel), what="the kernel to end")
    wait_until(lambda: psutil.Process(child).ppid() != kernel, what="the child taken over by init")
    machine.gpus[0]["processes"] = [(child, 2 * GiB)]
    named = who()["cuda:0"].processes[0].who
    assert named.kind is Kind.ORPHAN and named.kernel_id == kid
    assert named.label == f"orphan: a child of kernel {kid[:8]}, which its server no longer runs"


def test_a_server_that_does_not_answer_leaves_the_kernel_named_by_id_and_folder(machine, started, tmp_path):
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)   # connections wait in the backlog, never answered
    try:
        stand_in = detached(started, [sys.executable, "-c", "import time; time.sleep(600)"])   # the "server"'s pid
        (runtime / f"jpserver-{stand_in}.json").write_text(json.dumps(
            {"pid": stand_in, "port": silent.getsockname()[1], "base_url": "/", "token": "t", "secure": False,
             "root_dir": "/"}))
        cf = runtime / "kernel-0badcafe-1234.json"
        cf.write_text("{}")
        kernel = detached(started, [sys.executable, "-c", "import time; time.sleep(600)", "-f", str(cf)])
        machine.gpus[0]["processes"] = [(kernel, 4 * GiB)]
        began = time.monotonic()
        named, notes = name_processes([kernel], timeout=0.5)
        took = time.monotonic() - began
    finally:
        silent.close()
    assert took < 1.5
    assert named[kernel].kind is Kind.KERNEL and named[kernel].notebook is None
    assert named[kernel].label == f"kernel 0badcafe in {psutil.Process(kernel).cwd()}"
    assert len(notes) == 1 and "did not answer" in notes[0] and f"pid {stand_in}" in notes[0]
    # Its kernel's connection file gone, its parent gone: what is left is a forked child, an orphan.
    cf.unlink()
    jupyter_servers.forget()
    named, _ = name_processes([kernel], timeout=0.5)
    assert named[kernel].kind is Kind.ORPHAN
    assert named[kernel].label == "orphan: a child of kernel 0badcafe, whose connection file is gone"


def test_naming_never_initialises_cuda(machine, started, tmp_path, no_cuda_init):
    machine.gpus[0]["processes"] = [(os.getpid(), GiB)]
    assert who()["cuda:0"].processes[0].who.kind is Kind.THIS_KERNEL


def wait_for_flag_task(ctx, meta, data):
    """Runs in a real gpumagic worker: says its pid, then waits for the kernel's word."""
    ctx.send(os.getpid())
    deadline = time.monotonic() + 60
    while not os.path.exists(meta["flag"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.getpid()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_real_workers_are_named_by_rank_and_take_their_mark_with_them(machine, started, tmp_path, method):
    from gpumagic.procs.group import WorkerGroup
    from gpumagic.procs.worker import WorkerConfig
    flag = tmp_path / "go"
    group = WorkerGroup(["cpu", "cpu"], name="test")
    configs = [WorkerConfig(rank=r, world_size=2, method=method, parent_pid=os.getpid(), threads=1) for r in range(2)]
    seen: dict[int, int] = {}
    named: dict[int, object] = {}

    def on_message(rank, pid):
        seen[rank] = pid
        if len(seen) == 2:   # both wait: name them now, then let them finish
            machine.gpus[0]["processes"] = [(seen[0], GiB), (seen[1], 2 * GiB)]
            named.update({p.pid: p.who for p in who()["cuda:0"].processes})
            flag.touch()
    try:
        group.start(method, configs, first=[f"{__name__}:wait_for_flag_task", {"flag": str(flag)}, None])
        _, errors, _ = group.collect(on_message=on_message)
    finally:
        group.end(wait=10.0)
    assert errors == {}
    assert [(named[seen[r]].kind, named[seen[r]].label) for r in (0, 1)] == [
        (Kind.WORKER, "rank 0 of this kernel"), (Kind.WORKER, "rank 1 of this kernel")]
    assert os.listdir(tmp_path / "marks") == []   # each removed its mark as it left
