"""%%dataparallel on two GPUs: NCCL, DistributedDataParallel, weights back where the notebook keeps them.

Run on the GPU machine: ``pytest -m gpu tests/test_dataparallel_gpu.py``.
"""
from __future__ import annotations

import _thread
import copy
import threading
import time

import pytest
import torch
from IPython.utils.capture import capture_output

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.errors import WorkerError
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, dp_pool, last_result, wait_dead

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2]

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(32, 64)
        self.out = nn.Linear(64, 4)
    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))

torch.manual_seed(0)
device = torch.device("cuda")               # the cell's data goes to "the GPU": each rank's own
model = Net().to("{where}")
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
X = torch.randn(256, 32)
Y = torch.randn(256, 4)
loader = DataLoader(TensorDataset(X, Y), batch_size=64)
"""

TRAIN = """
for epoch in range(2):
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
final_loss = loss.item()
"""


def _reference(ns, epochs=2):
    """The same training in this process on cuda:0, on the full batches."""
    model = copy.deepcopy(ns["model"]).to("cuda:0")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(epochs):
        for x, y in ns["loader"]:
            x, y = x.to("cuda:0"), y.to("cuda:0")
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    return model


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


@pytest.mark.parametrize("where", ["cuda:1", "cpu"])
def test_two_gpus_train_and_weights_come_back_where_the_model_lives(shell, where):
    run_cell(shell, SETUP.format(where=where))
    ns = shell.user_ns
    model, opt = ns["model"], ns["opt"]
    ref = _reference(ns)
    dp_cell(shell, "--nprocs 2", TRAIN)
    result = last_result()
    assert result.devices == ["cuda:0", "cuda:1"] and result.backend == "nccl"
    assert ns["model"] is model and ns["opt"] is opt
    assert {str(p.device) for p in model.parameters()} == {where}
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p.cpu(), ref.state_dict()[name].cpu(), atol=1e-4, rtol=1e-4)
    assert {str(s["momentum_buffer"].device) for s in opt.state.values()} == {where}
    for p, q in zip(model.parameters(), ref.parameters()):   # the last step's averaged gradients too
        assert p.grad.device == p.device
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), atol=1e-4, rtol=1e-4)
    assert {r: s.steps for r, s in result.per_rank.items()} == {0: 8, 1: 8}
    assert isinstance(ns["final_loss"], float)


def test_cuda_spellings_in_the_cell_mean_each_rank_own_gpu(shell):
    run_cell(shell, SETUP.format(where="cuda:0"))
    value, cap = dp_cell(shell, "--nprocs 2 --all-output", """
        a = torch.zeros(1, device='cuda:0')
        b = torch.ones(1).cuda()
        c = torch.ones(1).to(device)
        print('devices', a.device, b.device, c.device, next(model.parameters()).device)
        model(X[:4].cuda()).shape[0]
    """)
    assert "[rank 0] devices cuda:0 cuda:0 cuda:0 cuda:0" in cap.stdout
    assert "[rank 1] devices cuda:1 cuda:1 cuda:1 cuda:1" in cap.stdout
    assert value == 4


def test_second_cell_continues_from_the_first(shell):
    """Weights and momentum go back and forth (the second time from the workers' kept copies)."""
    run_cell(shell, SETUP.format(where="cuda:0"))
    ns = shell.user_ns
    ref = _reference(ns, epochs=4)
    dp_cell(shell, "--nprocs 2", TRAIN)
    pids = list(dp_pool().pids)
    dp_cell(shell, "--nprocs 2", TRAIN)
    result = last_result()
    assert dp_pool().pids == pids and not result.pool_started
    assert result.timings["start"] < 5.0 and result.timings["return"] < 5.0
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, ref.state_dict()[name], atol=1e-4, rtol=1e-4)


def test_rank1_error_while_rank0_waits_in_nccl(shell):
    run_cell(shell, SETUP.format(where="cuda:0"))
    ns = shell.user_ns
    before = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    dp_cell(shell, "--nprocs 2", "w = float(model(X[:2].cuda()).sum())\n")
    pids = list(dp_pool().pids)
    src = ("%%dataparallel --nprocs 2\n"
           "import torch.distributed as dist\n"
           "out = model(X[:8].cuda()).sum()\n"
           "if dist.get_rank() == 1:\n"
           "    raise RuntimeError('rank one fails on the GPU')\n"
           "t = torch.ones(1, device='cuda')\n"
           "dist.all_reduce(t)\n")
    t0 = time.monotonic()
    result, _, _ = run_cell(shell, src)
    err = result.error_in_exec
    assert isinstance(err, WorkerError) and err.rank == 1 and err.pid == pids[1]
    assert "line 5" in err.remote_traceback
    assert wait_dead(pids) == [] and time.monotonic() - t0 < 15
    for k, v in ns["model"].state_dict().items():
        assert torch.equal(v, before[k])


