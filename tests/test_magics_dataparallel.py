"""%%dataparallel on the CPU, for real: two gloo worker processes, through a real InteractiveShell.

One pool serves most tests (it is reused from cell to cell, which is itself
under test); the tests that must kill it (errors, interrupts, stop, unload)
run last and start fresh ones.
"""
from __future__ import annotations

import _thread
import copy
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
from IPython.utils.capture import capture_output

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.errors import WorkerDied, WorkerError
from gpumagic.procs import pool as poolmod
from gpumagic.procs.loaders import shard_loader
from tests.conftest import ROOT, run_cell
from tests.dataparallel_helpers import alive, dp_cell, dp_pool, last_result, wait_dead

CPU2 = "--devices cpu --nprocs 2"
pytestmark = pytest.mark.filterwarnings("ignore:the cell reads no DataLoader")

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Net(nn.Module):                      # defined in the notebook: travels by value
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(6, 12)
        self.out = nn.Linear(12, 2)
    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
X = torch.randn(64, 6)
Y = torch.randn(64, 2)
loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle={shuffle})
losses = []
"""

TRAIN = """
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
final_loss = float(loss)
"""


def _reference(ns, epochs=2, seed=None):
    """Train copies of the notebook's model and optimizer in this process on the full batches."""
    model = copy.deepcopy(ns["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(copy.deepcopy(ns["opt"].state_dict()))   # (its tensors, not the notebook's)
    loader = ns["loader"] if seed is None else shard_loader(ns["loader"], 0, 1, seed=seed)
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return model, opt, losses


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


# ---------------------------------------------------------------- plans and bad input (no processes)





def test_magic_bad_input_raises_usage_error_before_any_process(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    before = dp_pool()
    cases = [
        ("--nprocs 0", TRAIN, "--nprocs 1"),
        ("--devices tpu", TRAIN, "valid choices: cpu"),
        ("--strategy horovod", TRAIN, "ddp"),
        ("--backend nccl --devices cpu --nprocs 2", TRAIN, "gloo"),
        (f"{CPU2} --model opt", TRAIN, "model"),           # names the modules that exist
        (f"{CPU2} --model nothing", TRAIN, "no such variable"),
        (CPU2, "z = X.sum()\n", "uses no torch.nn.Module"),
        # a whole tutorial pasted as one cell: the model it builds is named, with where to build it
        (CPU2, "net = torch.nn.Sequential(torch.nn.Linear(4, 1))\nfor x, y in loader:\n    net(x)\n",
         "(the cell builds net itself: every rank would start from other weights, and nothing would come back "
         "into the notebook; build it in an earlier cell and train it here)"),
    ]
    for line, body, says in cases:
        with pytest.raises(UsageError) as err:
            shell.run_cell_magic("dataparallel", line, body)
        assert says in str(err.value), (line, str(err.value))
    assert dp_pool() is before  # nothing was started for bad input
    with pytest.raises(UsageError, match="status, stop"):
        shell.run_line_magic("dataparallel", "restart")


















# ---------------------------------------------------------------- the flagship path, for real

def test_equivalence_with_single_process_training(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    ns = shell.user_ns
    model, opt, losses = ns["model"], ns["opt"], ns["losses"]
    ref_model, ref_opt, ref_losses = _reference(ns)
    model(torch.ones(1, 6)).sum().backward()   # gradients of an earlier plain cell: not to be left stale

    dp_cell(shell, CPU2, TRAIN)

    assert ns["model"] is model and ns["opt"] is opt and ns["losses"] is losses  # the same objects, in place
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, ref_model.state_dict()[name], atol=1e-5, rtol=0)
    # the optimizer's state (momentum) is rank 0's, on the notebook's own parameters
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"],
                                   atol=1e-5, rtol=0)
    # the last step's gradients (averaged over the ranks: the full batch's) are on the notebook's
    # parameters, as after a plain cell
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0)
    # rank 0's losses are over its half of each batch: 8 steps, close to the full-batch losses
    assert len(losses) == 8 and abs(ns["final_loss"] - losses[-1]) < 1e-6
    result = last_result()
    assert {r: s.steps for r, s in result.per_rank.items()} == {0: 8, 1: 8}
    assert {r: s.samples for r, s in result.per_rank.items()} == {0: 64, 1: 64}
    assert result.modules == ["model"] and result.optimizers == ["opt"] and result.loaders == ["loader"]


def test_gradients_the_cell_cleared_are_cleared_in_the_notebook(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    model = shell.user_ns["model"]
    model(torch.ones(1, 6)).sum().backward()
    dp_cell(shell, CPU2, TRAIN + "opt.zero_grad()\n")   # set_to_none: no gradients, as after a plain cell
    assert [p.grad for p in model.parameters()] == [None] * 4


def test_second_cell_continues_from_the_first(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    ns = shell.user_ns
    ref_model, _, ref_losses = _reference(ns, epochs=4)
    dp_cell(shell, CPU2, TRAIN)
    dp_cell(shell, CPU2, TRAIN)                  # momentum and weights from the first cell, via the notebook
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, ref_model.state_dict()[name], atol=1e-5, rtol=0)
    assert len(ns["losses"]) == 16


def test_ddp_options_keep_the_result(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns)
    dp_cell(shell, CPU2 + " --static-graph --bucket-mb 0.001", TRAIN)
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, ref_model.state_dict()[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("grad_dtype, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_gradients_all_reduced_in_a_smaller_dtype_are_rounded_to_it(shell, grad_dtype, dtype):
    run_cell(shell, SETUP.format(shuffle=False))
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns)
    dp_cell(shell, f"{CPU2} --grad-dtype {grad_dtype}", TRAIN + f"""
opt.zero_grad()
((model(X[:32]) - Y[:32]) ** 2).mean().backward()
rounded = all(bool((p.grad == p.grad.to({dtype!r}).float()).all()) for p in model.parameters())
""")
    # The averaged gradient each rank applied was rounded to the small dtype (in fp32 it would not
    # be), and the training is still that of one process, to the rounding's precision.
    assert ns["rounded"] is True
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, ref_model.state_dict()[name], atol=2e-2, rtol=0)
    assert max((p - ref_model.state_dict()[n]).abs().max().item() for n, p in ns["model"].state_dict().items()) > 0


def test_full_precision_gradients_are_not_rounded(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, CPU2, """
((model(X[:32]) - Y[:32]) ** 2).mean().backward()
rounded = all(bool((p.grad == p.grad.to(torch.bfloat16).float()).all()) for p in model.parameters())
""")
    assert shell.user_ns["rounded"] is False


def test_schedulers_and_stateful_objects_get_rank0_state(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    run_cell(shell, "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)")
    ns = shell.user_ns
    sched = ns["sched"]
    dp_cell(shell, CPU2, TRAIN.replace("        losses.append(loss.item())\n",
                                     "        losses.append(loss.item())\n    sched.step()\n"))
    assert ns["sched"] is sched and sched.last_epoch == 2
    assert opt_lr(ns) == pytest.approx(0.1 * 0.25) and sched.get_last_lr() == [pytest.approx(0.025)]


def opt_lr(ns):
    return ns["opt"].param_groups[0]["lr"]


def test_shuffled_loader_and_notebook_function(shell):
    """A cell that only calls a notebook function: its globals are the DDP model and the sharded loader."""
    run_cell(shell, SETUP.format(shuffle=True))
    run_cell(shell, "def train_epoch():\n" + textwrap.indent(
        "for x, y in loader:\n    opt.zero_grad()\n    ((model(x) - y) ** 2).mean().backward()\n    opt.step()\n",
        "    "))
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns, epochs=2, seed=123)
    dp_cell(shell, f"{CPU2} --seed 123", "for epoch in range(2):\n    train_epoch()\n")
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, ref_model.state_dict()[name], atol=1e-5, rtol=0)


def test_pool_is_reused_and_output_streams(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    with pytest.warns(UserWarning, match="reads no DataLoader from the notebook: every rank sees the same data"):
        dp_cell(shell, CPU2, "n = float(model(X).sum())\n")
    pool = dp_pool()
    pids = list(pool.pids)
    value, cap = dp_cell(shell, CPU2, """
        import torch.distributed as dist
        print("hello from", dist.get_rank())
        rank_seen = dist.get_rank()
        world = dist.get_world_size()
        out = model(X[:2])
        world * 10
    """)
    result = last_result()
    assert dp_pool() is pool and pool.pids == pids and result.pool_started is False
    assert result.timings["start"] < 5.0          # no restart: a second cell starts at once
    assert cap.stdout.count("hello from 0") == 1 and "hello from 1" not in cap.stdout
    assert value == 20 and shell.user_ns["rank_seen"] == 0 and shell.user_ns["world"] == 2
    # in the cell, model is the DDP wrapper but reads like the notebook's module
    dp_cell(shell, CPU2, "kind = type(model).__name__\nfirst = next(iter(model.state_dict()))\n"
                       "names = [n for n, _ in model.named_parameters()]\nsub = type(model.hidden).__name__\n")
    assert shell.user_ns["kind"] == "CellDDP" and shell.user_ns["first"] == "hidden.weight"
    assert shell.user_ns["names"][:2] == ["hidden.weight", "hidden.bias"] and shell.user_ns["sub"] == "Linear"
    out = shell.user_ns["out"]                     # a tensor output comes back: rank 0's, on the CPU, detached
    assert out.device.type == "cpu" and not out.requires_grad and out.shape[0] == 2

    _, cap = dp_cell(shell, CPU2 + " --all-output",
                     "import torch.distributed as dist\nprint('hi', dist.get_rank())\nmodel(X)\n")
    assert "[rank 0] hi 0" in cap.stdout and "[rank 1] hi 1" in cap.stdout


def test_returned_tensors_survive_the_next_cell(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    value, _ = dp_cell(shell, CPU2, "v = torch.tensor(1.5) + 0 * model(X).sum().detach()\n"
                                  "vs = [torch.tensor(2.5), 3]\nv * 2\n")
    v, vs = shell.user_ns["v"], shell.user_ns["vs"]
    dp_cell(shell, CPU2, "w = torch.tensor(-7.0) + 0 * model(X).sum().detach()\nws = [torch.tensor(-8.0)]\nw\n")
    assert float(v) == 1.5 and float(vs[0]) == 2.5 and vs[1] == 3 and float(value) == 3.0


def test_rank0_output_arrives_while_the_cell_runs(shell, monkeypatch):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, CPU2, "a = model(X).shape[0]\n")           # the pool is up

    class Clock:
        def __init__(self):
            self.seen = []

        def write(self, text):
            self.seen.append((time.monotonic(), text))

        def flush(self):
            pass
    clock = Clock()
    monkeypatch.setattr(sys, "stdout", clock)
    shell.run_cell_magic("dataparallel", CPU2, "import time\nprint('early', flush=True)\ntime.sleep(1.5)\nmodel(X)\n")
    done = time.monotonic()
    monkeypatch.undo()
    early = [t for t, text in clock.seen if "early" in text]
    assert early and done - early[0] > 1.0


def test_large_tensors_stay_in_workers_until_changed(shell):
    run_cell(shell, "import torch\nfrom torch import nn\nbig = nn.Linear(512, 512)\n"
                    "bopt = torch.optim.SGD(big.parameters(), lr=0.01)\n")
    body = "bopt.zero_grad()\nbig(torch.ones(4, 512)).sum().backward()\nbopt.step()\ns = float(big.weight.sum())\n"
    dp_cell(shell, CPU2, body)
    first = last_result()
    assert first.shipped_bytes >= 512 * 512 * 4
    s1 = shell.user_ns["s"]
    dp_cell(shell, CPU2, body)
    second = last_result()
    assert second.cached_bytes >= 512 * 512 * 4 and second.shipped_bytes < 512 * 512 * 4
    # the workers' kept copy is the trained one: one more step of -lr * 4 on each of 512*512 weights
    s2 = shell.user_ns["s"]
    assert s2 == pytest.approx(s1 - 0.01 * 4 * 512 * 512, rel=1e-4)
    assert s2 == pytest.approx(float(shell.user_ns["big"].weight.detach().sum()), rel=1e-6)
    # changed in the notebook behind autograd's back: shipped again, and the workers see it
    run_cell(shell, "big.weight.data.zero_()")
    dp_cell(shell, CPU2, "s = float(big.weight.abs().sum())\n")
    assert shell.user_ns["s"] == 0.0 and last_result().shipped_bytes >= 512 * 512 * 4


def test_workers_use_no_shared_memory_and_listen_on_loopback_only(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, CPU2, """
        import os
        maps = open('/proc/self/maps').read()
        fds = [os.readlink(f'/proc/self/fd/{f}') for f in os.listdir('/proc/self/fd')
               if os.path.exists(f'/proc/self/fd/{f}')]
        # (a POSIX semaphore, /dev/shm/sem.*, is a multiprocessing lock a forked rank may inherit from the
        # kernel: no memory that tensors travel through)
        shm = [l for l in maps.splitlines() + fds if '/dev/shm' in l and '/dev/shm/sem.' not in l]
        out = model(X)
    """)
    assert shell.user_ns["shm"] == []
    pids = [os.getpid()] + dp_pool().pids
    listening = []
    for pid in pids:
        for c in psutil.Process(pid).net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                listening.append(c.laddr.ip)
    assert listening, "the rendezvous and gloo should listen somewhere"
    assert set(listening) <= {"127.0.0.1", "::1"}, listening


def test_status_shows_ranks(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, CPU2, "y0 = float(model(X).sum())\n")
    with capture_output() as cap:
        shell.run_line_magic("dataparallel", "status")
    for pid in dp_pool().pids:
        assert str(pid) in cap.stdout
    assert "running" in cap.stdout and "gloo" in cap.stdout and "rendezvous file /" in cap.stdout


# ---------------------------------------------------------------- dp strategy (in the kernel)

def test_dp_strategy_on_cpu_runs_whole_with_a_note(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns)
    value, cap = dp_cell(shell, "--strategy dp --devices cpu", TRAIN + "len(losses)\n")
    assert value == 8
    assert "one device" in cap.stderr
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, ref_model.state_dict()[name], atol=1e-6, rtol=0)
    assert "__gpumagic_dp__" not in ns


def test_dp_strategy_on_cpu_runs_code_written_for_cuda(shell):
    """The article's .cuda() idiom in a --strategy dp cell on a machine without GPUs, as under %%ondevice."""
    run_cell(shell, SETUP.format(shuffle=False))
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns)
    cell = TRAIN.replace("((model(x) - y) ** 2)", "((model(x.cuda()) - y.cuda()) ** 2)")
    assert ".cuda()" in cell
    dp_cell(shell, "--strategy dp --devices cpu", cell + "kind = torch.zeros(1).cuda().device.type\n")
    assert ns["kind"] == "cpu"
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, ref_model.state_dict()[name], atol=1e-6, rtol=0)


