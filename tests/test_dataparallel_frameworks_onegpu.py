"""Launch mode on one GPU (NCCL, one rank), with CUDA initialised in the kernel first.

One rank distributes nothing, but each framework takes the path it takes on
two GPUs: the rank's ``torchrun`` environment, ``cuda`` meaning its GPU, the
process group (found initialised, or made by the framework), the model trained
on the GPU and its weights written back into the notebook's CPU model. The
two-GPU proof is tests/test_dataparallel_frameworks_gpu.py.
Run on the GPU machine: ``pytest -m "gpu and not gpu2" tests/test_dataparallel_frameworks_onegpu.py``.
"""
from __future__ import annotations

import pytest
import torch

from gpumagic.errors import WorkerError
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, dp_pool
from tests.framework_cells import CASES, SETUP

pytestmark = pytest.mark.gpu

ONE = "--devices cuda:0"
ACCELERATOR = 'accelerator="gpu", devices=1'

WHERE = """
import os
gpu = torch.cuda.current_device()
rank_env = (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"])
trained_on = str(next({model}.parameters()).device)
"""
# Lightning's teardown after fit() moves the module back to the CPU, in a plain cell too: where it trained
# is its strategy's device.
LIGHTNING_WHERE = "trained_on = str(trainer.strategy.root_device)\n"


def setup(shell, case, mode="train"):
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    extra, cell = CASES[case]
    for source in ("import torch\n_ = torch.ones(1, device='cuda')\n",
                   SETUP.format(mode=mode, marker="", epochs=1), extra):
        if source:
            result, text, _ = run_cell(shell, source)
            assert result.success, text
    assert torch.cuda.is_initialized()   # the peers' notebook launchers refuse to start from here
    model = "bert" if case == "hf-trainer" else "model"
    where = WHERE.format(model=model) + (LIGHTNING_WHERE if case.startswith("lightning") else "")
    return cell.replace('accelerator="cpu", devices=2', ACCELERATOR) + where


@pytest.mark.parametrize("case", list(CASES))
def test_framework_trains_on_the_gpu_and_the_weights_come_back(shell, case):
    cell = setup(shell, case)
    ns = shell.user_ns
    target = ns["bert"] if case == "hf-trainer" else ns["model"]
    params = list(target.parameters())
    _, cap = dp_cell(shell, ONE, cell)
    assert "launch mode, because the cell" in cap.stderr, cap.stderr
    assert dp_pool().backend == "nccl" and dp_pool().devices == ["cuda:0"]
    assert ns["world"] == 1 and ns["agree"] is True
    assert ns["gpu"] == 0 and ns["rank_env"] == ("0", "0", "1")
    assert ns["trained_on"] == "cuda:0"                          # the framework trained on the GPU
    assert list(target.parameters()) == params                  # the notebook's own objects, in place
    assert all(p.device.type == "cpu" for p in params)
    assert [float(p.detach().double().sum()) for p in params] == ns["final"]
    before = ns["bert_before"] if case == "hf-trainer" else ns["before"]
    assert any(not torch.equal(v, before[k]) for k, v in target.state_dict().items())
    steps = ns["result"].global_step if case == "hf-trainer" else ns["batches"]
    assert steps == 8                                            # 64 samples at 8 per step, one process


def test_rank_error_leaves_the_model_and_the_next_cell_works(shell):
    cell = setup(shell, "accelerate")
    run_cell(shell, "def on_step():\n    raise ValueError('rank zero fails')\n")
    state = {k: v.clone() for k, v in shell.user_ns["model"].state_dict().items()}
    with pytest.raises(WorkerError) as err:
        dp_cell(shell, ONE, cell)
    assert (err.value.rank, err.value.exc_type) == (0, "ValueError")
    assert all(torch.equal(v, state[k]) for k, v in shell.user_ns["model"].state_dict().items())
    dp_cell(shell, ONE, "ok = torch.cuda.current_device()\nmodel(X.cuda())\n")
    assert shell.user_ns["ok"] == 0
