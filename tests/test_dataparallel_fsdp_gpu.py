"""%%dataparallel --strategy fsdp on two GPUs: NCCL, FSDP2, the notebook's CPU model trained in place.

The CPU tests (test_dataparallel_fsdp.py) run the same paths over gloo; these
check them where FSDP is meant to run: training equals one GPU's, a second cell
continues from the ranks' shards, a meta model lives in the workers, autocast
gathers bf16 weights, and a rank holds about half of the training state.
Run on the GPU machine: ``pytest -m gpu2 tests/test_dataparallel_fsdp_gpu.py``.
"""
from __future__ import annotations

import copy

import pytest
import torch

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, dp_pool, last_result

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2]

LINE = "--strategy fsdp --nprocs 2"
REF_DEVICE = "cuda:0"     # where the single-process reference trains
AMP = "cuda"              # the autocast device type of the cells

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.backends.cuda.matmul.allow_tf32 = False    # the ranks get the kernel's flags: fp32 matmuls everywhere
torch.backends.cudnn.allow_tf32 = False

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))

class Net(nn.Module):
    def __init__(self, width=128, depth=4):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.out = nn.Linear(width, 4)
    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

torch.manual_seed(0)
device = "cuda"                  # each rank's own GPU in the cell
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
X = torch.randn(128, 16)
Y = torch.randn(128, 4)
loader = DataLoader(TensorDataset(X, Y), batch_size=32)
losses = []
"""

TRAIN = """
for epoch in range(2):
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
"""


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def _setup(shell, source=SETUP):
    result, text, _ = run_cell(shell, source)
    assert result.success, text
    return shell.user_ns


def _reference(ns, epochs, amp=False):
    """The notebook's model and optimizer trained in this process on one GPU, on whole batches."""
    model = copy.deepcopy(ns["model"]).to(REF_DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    losses = []
    for _ in range(epochs):
        for x, y in ns["loader"]:
            x, y = x.to(REF_DEVICE), y.to(REF_DEVICE)
            opt.zero_grad()
            with torch.autocast(AMP, dtype=torch.bfloat16, enabled=amp):
                loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return model, opt, losses


def _assert_close_state(model, opt, ref_model, ref_opt, tol=1e-4):
    for (name, a), b in zip(model.state_dict().items(), ref_model.state_dict().values()):
        torch.testing.assert_close(a, b.cpu(), atol=tol, rtol=0, msg=name)
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert mine["state"].keys() == theirs["state"].keys() and len(mine["state"]) == len(list(model.parameters()))
    for idx, st in mine["state"].items():
        assert st.keys() == theirs["state"][idx].keys()
        for k, v in st.items():
            assert v.device.type == "cpu", (idx, k)
            torch.testing.assert_close(v, theirs["state"][idx][k].cpu(), atol=tol, rtol=0, msg=f"{idx} {k}")


def test_fsdp_on_two_gpus_equals_one_gpu_and_the_weights_come_back_in_place(shell):
    ns = _setup(shell)
    ref_model, ref_opt, _ = _reference(ns, epochs=2)
    params = dict(ns["model"].named_parameters())
    model, opt = ns["model"], ns["opt"]
    _, cap = dp_cell(shell, LINE, TRAIN)
    result = last_result()
    assert "--strategy fsdp: model sharded over the ranks; blocks: Block" in cap.stderr
    assert result.strategy == "fsdp" and result.backend == "nccl" and result.devices == ["cuda:0", "cuda:1"]
    assert {r: s.steps for r, s in result.per_rank.items()} == {0: 8, 1: 8}
    assert ns["model"] is model and ns["opt"] is opt
    # the same Parameter objects, still on the CPU, in shared memory the ranks wrote into
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(p.device.type == "cpu" and p.is_shared() for p in model.parameters())
    _assert_close_state(model, opt, ref_model, ref_opt)
    assert len(ns["losses"]) == 8 and ns["losses"][-1] < ns["losses"][0]


def test_a_second_cell_continues_on_the_gpus_from_the_kept_shards(shell):
    ns = _setup(shell)
    ref_model, ref_opt, ref_losses = _reference(ns, epochs=4)
    dp_cell(shell, LINE, TRAIN)
    first = last_result()
    pointers = {n: p.data_ptr() for n, p in ns["model"].named_parameters()}
    _, cap = dp_cell(shell, LINE, TRAIN)
    second = last_result()
    assert "sharded over the ranks" not in cap.stderr             # nothing sharded anew
    assert dp_pool().pids == first.pids and not second.pool_started
    assert second.shipped_bytes <= (ns["X"].numel() + ns["Y"].numel()) * 4   # the data, not the model
    weight_bytes = sum(p.numel() * 4 for p in ns["model"].parameters())
    assert second.returned_bytes < weight_bytes / 4              # written in place
    assert {n: p.data_ptr() for n, p in ns["model"].named_parameters()} == pointers
    _assert_close_state(ns["model"], ns["opt"], ref_model, ref_opt)
    losses = ns["losses"]
    assert len(losses) == len(ref_losses) == 16
    assert sum(losses[8:]) < sum(losses[:8])                       # the second cell went on falling
    assert losses[-1] < losses[7]


def test_a_meta_model_trains_on_the_gpus_and_stays_in_the_workers(shell):
    ns = _setup(shell, SETUP + "\nwith torch.device('meta'):\n    model = Net(width=64, depth=4)\n"
                               "opt = torch.optim.AdamW(model.parameters(), lr=0.01)\n")
    body = TRAIN + "where = str(next(model.parameters()).device)\n"
    _, cap = dp_cell(shell, LINE, body)
    result = last_result()
    assert set(result.stayed) == {"model", "opt"}
    assert "trained state kept sharded in the workers (a later --strategy fsdp cell continues from it): " \
           "model, opt" in cap.stderr
    assert ns["where"] == "cuda:0"                                 # rank 0 trained on its GPU
    assert all(p.is_meta for p in ns["model"].parameters())        # the kernel never held the weights
    assert ns["opt"].state_dict()["state"] == {}
    first = list(ns["losses"])
    assert len(first) == 8 and all(v == v for v in first) and first[-1] < first[0]
    dp_cell(shell, LINE, body)                                     # continues from the workers' shards
    assert set(last_result().stayed) == {"model", "opt"}
    second = ns["losses"][8:]
    assert len(second) == 8 and sum(second[4:]) < sum(first[4:]) < sum(first[:4])


def test_a_bf16_autocast_cell_gathers_bf16_weights_and_keeps_fp32_masters(shell):
    ns = _setup(shell)
    start = copy.deepcopy(ns["model"].state_dict())
    ref_model, _, _ = _reference(ns, epochs=2, amp=True)
    body = ("seen = []\n"
            "hook = model.blocks[0].fc.register_forward_pre_hook(lambda m, a: seen.append(str(m.weight.dtype)))\n"
            + TRAIN.replace("        loss = ((model(x) - y) ** 2).mean()\n",
                            f"        with torch.autocast({AMP!r}, dtype=torch.bfloat16):\n"
                            "            loss = ((model(x) - y) ** 2).mean()\n")
            + "hook.remove()\n")
    _, cap = dp_cell(shell, LINE, body)
    assert "under autocast(bfloat16): parameters are gathered in bfloat16, gradients reduced in float32" \
        in cap.stderr
    assert ns["seen"] == ["torch.bfloat16"] * 8                    # what the block computed with, every step
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in ns["model"].parameters())
    losses = ns["losses"]
    assert all(v == v for v in losses) and losses[-1] < losses[0]
    # bf16 matmuls either way: the same training to bf16's precision (compare how far each tensor moved)
    for (name, a), b in zip(ns["model"].state_dict().items(), ref_model.state_dict().values()):
        moved = (b.cpu() - start[name]).norm()
        assert moved > 0 and (a - b.cpu()).norm() < 0.1 * moved, name


