"""%%sharedtrain: real Hogwild runs on the CPU with 2 worker processes.

Each run checks what the notebook sees afterwards (weights, loss on a fixed
set, the same model object, per-worker reports) and that nothing is left
behind: no worker processes, no /dev/shm files or semaphores, no open files.
"""
from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
from IPython.core.error import UsageError

from gpumagic.errors import WorkerError
from gpumagic.procs import forkserver
from tests.conftest import ROOT, run_cell
from tests.deep_cells import elif_chain, nested_abs
from tests.test_sharedtrain_display import plot_svg

SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

class Indexed(Dataset):
    # Defined in the notebook: spawned workers get it by value.
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] + self.x[:, 1] > 0).long()
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i], i

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 2)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

torch.manual_seed(0)
model = Net()
data = Indexed(512)
loader = DataLoader(data, batch_size=32, shuffle=True)

def fixed_loss():
    with torch.no_grad():
        return F.cross_entropy(model(data.x), data.y).item()
"""

TRAIN = """%%sharedtrain --nprocs 2 --start-method {method} --seed 3
for epoch in range(3):
    for x, y, idx in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        report(loss=loss, ids=idx, epoch=epoch)
print(f"rank {{rank}} of {{world_size}} finished")
"""


# --------------------------------------------------------------------------- hygiene

def _helper_pids() -> set:
    """multiprocessing's own long-lived helpers (resource tracker, fork server): not workers."""
    from multiprocessing import forkserver, resource_tracker
    pids = {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)}
    return {p for p in pids if p}


def _helper_fds() -> set:
    """Descriptors of multiprocessing's long-lived helpers: the resource tracker's pipe, the fork
    server's, and the resource sharer's listening socket (opened on the first descriptor handed to a
    spawned process, kept for the life of the kernel)."""
    from multiprocessing import forkserver, resource_sharer, resource_tracker
    fds = {getattr(resource_tracker._resource_tracker, "_fd", None),
           getattr(forkserver._forkserver, "_forkserver_alive_fd", None)}
    listener = getattr(resource_sharer._resource_sharer, "_listener", None)
    if listener is not None:
        fds.add(listener._listener._socket.fileno())
    return {str(f) for f in fds if f is not None}


def _children() -> set:
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE or child.name().startswith("torch_shm_manag"):
                continue  # torch's own shared-memory daemon (file_system strategy, CUDA IPC) is not a worker
            out.add(child.pid)
        except psutil.Error:
            continue
    return out - _helper_pids()


_RUN_FDS = ("pipe:", "socket:", "anon_inode:", "/dev/shm/", "/memfd:")


