"""What a %%dataparallel cell on a GPU rank writes, saves, displays and reads from the kernel (one GPU,
NCCL, one rank): C-level and subprocess output, torch.save, display(), %env and %cd.

Run on the GPU machine: ``pytest -m gpu tests/test_dataparallel_cell_io_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch
from IPython.utils.capture import capture_output

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell

pytestmark = pytest.mark.gpu

SETUP = """
import os, subprocess, torch
from IPython.display import HTML, display
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(64, 8)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8)
"""

CELL = """
for x, y in loader:
    opt.zero_grad(); loss = torch.nn.functional.mse_loss(model(x.cuda()), y.cuda()); loss.backward(); opt.step()
torch.save({"model": model.state_dict(), "loss": loss}, PATH)
os.write(1, b"written below python\\n")
subprocess.run(["nvidia-smi", "-L"])
display(HTML("<b>on the gpu</b>"))
seen = (os.getcwd(), os.environ.get("GPUMAGIC_GPU_TEST"), os.environ.get("LOCAL_RANK"))
last_grad = model.weight.grad.clone()
"""


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def test_a_gpu_ranks_output_saves_displays_and_environment(shell, tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    assert run_cell(shell, SETUP + f"PATH = {str(tmp_path / 'ckpt.pt')!r}\n")[0].success
    run_cell(shell, "%%dataparallel --devices cuda:0\nfor x, y in loader: model(x.cuda())\n")   # the pool is up
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUMAGIC_GPU_TEST", "set after the pool started")
    monkeypatch.setenv("LOCAL_RANK", "the kernel's")         # a rank's own: not sent
    with capture_output(display=True) as cap:
        result = shell.run_cell("%%dataparallel --devices cuda:0\n" + CELL)
    assert result.error_in_exec is None, cap.stdout + cap.stderr
    ns = shell.user_ns
    assert cap.stdout.count("written below python") == 1 and "GPU 0:" in cap.stdout, cap.stdout
    assert [o.data.get("text/html") for o in cap.outputs if "text/html" in o.data] == ["<b>on the gpu</b>"]
    checkpoint = torch.load(ns["PATH"], map_location="cpu")   # (no CUDA context in the kernel for it)
    assert float(checkpoint["loss"]) == float(ns["loss"])
    torch.testing.assert_close(checkpoint["model"]["weight"], ns["model"].weight.detach())
    # the rank's last gradient is on the notebook's (CPU) parameter, as after a plain cell
    assert ns["model"].weight.grad.device.type == "cpu" and torch.equal(ns["model"].weight.grad, ns["last_grad"])
    assert ns["seen"][:2] == (str(tmp_path), "set after the pool started")
    assert ns["seen"][2] != "the kernel's"


def test_the_kernels_default_dtype_holds_on_a_gpu_rank_and_the_cells_settings_come_back(shell):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    from gpumagic.procs import torch_settings
    saved = torch_settings.current()
    try:
        torch.set_default_dtype(torch.float64)
        assert run_cell(shell, SETUP)[0].success
        run_cell(shell, "%%dataparallel --devices cuda:0\n"
                        "for x, y in loader: opt.zero_grad(); model(x.cuda()).sum().backward(); opt.step()\n"
                        "made = (str(torch.randn(2, device='cuda').dtype), str(torch.randn(2).device))\n"
                        "torch.set_float32_matmul_precision('high')\n")
        assert shell.user_ns["made"] == ("torch.float64", "cpu")
        assert torch.get_float32_matmul_precision() == "high"     # the cell's setting, in the notebook
    finally:
        torch_settings.apply(saved)


def test_what_a_gpu_rank_collects_and_fills_comes_back_on_the_cpu(shell):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    assert run_cell(shell, SETUP + "preds = torch.zeros(64)\nmodel.seen = []\n")[0].success
    ns = shell.user_ns
    preds, seen = ns["preds"], ns["model"].seen
    result = shell.run_cell("%%dataparallel --devices cuda:0\n"
                            "for i, (x, y) in enumerate(loader):\n"
                            "    opt.zero_grad(); out = model(x.cuda()); loss = (out - y.cuda()).pow(2).mean()\n"
                            "    loss.backward(); opt.step()\n"
                            "    model.seen.append(loss)            # a CUDA tensor with its graph\n"
                            "    preds[i * 8:(i + 1) * 8] = out.detach().squeeze(1)   # into a notebook CPU tensor\n")
    assert result.error_in_exec is None
    assert ns["model"].seen is seen and len(seen) == 8 and {t.device.type for t in seen} == {"cpu"}
    assert ns["preds"] is preds and bool((preds != 0).all())
    assert ns["model"].weight.grad is not None and ns["model"].weight.grad.device.type == "cpu"
