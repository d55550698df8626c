"""Objects a %%dataparallel cell binds on a GPU rank come back on the CPU (one GPU, NCCL, one rank).

Run on the GPU machine: ``pytest -m gpu tests/test_dataparallel_returnable_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell

pytestmark = pytest.mark.gpu

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(64, 8)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8)
"""


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def test_a_cuda_tensor_the_cell_binds_comes_back_on_the_cpu_without_cuda_in_the_kernel(shell):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    assert run_cell(shell, SETUP)[0].success
    ns = shell.user_ns
    cuda_before = torch.cuda.is_initialized()   # (earlier tests in this process may have used CUDA)
    dp_cell(shell, "--devices cuda:0", """
        for x, y in loader:
            opt.zero_grad(); torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward(); opt.step()
        with torch.no_grad():
            preds = model(X.cuda())
        where = str(preds.device)
        summary = {"loss": torch.nn.functional.mse_loss(model(X.cuda()), X.sum(1, keepdim=True).cuda()).detach()}
        """)
    assert ns["where"] == "cuda:0"
    preds = ns["preds"]
    assert preds.device.type == "cpu" and not preds.requires_grad
    torch.testing.assert_close(preds, ns["model"](ns["X"]).detach(), atol=1e-5, rtol=1e-5)
    assert ns["summary"]["loss"].device.type == "cpu"
    assert torch.cuda.is_initialized() == cuda_before   # the kernel made no CUDA context to receive them