def _fds() -> dict:
    """Descriptors of the kinds a run opens: pipes, sockets, shared memory, anonymous files."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(_RUN_FDS):
            out[fd] = target
    return out


def _shm(pids) -> set:
    names = set(os.listdir("/dev/shm"))
    mine = {n for n in names if any(n.startswith(f"torch_{p}_") for p in pids)}
    return mine | {n for n in names if n.startswith("sem.")}


class Hygiene:
    """Snapshot processes, fds and /dev/shm; ``check()`` after the notebook let go of the model."""

    def __init__(self):
        self.children = _children()
        self.fds = _fds()
        self.shm = _shm({os.getpid()})

    def check(self, shell, worker_pids=()):
        for pid in worker_pids:
            assert not _alive(pid), f"worker {pid} is still running"
        assert _children() <= self.children, "a worker process outlived the run"
        # Semaphore names do not say whose they are: give other processes' short-lived ones time to go.
        deadline = time.monotonic() + 5
        while not _shm({os.getpid(), *worker_pids}) <= self.shm and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _shm({os.getpid(), *worker_pids}) <= self.shm, "shared memory files or semaphores leaked"

    def check_released(self, shell):
        """Shared weights keep a descriptor each while the model lives: once the notebook and
        the test let go of it, every descriptor the run opened must be closed."""
        shell.reset(new_session=False)
        # The last error (kept for %debug) has frames that hold the model.
        shell.last_execution_result = None
        shell.InteractiveTB.tb = None
        for name in ("last_value", "last_traceback", "last_type", "last_exc"):
            if hasattr(sys, name):
                setattr(sys, name, None)
        gc.collect()
        # The resource sharer's thread closes each connection just after the worker got its
        # descriptor: give a connection still closing a moment.
        deadline = time.monotonic() + 5
        while (leaked := self._leaked()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not leaked, f"open files leaked: {leaked} {_socket_lines(leaked.values())}"

    def _leaked(self) -> dict:
        return {fd: target for fd, target in _fds().items()
                if self.fds.get(fd) != target and fd not in _helper_fds()}


def _socket_lines(targets) -> list:
    """What the kernel's socket tables say of these sockets (kind, address, state), to tell whose
    a leaked socket is."""
    inodes = {t[len("socket:["):-1] for t in targets if t.startswith("socket:[")}
    lines = []
    for table in ("unix", "tcp", "tcp6", "udp"):
        try:
            with open(f"/proc/net/{table}") as f:
                lines += [f"{table}: {line.strip()}" for line in f if set(line.split()) & inodes]
        except OSError:
            continue
    return lines


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _interrupt_once(before: set, workers: int, settle: float = 0.0, poll: float = 0.05):
    """A thread that interrupts this process once ``workers`` children beyond ``before`` exist (and
    ``settle`` seconds more); returns it and its state (``state["running"] = False`` calls it off)."""
    state = {"sent": None, "running": True}

    def interrupt():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and state["running"]:
            if len(_children() - before) >= workers:
                time.sleep(settle)
                if state["running"]:
                    state["sent"] = time.monotonic()
                    os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(poll)

    sender = threading.Thread(target=interrupt)
    sender.start()
    return sender, state


def _ids_by_epoch(history, rank, epoch):
    return [i for e in history[rank] if e["epoch"] == epoch for i in e["ids"]]


def _check_trained(shell, before_model, before_weight, before_loss, method):
    ns = shell.user_ns
    assert ns["model"] is before_model, "the notebook's model must be the trained object itself"
    assert not torch.equal(ns["model"].fc1.weight.detach(), before_weight)
    assert all(p.is_shared() for p in ns["model"].parameters())
    after_loss = ns["fixed_loss"]()
    assert after_loss < before_loss - 0.05, (before_loss, after_loss)
    result = ns["sharedtrain"]
    assert result.start_method == method and result.status == "done"
    assert result.model is before_model and result.model_name == "model"
    history = result.history
    assert len(history) == 2
    for rank in range(2):
        entries = history[rank]
        assert len(entries) == 3 * 8  # 512 samples / 32 per batch / 2 workers, 3 epochs
        assert [e["step"] for e in entries] == list(range(1, 25))
        assert all(isinstance(e["loss"], float) and e["time"] > 0 for e in entries)
    for epoch in range(3):
        ids0, ids1 = _ids_by_epoch(history, 0, epoch), _ids_by_epoch(history, 1, epoch)
        assert not set(ids0) & set(ids1), "workers saw the same samples"
        assert sorted(ids0 + ids1) == list(range(512)), "each epoch covers the dataset once"
    assert [w.state for w in result.workers] == ["done", "done"]
    assert all(w.samples == 3 * 256 and w.exitcode == 0 for w in result.workers)
    return result


# --------------------------------------------------------------------------- training

def test_fork_trains_the_notebook_model(shell):
    hygiene = Hygiene()
    run_cell(shell, SETUP + "optimizer = torch.optim.SGD(model.parameters(), lr=0.2)")
    ns = shell.user_ns
    model, weight, loss = ns["model"], ns["model"].fc1.weight.detach().clone(), ns["fixed_loss"]()
    result, out, _ = run_cell(shell, TRAIN.format(method="fork"))
    assert result.error_in_exec is None, out
    trained = _check_trained(shell, model, weight, loss, "fork")
    assert "[rank 0] rank 0 of 2 finished" in out and "[rank 1] rank 1 of 2 finished" in out
    assert "sharedtrain: 2 workers (fork) on cpu trained 'model'" in out
    assert "loss rank 1:" in out  # the per-worker loss sparkline
    # what the cell bound stays in each worker: said, and not in the notebook
    assert "bound in the workers only, each its own, gone with them: loss; report(name=value)" in out
    assert "loss" not in ns
    run_cell(shell, "other = torch.nn.Linear(2, 2)")
    _, out, _ = run_cell(shell, TRAIN.format(method="fork").replace("--seed 3", "--seed 3 --model other"))
    assert "--model other: the cell does not use other, so nothing trains it; what it trains of model stays " \
           "in the workers (--model model shares it)" in out
    assert trained.first_step is not None and trained.samples_per_s > 0
    hygiene.check(shell, [w.pid for w in trained.workers])
    del model, trained, result
    hygiene.check_released(shell)


def test_steps_are_optimizer_steps_also_with_loaders_and_optimizers_made_in_the_worker(shell):
    """mnist_hogwild's train(): each worker builds its own DataLoader and SGD; the summary counted 0 steps."""
    run_cell(shell, SETUP + textwrap.dedent("""
        def train(rank, model):
            own = DataLoader(data, batch_size=64, shuffle=True)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y, idx in own:
                optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
    """))
    result, out, _ = run_cell(shell, "%%sharedtrain --nprocs 2 --start-method fork\ntrain(rank, model)\n")
    assert result.error_in_exec is None, out
    trained = shell.user_ns["sharedtrain"]
    assert [w.steps for w in trained.workers] == [8, 8]          # 512 samples at 64: 8 steps each
    assert "trained 'model': 16 steps" in out or "16 steps" in out, out