def test_a_dp_cells_own_error_keeps_every_frame_for_the_debugger(shell):
    # --strategy dp runs the cell in the kernel: its traceback is shown whole, and %debug walks it, so
    # gpumagic's frames keep their locals (run_compiled's __tracebackhide__ keeps it hidden)
    run_cell(shell, SETUP.format(shuffle=False))
    result, _, _ = run_cell(shell, "%%dataparallel --strategy dp --devices cpu\n"
                                   "def check(q):\n    mine = q * 2\n    raise KeyError(mine)\n"
                                   "out = model(X)\ncheck(7)\n")
    assert isinstance(result.error_in_exec, KeyError)
    frames = {}
    tb = result.error_in_exec.__traceback__
    while tb is not None:
        frames[tb.tb_frame.f_code.co_name] = tb.tb_frame.f_locals
        tb = tb.tb_next
    assert frames["check"] == {"q": 7, "mine": 14}
    assert frames["run_compiled"].get("__tracebackhide__") is True and "plan" in frames["run_cell"]


# ---------------------------------------------------------------- beyond one machine

def test_symmetric_error_keeps_the_pool(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, CPU2, "a = model(X).shape[0]\n")
    pids = list(dp_pool().pids)
    with pytest.raises(WorkerError) as err:
        dp_cell(shell, CPU2, "out = model(X)\nundefined_name + 1\n")
    assert err.value.exc_type == "NameError" and err.value.rank == 0
    assert dp_pool().alive and dp_pool().pids == pids  # every rank failed alike: nobody is stuck


