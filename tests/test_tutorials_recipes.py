"""PyTorch's recipes (pytorch.org/tutorials/recipes) as a notebook, their training cell under
%%dataparallel (two CPU ranks, gloo) and %%sharedtrain: "Saving and loading models" (the entire
model), "PyTorch Profiler" (a table printed, a trace exported), "Automatic Mixed Precision" (bf16
autocast and GradScaler on the CPU, gradients unscaled and clipped) and the LR scheduler recipes'
ReduceLROnPlateau, each compared with the same cell run plainly; tiny random data in place of the
recipes' downloads. Run through a real ``InteractiveShell`` and a real Jupyter kernel (nbclient).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.notebook_helpers import run_notebook, stream_text

DP = "%%dataparallel --devices cpu --nprocs 2\n"

RECIPE_SETUP = """
import copy
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))

torch.manual_seed(0)
net = Net()
optimizer = optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.MSELoss()
loader = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 8)), batch_size=16)
val = (torch.randn(16, 16), torch.randn(16, 8))
"""

SAVE_ENTIRE_MODEL = """
for x, y in loader:
    optimizer.zero_grad()
    loss_fn(net(x), y).backward()
    optimizer.step()
best_model = copy.deepcopy(net)
torch.save(net, "entire_model.pt")
"""

PROFILE = """
from torch.profiler import profile, record_function, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    for x, y in loader:
        with record_function("train_step"):
            optimizer.zero_grad()
            loss_fn(net(x), y).backward()
            optimizer.step()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=5))
prof.export_chrome_trace("trace.json")
"""

AMP_SETUP = """
scaler = torch.amp.GradScaler("cpu")
scheduler = optim.lr_scheduler.ReduceLROnPlateau(optimizer, "min", patience=0, factor=0.5)
"""

AMP = """
for epoch in range(3):
    for x, y in loader:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = loss_fn(net(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    with torch.no_grad():
        val_loss = loss_fn(net(val[0]), val[1]).item()
    scheduler.step(val_loss + epoch)      # a loss that stops improving: the rate halves
"""


def cell(shell, source: str) -> str:
    """Run a cell that must succeed; what it printed."""
    result, text, _ = run_cell(shell, source)
    assert result.success, (result.error_before_exec or result.error_in_exec, text)
    return text


def state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_states_close(a: dict, b: dict, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0)


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def test_the_entire_model_saved_in_a_training_cell_loads_in_the_notebook(shell, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cell(shell, RECIPE_SETUP)
    cell(shell, DP + SAVE_ENTIRE_MODEL)
    ns = shell.user_ns
    # Saved as the notebook's class (not gpumagic's DDP wrapper), by reference to __main__.Net as a
    # plain cell saves it: it loads here, holding the trained weights.
    loaded = torch.load(tmp_path / "entire_model.pt", weights_only=False)
    assert type(loaded) is ns["Net"] and type(ns["best_model"]) is ns["Net"]
    assert_states_close(state(loaded), state(ns["net"]), atol=0)
    assert_states_close(state(ns["best_model"]), state(ns["net"]), atol=0)


def test_the_entire_model_saved_by_spawned_hogwild_workers_loads_in_the_notebook(shell, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cell(shell, RECIPE_SETUP)
    cell(shell, "%%sharedtrain --nprocs 2 --start-method spawn\n" + SAVE_ENTIRE_MODEL.replace(
        "best_model = copy.deepcopy(net)\n", "") + "if rank == 0:\n    torch.save(net, 'rank0.pt')\n")
    loaded = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert type(loaded) is shell.user_ns["Net"]


def test_the_profiler_recipe_prints_its_table_and_exports_one_trace(shell, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cell(shell, RECIPE_SETUP)
    for _ in range(2):   # (a race between the ranks: once could pass by luck)
        text = cell(shell, DP + PROFILE)
        trace = json.loads((tmp_path / "trace.json").read_text())
        assert trace["traceEvents"] and "Failed to rename" not in text, text
        assert text.count("Self CPU time total") == 1, text          # rank 0's table, once
        (tmp_path / "trace.json").unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == []          # no rank's temporary left
    # `with profile(...) as prof` is not a loop variable: what became of it is said
    assert "prof (TypeError: cannot pickle" in text, text


def test_amp_with_a_grad_scaler_and_plateau_scheduler_trains_as_one_process(shell):
    cell(shell, RECIPE_SETUP + AMP_SETUP)
    ns = shell.user_ns
    start = (state(ns["net"]), copy.deepcopy(ns["optimizer"].state_dict()))
    cell(shell, AMP)
    plain = (state(ns["net"]), ns["scaler"].state_dict(), ns["scheduler"].state_dict(), ns["norm"])
    cell(shell, RECIPE_SETUP + AMP_SETUP)
    ns["net"].load_state_dict(start[0])
    ns["optimizer"].load_state_dict(start[1])
    cell(shell, DP + AMP)
    # bf16 rounds each rank's half-batch weight gradient (a sum over its rows) where one process
    # rounds the whole batch's: the same training to bf16's precision (1e-5 with autocast off).
    assert_states_close(state(ns["net"]), plain[0], atol=1e-3)
    assert ns["scaler"].state_dict() == plain[1]                     # growth tracker: 12 steps
    assert ns["scheduler"].state_dict()["_last_lr"] == plain[2]["_last_lr"] == [0.05 / 4]
    torch.testing.assert_close(ns["norm"], plain[3], atol=1e-3, rtol=0)   # the global norm


def test_recipes_in_a_jupyter_kernel(tmp_path):
    sources = ["%load_ext gpumagic", f"%cd {tmp_path}", RECIPE_SETUP, DP + SAVE_ENTIRE_MODEL, DP + PROFILE,
               "print(type(torch.load('entire_model.pt', weights_only=False)).__name__)", "%dataparallel stop"]
    nb = run_notebook(sources, timeout=300)
    profiled = stream_text(nb.cells[4])
    assert profiled.count("Self CPU time total") == 1 and "Failed to rename" not in profiled, profiled
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert stream_text(nb.cells[5]).strip() == "Net"
