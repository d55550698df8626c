"""torch's process-wide settings in worker cells (gpumagic.procs.torch_settings): both ways for
%%dataparallel, into %%sharedtrain's fresh workers.

Before, the ranks took only the kernel's matmul and cuDNN flags: a notebook that set
``torch.set_default_dtype(torch.float64)`` at the top had ranks making float32 data for its float64
model, and what a cell set (deterministic algorithms, anomaly detection) never reached the notebook.
"""
from __future__ import annotations

import pytest
import torch

from gpumagic.procs import torch_settings
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)
"""

READ = """
for (x,) in loader:
    opt.zero_grad(); model(x).sum().backward(); opt.step()
seen = (str(torch.get_default_dtype()), str(torch.randn(1).dtype), torch.is_anomaly_enabled(),
        torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision())
"""


@pytest.fixture
def kernel_settings():
    """The test process's torch settings, put back afterwards."""
    saved = torch_settings.current()
    yield
    torch_settings.apply(saved)


def test_the_kernels_settings_reach_the_ranks_and_the_cells_come_back(shell, kernel_settings):
    run_cell(shell, SETUP)
    dp_cell(shell, "--nprocs 2", READ)      # the pool is up, with the default settings
    assert shell.user_ns["seen"] == ("torch.float32", "torch.float32", False, False, "highest")
    torch.set_default_dtype(torch.float64)   # a plain cell at the top of a notebook
    torch.autograd.set_detect_anomaly(True)
    run_cell(shell, SETUP)                   # the model and data now float64
    dp_cell(shell, "--nprocs 2", READ)
    assert shell.user_ns["seen"] == ("torch.float64", "torch.float64", True, False, "highest")
    assert shell.user_ns["model"].weight.dtype == torch.float64
    # what a cell sets is the notebook's afterwards, as after a plain cell
    dp_cell(shell, "--nprocs 2", "torch.use_deterministic_algorithms(True)\n"
                                 "torch.set_float32_matmul_precision('high')\n"
                                 "torch.autograd.set_detect_anomaly(False)\n" + READ)
    assert torch.are_deterministic_algorithms_enabled() and torch.get_float32_matmul_precision() == "high"
    assert not torch.is_anomaly_enabled() and torch.get_default_dtype() == torch.float64
    # and the notebook's own later change reaches the ranks again
    torch.use_deterministic_algorithms(False)
    dp_cell(shell, "--nprocs 2", READ)
    assert shell.user_ns["seen"] == ("torch.float64", "torch.float64", False, False, "high")


def test_changed_names_what_differs_and_apply_takes_a_part(kernel_settings):
    before = torch_settings.current()
    after = dict(before, default_dtype="float64", detect_anomaly=True)
    assert torch_settings.changed(before, after) == {"default_dtype": "float64", "detect_anomaly": True}
    torch_settings.apply({"default_dtype": "float64"})
    assert torch.get_default_dtype() == torch.float64 and torch_settings.current()["detect_anomaly"] is False


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_fresh_sharedtrain_workers_take_the_kernels_settings(shell, kernel_settings, method):
    import torch._dynamo.config
    from torch.utils._config_module import _UNSET_SENTINEL
    torch.set_default_dtype(torch.float64)
    torch.autograd.set_detect_anomaly(True)
    torch._dynamo.config.capture_scalar_outputs = True   # as a graph-break warning tells a user to
    run_cell(shell, SETUP)
    try:
        result, out, _ = run_cell(shell, f"%%sharedtrain --nprocs 2 --start-method {method}\n" + READ
                                  + "import torch._dynamo.config\n"
                                  + "report(dtype=seen[1], anomaly=seen[2], "
                                    "scalars=torch._dynamo.config.capture_scalar_outputs)\n")
    finally:
        torch._dynamo.config._config["capture_scalar_outputs"].user_override.set(_UNSET_SENTINEL)
    assert result.error_in_exec is None, out
    history = shell.user_ns["sharedtrain"].history
    seen = [(h[-1]["dtype"], h[-1]["anomaly"], h[-1]["scalars"]) for h in history]
    assert seen == [("torch.float64", True, True)] * 2