def test_functions_classes_and_imports_of_the_cell_exist_in_the_notebook_afterwards(shell):
    """A ``def evaluate`` written in the training cell is called in the next one, as after a plain cell;
    the function reads the notebook's names, not a worker's."""
    run_cell(shell, SETUP + "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    result, out, _ = run_cell(shell, "%%sharedtrain --nprocs 2 --start-method fork\n" + textwrap.dedent("""
        import math as m
        from collections import Counter
        def accuracy(net):
            return (net(data.x).argmax(1) == data.y).float().mean().item()
        class Scaled:
            factor = m.pi
        for x, y, idx in loader:
            optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
    """))
    assert result.error_in_exec is None, out
    ns = shell.user_ns
    assert ns["m"] is __import__("math") and ns["Counter"] is __import__("collections").Counter
    assert ns["Scaled"].factor == ns["m"].pi
    expected = (ns["model"](ns["data"].x).argmax(1) == ns["data"].y).float().mean().item()
    assert ns["accuracy"](ns["model"]) == expected and ns["accuracy"].__globals__ is ns
    assert "defined in the notebook too, as after a plain cell: m, Counter, accuracy, Scaled" in out
    assert "bound in the workers only" not in out


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_code_written_for_cuda_trains_on_cpu_workers(shell, method):
    """The article's Hogwild loop moves each batch with .cuda(): on CPU workers it runs there."""
    run_cell(shell, SETUP + "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    weight = shell.user_ns["model"].fc1.weight.detach().clone()
    result, out, _ = run_cell(shell, f"%%sharedtrain --nprocs 2 --start-method {method}\n" + textwrap.dedent("""
        for x, y, idx in loader:
            x, y = x.cuda(), y.cuda()
            optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
        report(where=x.device.type)
    """))
    assert result.error_in_exec is None, out
    trained = shell.user_ns["sharedtrain"]
    assert [trained.history[r][0]["where"] for r in range(2)] == ["cpu", "cpu"]
    assert [w.steps for w in trained.workers] == [8, 8]
    assert not torch.equal(shell.user_ns["model"].fc1.weight, weight)   # the shared weights trained


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_is_not_ipython(shell, method):
    """tqdm.auto and rich ask get_ipython() whether to draw widgets; a worker cannot reach the
    notebook's sockets, so it answers as a plain process (and the kernel's shell stays itself);
    tqdm's notebook bar, imported in the kernel, draws as text in a forked worker."""
    pytest.importorskip("ipywidgets")
    run_cell(shell, SETUP + "from tqdm.notebook import tqdm as notebook_tqdm\n")
    result, out, _ = run_cell(shell, f"%%sharedtrain --nprocs 2 --start-method {method}\nimport IPython\n"
                                     "model(data.x[:1])\nfor _ in notebook_tqdm(range(3), desc='bar'):\n    pass\n"
                                     "report(plain=IPython.get_ipython() is None, mine=get_ipython() is None)\n")
    assert result.error_in_exec is None, out
    trained = shell.user_ns["sharedtrain"]
    assert [(trained.history[r][0]["plain"], trained.history[r][0]["mine"]) for r in range(2)] == [(True, True)] * 2
    if method == "fork":
        assert "bar: 100%" in out and "3/3" in out            # the text bar, through the worker's output
    import IPython
    import tqdm.notebook
    assert IPython.get_ipython() is shell and "display" in vars(tqdm.notebook.tqdm_notebook)


def test_magics_in_a_worker_cell_are_refused_before_anything_starts(shell):
    run_cell(shell, SETUP)
    result, out, _ = run_cell(shell, "%%sharedtrain --nprocs 2\nx = 1\n%time model(data.x[:1])\n!echo hi\n")
    assert isinstance(result.error_in_exec, UsageError), out
    assert "%time (line 3), !echo (line 4) cannot run there" in str(result.error_in_exec)   # the notebook's lines
    assert "sharedtrain" not in shell.user_ns


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_fresh_workers_run_notebook_classes_and_copy_the_optimizer(shell, method):
    hygiene = Hygiene()
    run_cell(shell, SETUP + textwrap.dedent("""
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
        def step_loss(x, y):   # a notebook function, called in the workers
            return F.cross_entropy(model(x), y)
        big = torch.arange(500_000, dtype=torch.float64)[::2]   # 4 MB: reaches workers through shared memory
    """))
    ns = shell.user_ns
    model, weight, loss = ns["model"], ns["model"].fc1.weight.detach().clone(), ns["fixed_loss"]()
    cell = TRAIN.format(method=method).replace("F.cross_entropy(model(x), y)", "step_loss(x, y)")
    cell += ("big.add_(1)  # a worker's own change: never the notebook's\n"
             "print('big', big[:3].tolist(), big.is_shared())\n")
    result, out, _ = run_cell(shell, cell)
    assert result.error_in_exec is None, out
    trained = _check_trained(shell, model, weight, loss, method)
    assert "[rank 1] rank 1 of 2 finished" in out
    # Workers mapped one shared copy of `big` and changed it; the notebook's tensor is as it was.
    assert "[rank 0] big [" in out and "True" in out.split("[rank 0] big ")[1].split("\n")[0]
    assert torch.equal(ns["big"], torch.arange(500_000, dtype=torch.float64)[::2]) and not ns["big"].is_shared()
    # Workers stepped their own copies of Adam: the notebook's optimizer never took a step.
    assert ns["optimizer"].state == {}
    assert any("each worker steps its own copy (Adam" in n for n in trained.notes)
    hygiene.check(shell, [w.pid for w in trained.workers])
    del model, trained, result
    hygiene.check_released(shell)


FORKSERVER_CELL = """%%sharedtrain --nprocs 2 --start-method forkserver --model model
import os, sys
report(dynamo="torch._dynamo" in sys.modules, worker="gpumagic.sharedtrain.worker" in sys.modules,
       ipython="IPython" in sys.modules, parent=os.getppid(), env=os.environ.get("GPUMAGIC_TEST_SETTING"))
"""


def test_forkserver_keeps_one_server_with_torch_loaded_for_later_cells(shell, monkeypatch):
    from multiprocessing import forkserver as mp_forkserver

    from gpumagic import session
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(2, 1)")
    monkeypatch.setenv("GPUMAGIC_TEST_SETTING", "first")
    result, out, _ = run_cell(shell, FORKSERVER_CELL)
    assert result.error_in_exec is None, out
    first = shell.user_ns["sharedtrain"].history
    servers = {e["parent"] for h in first for e in h}
    assert servers == {mp_forkserver._forkserver._forkserver_pid} == {forkserver.ours()}
    assert "forkserver" in session._closers
    # Preloaded in the server: workers never import torch or what a first optimizer call needs,
    # and nothing made them import IPython.
    assert all(e["dynamo"] and e["worker"] and not e["ipython"] for h in first for e in h)
    assert [e["env"] for h in first for e in h] == ["first", "first"]
    # A later cell: the same server, and the kernel's environment as it is now.
    monkeypatch.setenv("GPUMAGIC_TEST_SETTING", "second")
    result, out, _ = run_cell(shell, FORKSERVER_CELL)
    assert result.error_in_exec is None, out
    second = shell.user_ns["sharedtrain"].history
    assert {e["parent"] for h in second for e in h} == servers
    assert [e["env"] for h in second for e in h] == ["second", "second"]
    # %unload_ext gpumagic stops it.
    server = servers.pop()
    assert forkserver.stop() is True
    assert not _alive(server) and "forkserver" not in session._closers
    assert mp_forkserver._forkserver._forkserver_pid is None


def test_where_fork_is_unsafe_later_cells_start_from_the_fork_server(shell):
    forkserver.stop()
    stop = threading.Event()
    poller = threading.Thread(target=stop.wait, name="user-poller")  # a thread fork is not safe with
    poller.start()
    try:
        run_cell(shell, "import torch\nmodel = torch.nn.Linear(2, 1)")
        cell = "%%sharedtrain --nprocs 2 --model model\nimport os\nreport(parent=os.getppid())\n"
        result, out, _ = run_cell(shell, cell)
        assert result.error_in_exec is None, out
        first = shell.user_ns["sharedtrain"]
        # The server is not up yet: this cell spawns (sooner than waiting for the server to import
        # torch), and the server starts for later cells (alongside where a core is free, else after).
        assert first.start_method == "spawn" and "'user-poller'" in first.start_reason
        assert "not running yet, so this cell's workers start with spawn meanwhile" in first.start_reason
        assert {e["parent"] for h in first.history for e in h} == {os.getpid()}
        server = forkserver.ours()
        assert server is not None and _alive(server)
        result, out, _ = run_cell(shell, cell)
        assert result.error_in_exec is None, out
        second = shell.user_ns["sharedtrain"]
        assert second.start_method == "forkserver" and "fork server" in second.start_reason
        assert {e["parent"] for h in second.history for e in h} == {server}
    finally:
        stop.set()
        poller.join()
        forkserver.stop()


LAZY_IMPORT_SCRIPT = """
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "gpumagic")
shell.run_cell("import sys, torch\\nmodel = torch.nn.Linear(2, 1)")
cell = '''%%sharedtrain --nprocs 2 --start-method fork
report(dynamo="torch._dynamo" in sys.modules)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
opt.zero_grad(); model(torch.ones(1, 2)).sum().backward(); opt.step()
'''
for n in (1, 2):
    shell.run_cell(cell)
    result = shell.user_ns["sharedtrain"]
    print("cell", n, result.start_method, result.status, [h[0]["dynamo"] for h in result.history])
"""


def test_forked_workers_of_later_cells_inherit_what_a_first_step_imports():
    # A fresh kernel: the first cell's workers import torch._dynamo on their first optimizer call;
    # the kernel imports it meanwhile, so a later cell's workers already have it.
    out = subprocess.run([sys.executable, "-c", LAZY_IMPORT_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "cell 1 fork done [False, False]" in out.stdout, out.stdout + out.stderr
    assert "cell 2 fork done [True, True]" in out.stdout, out.stdout + out.stderr




# --------------------------------------------------------------------------- endings

ERROR_CELL = """%%sharedtrain --nprocs 2 --start-method {method}
for x, y, idx in loader:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    report(loss=loss)
    if rank == 1:
        raise RuntimeError("worker one failed")
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_worker_error_stops_all_and_points_at_the_cell_line(shell, method):
    hygiene = Hygiene()
    run_cell(shell, SETUP)
    model = shell.user_ns["model"]
    result, out, _ = run_cell(shell, ERROR_CELL.format(method=method))
    error = result.error_in_exec
    assert isinstance(error, WorkerError), out
    assert error.rank == 1 and error.exc_type == "RuntimeError" and error.message == "worker one failed"
    assert isinstance(error.pid, int) and error.pid != os.getpid()
    # Line 7 counts the magic's line, as the notebook shows the cell.
    assert "line 7" in error.remote_traceback and 'raise RuntimeError("worker one failed")' in error.remote_traceback
    assert "Cell In[" in error.remote_traceback
    assert "WorkerError: rank 1" in out and "RuntimeError: worker one failed" in out
    partial = shell.user_ns["sharedtrain"]
    assert partial.status == "failed" and partial.workers[1].state == "failed"
    assert shell.user_ns["model"] is model
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(4, 8))).all()
    hygiene.check(shell, [w.pid for w in partial.workers])
    del model, partial, error, result
    hygiene.check_released(shell)


def test_interrupt_stops_every_worker_within_5_seconds(shell):
    hygiene = Hygiene()
    run_cell(shell, SETUP)
    sender, state = _interrupt_once(_children(), workers=2, settle=0.5)  # let the workers get into their loop
    try:
        result, out, _ = run_cell(shell, """%%sharedtrain --nprocs 2 --start-method fork
import time
while True:
    report(loss=model(torch.randn(2, 8)).sum())
    time.sleep(0.01)
""")
    finally:
        state["running"] = False
        sender.join()
    returned = time.monotonic()
    assert isinstance(result.error_in_exec, KeyboardInterrupt), out
    assert state["sent"] is not None and returned - state["sent"] < 5.0
    partial = shell.user_ns["sharedtrain"]
    assert partial.status == "interrupted" and all(len(h) > 0 for h in partial.history)
    assert "stopped 2 workers" in out
    hygiene.check(shell, [w.pid for w in partial.workers])
    del partial, result
    hygiene.check_released(shell)


KILL_SCRIPT = """
import sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "gpumagic")
shell.run_cell("import torch, torch.nn as nn\\nmodel = nn.Linear(4, 2)")
shell.run_cell('''%%sharedtrain --nprocs 2 --start-method {method}
import os, time
print("pid", os.getpid(), "parent", os.getppid(), flush=True)
while True:
    model(torch.randn(2, 4)).sum().backward()
    time.sleep(0.01)
''')
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_killed_kernel_leaves_no_workers(method):
    kernel = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT.format(method=method)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT})
    pids, parents = [], set()
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            line = kernel.stdout.readline()
            if not line:
                break
            if "] pid " in line:
                words = line.split()
                pids.append(int(words[-3]))
                parents.add(int(words[-1]))
        assert len(pids) == 2, "the workers did not start"
        assert all(_alive(p) for p in pids)
    finally:
        kernel.kill()
        kernel.wait()
    # Under forkserver the workers' parent is the server: it must go too.
    gone = pids + sorted(parents - {kernel.pid})
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in gone) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "workers outlived their kernel"
    assert not any(_alive(p) for p in gone), "the fork server outlived its kernel"


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("line, cell, message", [
    ("--nprocs 0", "model(x)", "--nprocs must be a positive number of processes, not 0; valid choices: 1"),
    ("--nprocs -3", "model(x)", "not -3"),
    ("--device tpu", "model(x)", "unknown device 'tpu'; valid choices: cpu"),
    ("--device cuda:3", "model(x)", "device 'cuda:3'"),
    ("--device meta", "model(x)", "Hogwild shares memory on the CPU or a CUDA GPU; valid choices: cpu"),
    ("--model x", "model(x)", "--model 'x' is a Tensor, not a torch.nn.Module; valid choices: model"),
    ("--model nothing", "model(x)", "no such variable"),
    ("", "y = x * 2", "the cell uses no torch.nn.Module from the notebook"),
    ("--device cuda:9", "y = x * 2", "device 'cuda:9'"),         # the bad device first, then the model
    ("--start-method thread", "model(x)", "invalid choice: 'thread' (choose from 'spawn', 'fork', 'forkserver')"),
    ("--nprocs two", "model(x)", "invalid int value: 'two'"),
    ("--bogus", "model(x)", "unrecognized arguments: --bogus; usage: %%sharedtrain [--nprocs N]"),
    ("", "\n# nothing\n", "the cell is empty"),
])
def test_bad_input_is_a_usage_error_and_changes_nothing(shell, line, cell, message):
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(8, 2)\nx = torch.randn(3, 8)")
    before = _children()
    result, out, _ = run_cell(shell, f"%%sharedtrain {line}\n{cell}")
    assert isinstance(result.error_in_exec, UsageError), out
    assert message in str(result.error_in_exec)
    assert not shell.user_ns["model"].weight.is_shared()  # refused before touching the notebook
    assert "sharedtrain" not in shell.user_ns
    assert _children() == before


