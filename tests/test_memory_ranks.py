"""A rank's out-of-memory error carries the rank's own report: its device, what it held (the cell's
variables there, the failing frames' locals), its per-rank batch size. For real: two gloo ranks on the
CPU (%%dataparallel) and two Hogwild workers (%%sharedtrain), through a real InteractiveShell."""
from __future__ import annotations

import pytest

from gpumagic.errors import WorkerError
from gpumagic.memory.oom import OomReport
from tests.conftest import run_cell

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
model = nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 4)), batch_size=32)
"""

# Rank 1 (worker 1) runs out of memory in its first step: the CPU allocator refuses 32 TiB (line 6 of
# the cell, the magic's line being line 1).
CELL = """
def step(x, y):
    acts = torch.ones(8 * 1024 * 1024 // 4)
    if RANK == 1:
        torch.empty(2**45, dtype=torch.uint8)
    return nn.functional.mse_loss(model(x), y)
for x, y in loader:
    opt.zero_grad()
    step(x, y).backward()
    opt.step()
"""


def failed(shell, magic: str, rank_name: str) -> WorkerError:
    assert run_cell(shell, SETUP)[0].success
    result, out, _ = run_cell(shell, f"%%{magic}\n" + CELL.replace("RANK", rank_name))
    error = result.error_in_exec
    assert isinstance(error, WorkerError), out
    return error


def test_a_dataparallel_ranks_report(shell):
    error = failed(shell, "dataparallel --devices cpu --nprocs 2", "torch.distributed.get_rank()")
    report = error.report
    assert isinstance(report, OomReport) and report.rank == 1 and report.device == "cpu"
    assert report.requested == 2**45
    assert report.batches == ["loader 16 (a batch of 32 over 2 ranks)"]
    where = [f.label for f in report.frames]
    assert any(label.startswith("Cell In[") and label.endswith(", line 6, in step") for label in where), where
    step_frame = next(f for f in report.frames if f.label.endswith("in step"))
    assert ("acts", 8 << 20, False) in step_frame.locals
    assert any(v.name == "model" for v in report.variables)
    rendered = "\n".join(error._render_traceback_())
    assert "Rank 1 ran out of memory on cpu: asked for 32.0 TiB" in rendered
    assert "per-rank batch size: loader 16 (a batch of 32 over 2 ranks)" in rendered
    assert "%gpumem --rescue" not in rendered          # the rank's memory went with its process
    assert shell.user_ns["model"].weight.shape == (4, 8)


def test_a_sharedtrain_workers_report(shell):
    error = failed(shell, "sharedtrain --nprocs 2", "rank")
    report = error.report
    assert report.rank == 1 and report.device == "cpu" and report.batches[0].startswith("loader ")
    rendered = "\n".join(error._render_traceback_())
    assert "Rank 1 ran out of memory on cpu" in rendered and ", in step: acts 8.0 MiB" in rendered


@pytest.mark.parametrize("magic", ["dataparallel --devices cpu --nprocs 2", "sharedtrain --nprocs 2"])
def test_other_errors_carry_no_report(shell, magic):
    assert run_cell(shell, SETUP)[0].success
    result, _, _ = run_cell(shell, f"%%{magic}\nfor x, y in loader:\n    model(x)\n    raise ValueError('bad batch')")
    assert isinstance(result.error_in_exec, WorkerError) and result.error_in_exec.report is None
