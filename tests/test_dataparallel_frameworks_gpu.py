"""Launch mode on two GPUs (NCCL), with CUDA initialised in the kernel first.

The framework cells of the CPU tests (framework_cells.py), with Lightning
and Fabric on ``accelerator="gpu"``: each framework sees two processes, each
rank trains on its own GPU, and the notebook's model gets the weights back.
Run on the GPU machine: ``pytest -m gpu2 tests/test_dataparallel_frameworks_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch

from gpumagic.errors import WorkerError
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, dp_pool, interrupt_once_training, wait_dead
from tests.framework_cells import CASES, SETUP

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2]

# What each rank reports: its GPU, and the device its framework trained the model on.
WHERE = """
import os
gpu = torch.cuda.current_device()
rank_env = int(os.environ["LOCAL_RANK"])
"""


def setup(shell, case, mode="train", epochs=1, marker=""):
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    extra, cell = CASES[case]
    # CUDA in use in the kernel before the first %%dataparallel cell, as after any GPU work in a notebook
    for source in ("import torch\n_ = torch.ones(1, device='cuda')\n",
                   SETUP.format(mode=mode, marker=marker, epochs=epochs), extra):
        if source:
            result, text, _ = run_cell(shell, source)
            assert result.success, text
    assert torch.cuda.is_initialized()
    return cell.replace('accelerator="cpu"', 'accelerator="gpu"') + WHERE


@pytest.mark.parametrize("case", list(CASES))
def test_framework_trains_on_two_gpus_with_cuda_used_in_the_kernel(shell, case):
    cell = setup(shell, case)
    ns = shell.user_ns
    target = ns["bert"] if case == "hf-trainer" else ns["model"]
    _, cap = dp_cell(shell, "", cell)
    assert "launch mode, because the cell" in cap.stderr, cap.stderr
    assert dp_pool().backend == "nccl" and dp_pool().devices == ["cuda:0", "cuda:1"]
    assert ns["world"] == 2 and ns["agree"] is True
    assert ns["gpu"] == 0 and ns["rank_env"] == 0             # rank 0 on its own GPU, LOCAL_RANK matching
    assert [float(p.detach().double().sum()) for p in target.parameters()] == ns["final"]
    assert all(p.device.type == "cpu" for p in target.parameters())   # back where the notebook keeps it
    if case == "hf-trainer":
        assert ns["result"].global_step == 4
    else:
        assert ns["batches"] == 4
    if case in ("accelerate", "fabric", "hand-ddp"):
        for k, v in ns["model"].state_dict().items():
            assert torch.allclose(v, ns["reference"].state_dict()[k], atol=1e-4), k


def test_hf_training_arguments_made_in_the_kernel_resolve_each_ranks_gpu(shell):
    cell = setup(shell, "hf-trainer")
    run_cell(shell, "kernel_device = str(args.device)")
    assert shell.user_ns["kernel_device"] == "cuda:0"
    _, cap = dp_cell(shell, "--all-output", cell + "print('rank', os.environ['RANK'], 'device', args.device)\n")
    # made in the kernel on cuda:0, each rank's copy works out its own GPU, as if made there
    assert "[rank 0] rank 0 device cuda:0" in cap.stdout and "[rank 1] rank 1 device cuda:1" in cap.stdout


@pytest.mark.parametrize("case", ["accelerate", "hand-ddp", "lightning-ddp", "hf-trainer"])
def test_gpu_rank_error_and_interrupt(shell, case, tmp_path):
    cell = setup(shell, case, mode="fail")
    ns = shell.user_ns
    target = ns["bert"] if case == "hf-trainer" else ns["model"]
    state = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(WorkerError) as err:
        dp_cell(shell, "", cell)
    assert (err.value.rank, err.value.exc_type) == (1, "ValueError")
    assert all(torch.equal(v, state[k]) for k, v in target.state_dict().items())
    # an interrupt while training: the ranks end, the next cell works
    marker = tmp_path / "training"
    cell = setup(shell, case, mode="hang", epochs=10_000, marker=str(marker))
    dp_cell(shell, "", "warm = 1\nmodel(X.cuda())\n")
    pids = list(dp_pool().pids)

    interrupt_once_training(shell, "", cell, marker)
    assert wait_dead(pids, timeout=10.0) == []
    ns["MODE"] = "train"
    dp_cell(shell, "", "ok = 1\nmodel(X.cuda())\n")
    assert ns["ok"] == 1 and dp_pool().pids != pids