def test_more_processes_than_cores_warns_and_unshardable_loader_is_noted(shell):
    cores = len(os.sched_getaffinity(0))
    run_cell(shell, """
import torch
from torch.utils.data import DataLoader, IterableDataset
class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(6))
stream = DataLoader(Stream(), batch_size=2)
model = torch.nn.Linear(2, 1)
""")
    result, out, _ = run_cell(shell, f"""%%sharedtrain --nprocs {cores + 1} --start-method fork
for batch in stream:
    report(items=batch, r=torch.rand(()).item())
model(torch.ones(1, 2))
""")
    assert result.error_in_exec is None, out
    assert f"Warning: {cores + 1} processes on {cores} CPU core(s)" in out
    trained = shell.user_ns["sharedtrain"]
    assert any("'stream' cannot be sharded (it reads an IterableDataset)" in n for n in trained.notes)
    # Not sharded: every worker read it all; reseeded per rank: their random draws differ.
    assert all([i for e in h for i in e["items"]] == list(range(6)) for h in trained.history)
    assert len({h[0]["r"] for h in trained.history}) == cores + 1
    assert [w.steps for w in trained.workers] == [3] * (cores + 1)


# --------------------------------------------------------------------------- decisions











def test_notebook_shows_live_progress_then_the_summary_in_one_display(shell):
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(2, 1)")
    shell.kernel = object()  # what an ipykernel shell has; the magic then displays HTML
    try:
        result, out, cap = run_cell(shell, """%%sharedtrain --nprocs 2 --start-method fork --model model
import time
for i in range(12):
    report(loss=1.0 / (i + 1) + rank)
    time.sleep(0.1)
""")
    finally:
        del shell.kernel
    assert result.error_in_exec is None, out
    htmls = [o.data.get("text/html", "") for o in cap.outputs]
    assert len(htmls) >= 2, "a live view, then the summary replacing it"
    assert "<table>" in htmls[0] and ("starting" in htmls[0] or "running" in htmls[0])
    # 12 reports per worker count as its steps when the cell reads no notebook loader.
    assert "trained &#x27;model&#x27;: 24 steps" in htmls[-1] and "rank 1" in htmls[-1]
    assert plot_svg(htmls[-1]).count("<polyline") == 2
    assert "sharedtrain: " not in out  # no text summary printed besides the display


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_loader_read_by_a_notebook_function_is_split_and_its_steps_counted(shell, method):
    run_cell(shell, SETUP + textwrap.dedent("""
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        def train_epoch():
            seen = []
            for x, y, idx in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                seen += idx.tolist()
            return seen
    """))
    result, out, _ = run_cell(shell, f"%%sharedtrain --nprocs 2 --start-method {method} --seed 1\n"
                                     "report(ids=train_epoch())\n")
    assert result.error_in_exec is None, out
    trained = shell.user_ns["sharedtrain"]
    ids = [trained.history[r][0]["ids"] for r in range(2)]
    assert len(ids[0]) == len(ids[1]) == 256 and sorted(ids[0] + ids[1]) == list(range(512))
    assert [w.samples for w in trained.workers] == [256, 256] and [w.steps for w in trained.workers] == [8, 8]


