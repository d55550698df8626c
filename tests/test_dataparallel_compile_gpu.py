"""%%dataparallel --compile on one GPU (a rank on cuda:0): inductor and CUDA graphs train as eager does,
and a later cell trains the model the rank compiled, nothing traced again.

Run on the GPU machine: ``pytest -m gpu tests/test_dataparallel_compile_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch

from gpumagic.dataparallel.plan import POOL_NAME
from gpumagic.dataparallel.run import last_result
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell
from tests.test_magics_dataparallel_gpu import SETUP, TRAIN, _reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def _assert_weights(ns, reference):
    for name, p in ns["model"].state_dict().items():
        torch.testing.assert_close(p, reference.state_dict()[name].cpu(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_later_compiled_cell_on_one_gpu_reuses_the_compiled_model(shell, mode):
    run_cell(shell, SETUP.format(where="cpu"))
    ns = shell.user_ns
    two, four = _reference(ns, epochs=2), _reference(ns, epochs=4)
    line = f"--devices cuda:0 --compile {mode}"
    _, cap = dp_cell(shell, line, TRAIN)
    assert "--compile: compiled" in cap.stderr or "--compile: traced again" in cap.stderr, cap.stderr
    _assert_weights(ns, two)
    _, cap = dp_cell(shell, line, TRAIN)     # the trained model and its optimizer's momentum, again
    assert "--compile: the compiled model was reused, nothing recompiled" in cap.stderr, cap.stderr
    _assert_weights(ns, four)
    result = last_result()
    from_start = result.timings["start"] + result.per_rank[0]["first_step"]
    print(f"{mode}: later cell's first optimizer step {from_start:.2f} s from the cell's start")
    assert from_start < 2.0, result.timings
