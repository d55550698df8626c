"""%%dataparallel --compile on one GPU (a rank on cuda:0): inductor and CUDA graphs train as eager does,
and a later cell trains the model the rank compiled, nothing traced again.

Run on the GPU machine: ``pytest -m gpu tests/test_dataparallel_compile_gpu.py``.
"""
from __future__ import annotations

import pytest

from gpumagic.dataparallel.plan import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.test_magics_dataparallel_gpu import SETUP, check_compiled_cells_stay_warm

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
