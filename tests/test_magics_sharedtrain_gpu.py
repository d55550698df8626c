"""%%sharedtrain on a GPU: the shared model lives on cuda:0, workers reach it through CUDA IPC.

Run on the GPU machine: ``pytest -m gpu tests/test_sharedtrain_gpu.py``.
"""
from __future__ import annotations

import os

import psutil
import pytest
import torch

from gpumagic.errors import WorkerError
from gpumagic.procs import forkserver
from tests.conftest import run_cell

pytestmark = pytest.mark.gpu

SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
X = torch.randn(4096, 32, generator=g)
Y = (X[:, 0] - X[:, 1] > 0).long()
loader = DataLoader(TensorDataset(X, Y), batch_size=64, shuffle=True)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

def fixed_loss():
    dev = next(model.parameters()).device
    with torch.no_grad():
        return F.cross_entropy(model(X.to(dev)), Y.to(dev)).item()
"""

TRAIN = """%%sharedtrain --nprocs 4 --device cuda:0 --seed 0
for epoch in range({epochs}):
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        report(loss=loss, on=str(loss.device))
"""


def _helpers() -> set:
    from multiprocessing import forkserver, resource_tracker
    return {p for p in (getattr(resource_tracker._resource_tracker, "_pid", None),
                        getattr(forkserver._forkserver, "_forkserver_pid", None)) if p}


def _children() -> set:
    """Live descendants, minus Python's and torch's own helpers (resource tracker, shm manager)."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE or child.name().startswith("torch_shm_manag"):
                continue
            out.add(child.pid)
        except psutil.Error:
            continue
    return out - _helpers()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _torch_shm_files() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{os.getpid()}_")}


def test_four_workers_train_the_model_on_cuda0_and_leave_nothing(shell):
    before_children = _children()
    run_cell(shell, SETUP)
    ns = shell.user_ns
    model, loss_before = ns["model"], ns["fixed_loss"]()
    weight = model[0].weight.detach().clone()

    # CUDA workers need a process of their own: from the fork server (torch already imported) once
    # it runs; until then with spawn, and the server starts when the cell ends.
    expected = "forkserver" if forkserver.running() else "spawn"
    result, out, _ = run_cell(shell, TRAIN.format(epochs=2))
    assert result.error_in_exec is None, out
    trained = ns["sharedtrain"]
    assert ns["model"] is model and trained.model is model
    assert all(p.device == torch.device("cuda:0") for p in model.parameters())
    assert not torch.equal(model[0].weight.detach().cpu(), weight)
    assert ns["fixed_loss"]() < loss_before - 0.1
    assert trained.start_method == expected and trained.device == "cuda:0" and trained.nprocs == 4
    assert "CUDA workers need a process of their own" in trained.start_reason
    assert [w.state for w in trained.workers] == ["done"] * 4
    assert all(w.exitcode == 0 for w in trained.workers)
    # 4096 samples / 4 workers / 64 per batch = 16 batches each, per epoch.
    assert [len(h) for h in trained.history] == [32] * 4
    assert all(e["on"] == "cuda:0" for h in trained.history for e in h)
    # report(loss=<CUDA tensor>) is read when the reports are sent, and arrives as a number.
    assert all(isinstance(e["loss"], float) and e["loss"] == e["loss"] for h in trained.history for e in h)
    assert ns["optimizer"].state == {}  # workers stepped their own copies
    for w in trained.workers:
        assert not _alive(w.pid), f"worker {w.pid} outlived the run"
    assert _children() <= before_children

    # A second run reuses torch's CUDA IPC bookkeeping instead of leaving more of it behind.
    shm_after_first = _torch_shm_files()
    result, out, _ = run_cell(shell, TRAIN.format(epochs=1))
    assert result.error_in_exec is None, out
    assert ns["sharedtrain"].start_method == "forkserver" and ns["sharedtrain"].status == "done"
    assert len(_torch_shm_files()) <= len(shm_after_first)
    assert _children() <= before_children


def test_worker_error_on_gpu_leaves_the_model_usable(shell):
    before_children = _children()
    run_cell(shell, SETUP + "model = model.to('cuda:0')")
    model = shell.user_ns["model"]
    expected = "forkserver" if forkserver.running() else "spawn"
    result, out, _ = run_cell(shell, """%%sharedtrain --nprocs 4
dev = next(model.parameters()).device
for x, y in loader:
    loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
    loss.backward()
    if rank == 2:
        raise ValueError(f"rank {rank} stops on {dev}")
""")
    error = result.error_in_exec
    assert isinstance(error, WorkerError), out
    assert error.rank == 2 and "rank 2 stops on cuda:0" in error.message and "line 7" in error.remote_traceback
    partial = shell.user_ns["sharedtrain"]
    assert partial.start_method == expected and "CUDA" in partial.start_reason
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(8, 32, device="cuda:0"))).all()
    for w in partial.workers:
        assert not _alive(w.pid)
    assert _children() <= before_children


def test_spawn_on_request_trains_on_cuda0(shell):
    before_children = _children()
    run_cell(shell, SETUP)
    ns = shell.user_ns
    loss_before = ns["fixed_loss"]()
    result, out, _ = run_cell(shell, TRAIN.format(epochs=1).replace("--nprocs 4", "--nprocs 2 --start-method spawn"))
    assert result.error_in_exec is None, out
    trained = ns["sharedtrain"]
    assert trained.start_method == "spawn" and [w.state for w in trained.workers] == ["done"] * 2
    assert [len(h) for h in trained.history] == [32] * 2   # 4096 / 2 workers / 64 per batch
    assert all(isinstance(e["loss"], float) for h in trained.history for e in h)
    assert ns["fixed_loss"]() < loss_before
    assert _children() <= before_children