DEEP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = nn.Linear(width, width, bias=False)
        self.b = nn.Linear(width, width, bias=False)
    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))

torch.manual_seed(0)
device = "cuda"
deep = nn.Sequential(*[Layer(1024) for _ in range(48)])      # 100 M parameters, 48 FSDP units
opt = torch.optim.Adam(deep.parameters(), lr=1e-4, foreach=False)   # no whole-model temporaries in step()
X = torch.randn(64, 1024)
loader = DataLoader(TensorDataset(X), batch_size=16)
"""

PEAK = """
import torch.distributed as dist
torch.cuda.reset_peak_memory_stats()
for (x,) in loader:
    x = x.to(device)
    opt.zero_grad()
    deep(x).pow(2).mean().backward()
    opt.step()
peaks = [None] * dist.get_world_size()
dist.all_gather_object(peaks, torch.cuda.max_memory_allocated())
"""


def test_a_rank_holds_about_half_of_the_training_state(shell):
    poolmod.stop_pool(POOL_NAME)          # a fresh pool: no other test's tensors in the ranks' memory
    ns = _setup(shell, DEEP)
    n = sum(p.numel() for p in ns["deep"].parameters())
    full = 16 * n      # fp32 weights, gradients and Adam's two moments: what one GPU alone would hold
    _, cap = dp_cell(shell, LINE, PEAK)
    assert "blocks: Layer" in cap.stderr
    peaks = ns["peaks"]
    assert len(peaks) == 2
    for rank, peak in enumerate(peaks):
        # at least its half (the state exists after the first step), well short of the whole: what FSDP adds
        # (a unit's gathered weights and gradients, the next unit prefetched, cuBLAS workspaces) is a few
        # per cent of it
        assert 0.45 * full < peak < 0.7 * full, (rank, peak / full)