def test_interrupt_kills_ranks_in_nccl_collectives(shell):
    run_cell(shell, SETUP.format(where="cuda:0"))
    dp_cell(shell, "--nprocs 2", "w = float(model(X[:2].cuda()).sum())\n")
    pids = list(dp_pool().pids)
    body = ("import torch.distributed as dist\n"
            "out = model(X[:2].cuda())\n"
            "t = torch.ones(1 << 20, device='cuda')\n"
            "for i in range(10 ** 7):\n"
            "    dist.all_reduce(t)\n")
    timer = threading.Timer(3.0, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        shell.run_cell_magic("dataparallel", "--nprocs 2", body)
    timer.cancel()
    assert time.monotonic() - t0 - 3.0 < 5.0
    assert wait_dead(pids) == []
    dp_cell(shell, "--nprocs 2", "w = float(model(X[:2].cuda()).sum())\n")
    assert isinstance(shell.user_ns["w"], float) and dp_pool().pids != pids


def test_dp_strategy_splits_calls_and_warns(shell):
    run_cell(shell, SETUP.format(where="cuda:0"))
    run_cell(shell, "bn = nn.Sequential(nn.Linear(32, 8), nn.BatchNorm1d(8)).cuda()\n"
                    "class Summed(nn.Module):\n"
                    "    def __init__(self):\n"
                    "        super().__init__()\n"
                    "        self.lin = nn.Linear(32, 1)\n"
                    "    def forward(self, x):\n"
                    "        return self.lin(x).sum()\n"
                    "summed = Summed().cuda()\n"
                    "xb = torch.randn(16, 32, device='cuda:0')\n")
    ns = shell.user_ns
    expected = ns["model"](ns["xb"])
    value, _ = dp_cell(shell, "--strategy dp", "out = model(xb)\nout")
    assert value.device == torch.device("cuda:0") and value.shape == (16, 4)
    torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-5)
    with pytest.warns(UserWarning, match="BatchNorm"):
        dp_cell(shell, "--strategy dp --model bn", "o = bn(xb)\n")
    with pytest.warns(UserWarning, match="smaller than the 2 devices"):
        dp_cell(shell, "--strategy dp", "o = model(xb[:1])\n")
    with pytest.warns(UserWarning, match="returns a scalar"):
        value, _ = dp_cell(shell, "--strategy dp", "summed(xb)\n")
    assert value.shape == (2,)   # one per device, as nn.DataParallel gathers them
    torch.testing.assert_close(value.sum(), ns["summed"](ns["xb"]), atol=1e-4, rtol=1e-4)


def test_bf16_gradients_through_nccl_are_rounded_and_train_like_fp32(shell):
    run_cell(shell, SETUP.format(where="cpu"))
    ns = shell.user_ns
    ref = _reference(ns)
    dp_cell(shell, "--grad-dtype bf16", TRAIN + """
opt.zero_grad()
((model(X[:64].to(device)) - Y[:64].to(device)) ** 2).mean().backward()
rounded = all(bool((p.grad == p.grad.to(torch.bfloat16).float()).all()) for p in model.parameters())
""")
    assert ns["rounded"] is True
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, ref.state_dict()[name].cpu(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_ranks_train_like_eager_and_stay_warm(shell, mode):
    run_cell(shell, SETUP.format(where="cpu"))
    check_compiled_cells_stay_warm(shell, f"--compile {mode}")


def assert_weights(ns, reference):
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, reference.state_dict()[name].cpu(), atol=1e-3, rtol=0)


def check_compiled_cells_stay_warm(shell, line: str) -> float:
    """Two --compile cells of TRAIN from SETUP: each trains as eager training in this process does,
    and the second trains the compiled model (nothing traced again), its first optimizer step
    within 2 s of the cell's start. Returns that time."""
    ns = shell.user_ns
    two, four = _reference(ns), _reference(ns, epochs=4)
    _, cap = dp_cell(shell, line, TRAIN)
    assert "--compile: compiled" in cap.stderr or "--compile: traced again" in cap.stderr, cap.stderr
    assert_weights(ns, two)
    _, cap = dp_cell(shell, line, TRAIN)     # the trained model and its optimizer's momentum, again
    assert "--compile: the compiled model was reused, nothing recompiled" in cap.stderr, cap.stderr
    assert_weights(ns, four)
    result = last_result()
    from_start = result.timings["start"] + result.per_rank[0].first_step
    assert from_start < 2.0, result.timings
    return from_start


def test_progress_reads_each_ranks_gpu_load_from_nvml():
    from gpumagic.dataparallel.kernel.progress import Progress
    from gpumagic.dataparallel.protocol import RankStats
    progress = Progress(["cuda:0", "cuda:1"], shell=None)
    progress.update(0, RankStats(steps=1, samples=2, seconds=1.0))
    rows = progress.rows()
    assert progress.header[-2:] == ["GPU util", "GPU memory"]
    for row in rows:
        assert row[-2].endswith("%") and 0 <= int(row[-2][:-1]) <= 100
        assert "GiB" in row[-1] or "MiB" in row[-1]


def test_status_names_the_gpus(shell):
    run_cell(shell, SETUP.format(where="cuda:0"))
    dp_cell(shell, "--nprocs 2", "w = float(model(X[:2].cuda()).sum())\n")
    with capture_output() as cap:
        shell.run_line_magic("dataparallel", "status")
    assert "nccl" in cap.stdout and "cuda:1" in cap.stdout
    for pid in dp_pool().pids:
        assert str(pid) in cap.stdout
