"""%%dataparallel --cluster on GPUs: the engines of a local ipyparallel cluster as NCCL ranks.

Each engine takes its host's GPU LOCAL_RANK; the trained weights come back into
the notebook's model through ipyparallel. Run on the GPU machine:
``pytest -m gpu tests/test_dataparallel_cluster_gpu.py`` (the two-engine test needs two GPUs).
"""
from __future__ import annotations

import copy
import time

import pytest
import torch

from gpumagic.dataparallel.ranks import cluster_setup as cluster
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, last_result

pytest.importorskip("ipyparallel")
pytestmark = pytest.mark.gpu

SETUP = """
import os
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
X = torch.randn(256, 32)
Y = torch.randn(256, 4)
loader = DataLoader(TensorDataset(X, Y), batch_size=64)
"""

TRAIN = """
for epoch in range(2):
    for x, y in loader:
        x, y = x.cuda(), y.cuda()
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
import torch.distributed as dist
where = [None] * dist.get_world_size()
dist.all_gather_object(where, (dist.get_rank(), os.environ["LOCAL_RANK"], str(torch.cuda.current_device()),
                               dist.get_backend()))
"""


@pytest.fixture(autouse=True)
def _stop_cluster():
    yield
    cluster.stop_cluster()


def _reference(ns):
    model = copy.deepcopy(ns["model"]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        for x, y in ns["loader"]:
            opt.zero_grad()
            ((model(x.cuda()) - y.cuda()) ** 2).mean().backward()
            opt.step()
    return model


def _train_on_engines(shell, engines: int):
    result, text, _ = run_cell(shell, SETUP)
    assert result.success, text
    ns = shell.user_ns
    ref = _reference(ns)
    params = list(ns["model"].parameters())
    shell.run_line_magic("dataparallel", f"cluster start --engines local -n {engines}")
    _, cap = dp_cell(shell, "--cluster", TRAIN)
    assert f"{engines} rank{'s' if engines > 1 else ''} (nccl)" in cap.stderr
    assert ns["where"] == [(r, str(r), str(r), "nccl") for r in range(engines)]
    assert list(ns["model"].parameters()) == params and all(p.device.type == "cpu" for p in params)
    for a, b in zip(ns["model"].state_dict().values(), ref.state_dict().values()):
        assert torch.allclose(a, b.cpu(), atol=1e-5, rtol=0)
    assert last_result().returned_bytes > 0 and last_result().devices == [f"cuda:{r}" for r in range(engines)]
    # the rendezvous store closed between cells (NCCL's threads run on meanwhile); a later cell forms a group
    # of its own through the next cell's store, and NCCL connects it
    time.sleep(5)
    # (--model: a cell with no model of its own names the one it leaves as it is)
    dp_cell(shell, "--cluster --model model", "import torch.distributed as dist\n"
                                "group = dist.new_group(list(range(dist.get_world_size())))\n"
                                "t = torch.ones(1, device='cuda')\ndist.all_reduce(t, group=group)\ns = t.item()\n")
    assert ns["s"] == engines


def test_one_engine_trains_on_its_gpu_with_nccl_and_the_weights_come_back(shell):
    _train_on_engines(shell, 1)


@pytest.mark.gpu2
def test_two_engines_train_on_their_gpus_with_nccl_and_the_weights_come_back(shell):
    _train_on_engines(shell, 2)
