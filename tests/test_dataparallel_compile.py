"""%%dataparallel --compile on the CPU: two gloo ranks compile the cell's model with torch.compile,
train it as one eager process would, keep it warm for later cells, and say when they compiled."""
from __future__ import annotations

import random

import pytest
import torch
from IPython.core.error import UsageError

from gpumagic.dataparallel.plan import POOL_NAME
from gpumagic.dataparallel.run import last_result
from gpumagic.errors import WorkerError
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell
from tests.test_magics_dataparallel import CPU2, SETUP, TRAIN, _reference

pytestmark = pytest.mark.filterwarnings("ignore:the cell reads no DataLoader")


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def _first_step(result) -> float:
    return result.per_rank[0]["first_step"]


def test_compiled_training_equals_eager_training_and_a_later_cell_starts_warm(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    ns = shell.user_ns
    ref_model, _, ref_losses = _reference(ns)
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    for name, p in ns["model"].state_dict().items():     # no _orig_mod. or module. prefix
        torch.testing.assert_close(p, ref_model.state_dict()[name], atol=1e-4, rtol=0)
    assert "--compile:" in cap.stderr
    first = _first_step(last_result())
    # The same model again: nothing to compile (reused, or traced and taken from inductor's cache).
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    assert "--compile: compiled" not in cap.stderr and "--compile:" in cap.stderr, cap.stderr
    again = _first_step(last_result())
    assert again < 2.0 and again < first, (first, again)


def test_a_changed_model_class_is_compiled_again_with_a_note(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, f"{CPU2} --compile", TRAIN)
    # A new forward, with a constant drawn now: code inductor's on-disk cache has never seen.
    scale = 1 + random.random() / 1000
    run_cell(shell, SETUP.format(shuffle=False).replace("torch.tanh(self.hidden(x))",
                                                        f"torch.tanh(self.hidden(x) * {scale!r})"))
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    assert "--compile: compiled" in cap.stderr, cap.stderr


def test_a_compile_error_is_a_worker_error_at_the_cells_line(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    before = {k: v.clone() for k, v in shell.user_ns["model"].state_dict().items()}
    with pytest.raises(WorkerError) as err:
        dp_cell(shell, f"{CPU2} --compile", """
            x = torch.randn(4, 7)              # the model takes 6 features
            model(x).sum().backward()
        """)
    tb = err.value.remote_traceback
    assert "line 4, in <module>\n    model(x).sum().backward()" in tb, tb   # the magic line is line 1
    for k, v in shell.user_ns["model"].state_dict().items():
        assert torch.equal(v, before[k])      # the notebook's model is untouched


@pytest.mark.parametrize("line, says", [
    (f"{CPU2} --compile fastest", "reduce-overhead"),
    (f"{CPU2} --strategy dp --compile", "--strategy ddp"),
])
def test_bad_compile_options_are_refused_before_any_process(shell, line, says):
    run_cell(shell, SETUP.format(shuffle=False))
    with pytest.raises(UsageError, match=says):
        dp_cell(shell, line, TRAIN)
