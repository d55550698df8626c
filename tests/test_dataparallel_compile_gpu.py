"""%%dataparallel --compile on one GPU (a rank on cuda:0): inductor and CUDA graphs train as eager does,
a later cell trains the model the rank compiled, nothing traced again, and inductor's compile
workers end with their rank.

Run on the GPU machine: ``pytest -m gpu tests/test_dataparallel_compile_gpu.py``.
"""
from __future__ import annotations

import os
import random
import signal

import psutil
import pytest
import torch

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, dp_pool, wait_dead
from tests.test_dataparallel_compile import COMPILED_FUNCTIONS, through_compiled_functions
from tests.test_magics_dataparallel_gpu import SETUP, TRAIN, _reference, check_compiled_cells_stay_warm

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_later_compiled_cell_on_one_gpu_reuses_the_compiled_model(shell, mode):
    run_cell(shell, SETUP.format(where="cpu"))
    from_start = check_compiled_cells_stay_warm(shell, f"--devices cuda:0 --compile {mode}")
    print(f"{mode}: later cell's first optimizer step {from_start:.2f} s from the cell's start")


def test_inductors_compile_workers_end_with_a_killed_rank(shell):
    # A forward with a constant drawn now: inductor's caches have never seen it, so it compiles kernels.
    scale = 1 + random.random() / 1000
    run_cell(shell, SETUP.format(where="cpu").replace("torch.tanh(self.hidden(x))",
                                                      f"torch.tanh(self.hidden(x) * {scale!r})"))
    dp_cell(shell, "--devices cuda:0 --compile", TRAIN)
    ranks = list(dp_pool().pids)
    family = [c.pid for pid in ranks for c in psutil.Process(pid).children(recursive=True)]
    print(f"rank processes {ranks}, their children {family}")
    os.kill(ranks[0], signal.SIGKILL)    # as the OOM killer would: no clean-up in the rank
    assert wait_dead(ranks + family, timeout=60) == []
    poolmod.stop_pool(POOL_NAME)


def test_functions_the_notebook_compiled_are_compiled_by_inductor_on_the_gpu_rank(shell):
    # The compiled-optimizer tutorial's ``@torch.compile(fullgraph=False) def fn(): opt.step()`` and a
    # compiled loss, from the notebook: the rank compiles their plain functions with inductor on cuda:0.
    run_cell(shell, SETUP.format(where="cpu") + COMPILED_FUNCTIONS)
    ns = shell.user_ns
    reference = _reference(ns)
    dp_cell(shell, "--devices cuda:0",
            through_compiled_functions(TRAIN) + "where = str(next(model.parameters()).device)\n")
    assert ns["where"] == "cuda:0" and ns["graphs"] >= 2, (ns["where"], ns["graphs"])
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, reference.state_dict()[name].cpu(), atol=1e-4, rtol=1e-4)