def test_error_on_one_rank_stops_all_and_leaves_model_unchanged(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    ns = shell.user_ns
    before = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    dp_cell(shell, CPU2, "a = model(X).shape[0]\n")
    pids = list(dp_pool().pids)
    src = ("%%dataparallel " + CPU2 + "\n"
           "import torch.distributed as dist\n"
           "for x, y in loader:\n"
           "    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()\n"
           "if dist.get_rank() == 1:\n"
           "    raise ValueError('rank one fails')\n"
           "dist.barrier()\n")
    result, _, _ = run_cell(shell, src)
    err = result.error_in_exec
    assert isinstance(err, WorkerError), err
    assert (err.rank, err.pid, err.exc_type) == (1, pids[1], "ValueError")
    assert "rank one fails" in err.message
    # the traceback points at the user's cell line (line 6 counting the magic's line)
    assert f"Cell In[{shell.execution_count - 1}], line 6" in err.remote_traceback
    assert "raise ValueError('rank one fails')" in err.remote_traceback
    assert wait_dead(pids) == []  # rank 0 was waiting in a barrier: killed, not left hanging
    for k, v in ns["model"].state_dict().items():
        assert torch.equal(v, before[k]), k
    # the next cell gets a fresh pool and works
    dp_cell(shell, CPU2, "ok = float(model(X).sum())\n")
    assert dp_pool().pids != pids and isinstance(shell.user_ns["ok"], float)


def test_a_rank_that_dies_is_reported_and_the_pool_replaced(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, CPU2, "a = model(X).shape[0]\n")
    pids = list(dp_pool().pids)
    with pytest.raises(WorkerDied) as err:
        dp_cell(shell, CPU2, "import os, signal, torch.distributed as dist\nout = model(X)\n"
                           "if dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ndist.barrier()\n")
    assert err.value.rank == 1 and "killed by signal 9" in err.value.message
    assert wait_dead(pids) == []
    dp_cell(shell, CPU2, "ok = 3\nmodel(X)\n")
    assert shell.user_ns["ok"] == 3


def test_a_collective_timeout_names_the_rank_that_never_came(shell):
    # rank 0 is the one whose barrier times out; rank 1, still sleeping, is the one to look at
    run_cell(shell, SETUP.format(shuffle=False))
    started = time.monotonic()
    with pytest.raises(WorkerError) as err:
        dp_cell(shell, f"{CPU2} --timeout 3", "import time, torch.distributed as dist\nout = model(X)\n"
                                             "if dist.get_rank() == 1:\n    time.sleep(60)\ndist.barrier()\n")
    assert err.value.rank == 0 and err.value.still_running == [1]
    assert err.value._render_traceback_()[-1].startswith("rank 1 had not finished the cell (stopped now)")
    assert time.monotonic() - started < 30
    dp_cell(shell, CPU2, "ok = 4\nmodel(X)\n")   # a fresh pool
    assert shell.user_ns["ok"] == 4


def test_a_failed_cell_leaves_no_shared_memory_mapped_in_the_kernel(shell):
    # The failed cell's traceback stays with the notebook (and in cycles until the garbage collector
    # runs); gpumagic's frames in it held the dead pool's buffer, the shipped model's size, each time.
    def bulk_mappings() -> int:
        with open("/proc/self/maps") as maps:
            return sum("gpumagic-bulk" in line for line in maps)
    run_cell(shell, SETUP.format(shuffle=False) + "big = torch.zeros(2_000_000)\n")
    gc.disable()
    try:
        for _ in range(2):
            with pytest.raises(WorkerDied) as err:
                dp_cell(shell, CPU2, "import os, signal\nout = model(X) + big.sum()\n"
                                     "os.kill(os.getpid(), signal.SIGKILL)\n")
            assert bulk_mappings() == 0, err.value
    finally:
        gc.enable()
    dp_cell(shell, CPU2, "ok = 3\nmodel(X)\n")
    assert shell.user_ns["ok"] == 3


def test_interrupt_stops_every_rank_within_5_seconds(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, CPU2, "a = model(X).shape[0]\n")
    pids = list(dp_pool().pids)
    body = ("import time, torch, torch.distributed as dist\n"
            "out = model(X)\n"
            "feeder = iter(DataLoader(TensorDataset(X), batch_size=4, num_workers=1))\n"
            "next(feeder)\n"
            "for i in range(100000):\n"
            "    t = torch.ones(1)\n"
            "    dist.all_reduce(t)\n"
            "    time.sleep(0.005)\n")
    children = []

    def interrupt():
        # the ranks' own children (a DataLoader worker each) must go too
        for pid in pids:
            children.extend(c.pid for c in psutil.Process(pid).children(recursive=True))
        _thread.interrupt_main()
    timer = threading.Timer(3.0, interrupt)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        shell.run_cell_magic("dataparallel", CPU2, body)
    interrupted_after = time.monotonic() - t0 - 3.0
    timer.cancel()
    assert interrupted_after < 5.0
    assert len(children) == 2, children
    assert wait_dead(pids + children, timeout=5.0 - max(0.0, interrupted_after)) == []
    dp_cell(shell, CPU2, "ok = 2\nmodel(X)\n")
    assert shell.user_ns["ok"] == 2 and dp_pool().pids != pids


def test_an_interrupted_cell_says_what_stopped_and_shows_none_of_gpumagics_frames(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    before = {k: v.clone() for k, v in shell.user_ns["model"].state_dict().items()}
    body = ("import time\nfor x, y in loader:\n    opt.zero_grad()\n"
            "    torch.nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n    time.sleep(60)\n")
    timer = threading.Timer(4.0, _thread.interrupt_main)
    timer.start()
    result, text, _ = run_cell(shell, f"%%dataparallel {CPU2}\n{body}")
    timer.cancel()
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert "interrupted; the ranks were stopped, and the notebook's objects are as they were before" in text
    traceback = text[text.index("KeyboardInterrupt"):]
    assert "gpumagic" not in traceback.replace("%%dataparallel", "") and "selectors" not in traceback, traceback
    assert all(torch.equal(v, before[k]) for k, v in shell.user_ns["model"].state_dict().items())


def test_stop_and_unload_reap_the_pool(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, CPU2, "a = model(X).shape[0]\n")
    pids = list(dp_pool().pids)
    with capture_output():
        shell.run_line_magic("dataparallel", "stop")
    assert wait_dead(pids) == [] and dp_pool() is None
    dp_cell(shell, CPU2, "a = model(X).shape[0]\n")
    pids = list(dp_pool().pids)
    shell.run_line_magic("unload_ext", "gpumagic")
    try:
        assert wait_dead(pids) == []
    finally:
        shell.run_line_magic("load_ext", "gpumagic")


def test_killed_kernel_leaves_no_worker_behind(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from gpumagic.procs.pool import WorkerPool
        pool = WorkerPool(["cpu", "cpu"], "gloo").start()
        print(" ".join(map(str, pool.pids)), flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait_dead(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("line, says", [
    ("--devices cpu --nprocs 100000", "--oversubscribe"),
    ("--nprocs 100000", "--oversubscribe"),
    (f"{CPU2} --timeout nan", "positive, finite number of seconds"),
    (f"{CPU2} --timeout inf", "positive, finite number of seconds"),
    (f"{CPU2} --bucket-mb nan", "positive, finite number of MB"),
    # huge but finite: refused here, not an OverflowError or a TypeError from DDP once the pool runs
    (f"{CPU2} --timeout 1e14", "--timeout 1e+14: at most 31536000 seconds"),
    ("--cluster --timeout 1e14", "--timeout 1e+14: at most 31536000 seconds"),
    (f"{CPU2} --timeout 1e-6", "--timeout 1e-06: at least 1 second"),
    (f"{CPU2} --bucket-mb 1e15", "--bucket-mb 1e+15: at most 1048576 MB"),
    (f"{CPU2} --seed 99999999999999999999", "a seed is a whole number from 0 to"),
    (f"{CPU2} --seed -1", "a seed is a whole number from 0 to"),
    (f"{CPU2} --grad-dtype int8", "fp32, bf16, fp16"),
    (f"{CPU2} --strategy dp --grad-dtype bf16", "--strategy ddp"),
])
def test_unreasonable_options_are_refused_before_any_process(shell, line, says):
    run_cell(shell, SETUP.format(shuffle=False))
    before, children = dp_pool(), set(psutil.Process().children(recursive=True))
    with pytest.raises(UsageError) as err:
        shell.run_cell_magic("dataparallel", line, TRAIN)
    assert says in str(err.value)
    assert dp_pool() is before and set(psutil.Process().children(recursive=True)) <= children


def test_the_line_form_refuses_cell_options(shell):
    with pytest.raises(UsageError, match=r"--nprocs belong\(s\) to the cell form"):
        shell.run_line_magic("dataparallel", "--nprocs 0")
    with pytest.raises(UsageError, match="takes no options"):
        shell.run_line_magic("dataparallel", "stop --all-output")


@pytest.mark.parametrize("line, says", [
    ("cluster", "%dataparallel cluster: start, stop or status; valid choices: %dataparallel cluster start"),
    ("cluster go", "%dataparallel cluster go: start, stop or status; valid choices: %dataparallel cluster start"),
])
def test_a_cluster_line_without_a_known_verb_names_the_verbs(shell, line, says):
    with pytest.raises(UsageError) as err:
        shell.run_line_magic("dataparallel", line)
    assert says in str(err.value)


def test_the_help_names_every_cluster_verb(shell):
    help_text = " ".join(shell.magics_manager.magics["line"]["dataparallel"].__doc__.split())
    assert "after 'cluster': start, stop or status" in help_text


def test_a_syntax_error_points_at_the_cell_line_only(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    result, out = run_cell(shell, f"%%dataparallel {CPU2}\nx = 1\ny = (x +\n")[:2]
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)   # without the colours
    err = result.error_in_exec
    assert isinstance(err, SyntaxError) and err.lineno == 3
    assert f"Cell In[{result.execution_count}], line 3" in out and "y = (x +" in out
    assert "gpumagic/dataparallel" not in out and "gpumagic/cell" not in out