def test_an_evaluation_pass_reads_the_whole_loader_and_the_models_eval_flag_comes_back(shell):
    """The quickstart's test(): under no_grad every worker counts all 512 samples, so an accuracy over
    len(loader.dataset) is right, the pass is no training step, and model.eval() holds afterwards."""
    run_cell(shell, SETUP + "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    result, out, _ = run_cell(shell, "%%sharedtrain --nprocs 2 --start-method fork\n" + textwrap.dedent("""
        before_training = len(loader)           # the quickstart's test(): len() first, then no_grad
        model.train()
        for x, y, idx in loader:
            optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
        model.eval()
        seen = correct = 0
        with torch.no_grad():
            batches = len(loader)
            for x, y, idx in loader:
                seen += len(x)
                correct += (model(x).argmax(1) == y).sum().item()
        report(seen=seen, accuracy=correct / len(loader.dataset), batches=batches, share=len(loader),
               before_training=before_training)
    """))
    assert result.error_in_exec is None, out
    trained = shell.user_ns["sharedtrain"]
    for r in range(2):
        entry = trained.history[r][0]
        assert entry["seen"] == 512 and entry["batches"] == 16 and 0.0 <= entry["accuracy"] <= 1.0
        assert entry["share"] == 8            # with gradients on, after training, len() is the worker's share
        assert entry["before_training"] == 16  # before any training pass: an evaluation loader's whole count
    assert [w.steps for w in trained.workers] == [8, 8] and [w.samples for w in trained.workers] == [256, 256]
    assert shell.user_ns["model"].training is False


def test_unreasonable_counts_and_seeds_are_refused_before_any_process(shell):
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(8, 2)")
    before = _children()
    for line, says in [("--nprocs 100000", "--oversubscribe"), ("--seed 99999999999999999999", "a seed is"),
                       ("--seed -5", "a seed is")]:
        result, out, _ = run_cell(shell, f"%%sharedtrain {line}\nmodel(torch.ones(1, 8))\n")
        assert isinstance(result.error_in_exec, UsageError) and says in str(result.error_in_exec), out
    assert _children() == before and not shell.user_ns["model"].weight.is_shared()


def test_a_syntax_error_points_at_the_cell_line_only(shell):
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(8, 2)")
    result, out, _ = run_cell(shell, "%%sharedtrain --nprocs 2\nx = 1\ny = (x +\n")
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)   # without the colours
    assert isinstance(result.error_in_exec, SyntaxError) and result.error_in_exec.lineno == 3
    assert f"Cell In[{result.execution_count}], line 3" in out and "gpumagic/sharedtrain" not in out


def test_an_interrupt_while_workers_start_stops_them_all_within_a_second(shell):
    hygiene = Hygiene()
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(8, 2)")
    sender, state = _interrupt_once(_children(), workers=3, poll=0.002)  # some started, most not yet
    try:
        result, out, _ = run_cell(shell, "%%sharedtrain --nprocs 200 --oversubscribe --start-method fork "
                                         "--model model\nimport time\ntime.sleep(60)\n")
    finally:
        state["running"] = False
        sender.join()
    returned = time.monotonic()
    assert isinstance(result.error_in_exec, KeyboardInterrupt), out
    assert state["sent"] is not None and returned - state["sent"] < 1.0 + 2.0   # the grace before SIGKILL
    partial = shell.user_ns["sharedtrain"]
    started = [w.pid for w in partial.workers if w.pid]
    assert 0 < len(started) < 200                                    # it stopped starting them
    assert "Exception ignored" not in out
    hygiene.check(shell, started)


@pytest.mark.parametrize("source, name, value, method", [
    (elif_chain(250, 137, then="report(r=r)\n"), "r", 137, "fork"),
    (elif_chain(250, 137, then="report(r=r)\n"), "r", 137, "spawn"),   # (the tree pickled to them)
    (nested_abs(190, then="report(v=v)\n"), "v", 1, "spawn"),
])
def test_cells_nested_deeper_than_deepcopy_goes_run_in_the_workers(shell, source, name, value, method):
    run_cell(shell, SETUP + "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    result, out, _ = run_cell(shell, f"%%sharedtrain --nprocs 2 --start-method {method}\n"
                                     "out = model(data.x[:4])\n" + source)
    assert result.error_in_exec is None, out
    trained = shell.user_ns["sharedtrain"]
    assert [trained.history[r][0][name] for r in range(2)] == [value, value]
