"""State only the workers hold (gpumagic.dataparallel.kernel.held): a --strategy fsdp model on the meta
device and --keep-optimizer state. CPU, two gloo ranks, through a real InteractiveShell.

What would end that state silently is refused before anything starts (other ranks; a DDP cell
over it); what ends it anyway (a failed cell, %dataparallel stop) is said.
"""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.errors import WorkerError
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell
from tests.test_dataparallel_fsdp import FSDP2, SETUP, TRAIN

META = SETUP + """
with torch.device('meta'):
    model = Net(width=32, depth=3)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
"""
LOST = "model's weights, opt's state lost: only the workers held them (--strategy fsdp)"


@pytest.fixture(autouse=True)
def _fresh_pool():
    poolmod.stop_pool(POOL_NAME)
    yield
    poolmod.stop_pool(POOL_NAME)


def _trained_meta_model(shell) -> dict:
    result, text, _ = run_cell(shell, META)
    assert result.success, text
    dp_cell(shell, FSDP2, TRAIN)
    return shell.user_ns


def test_other_ranks_or_a_ddp_cell_are_refused_while_only_the_workers_hold_the_model(shell):
    ns = _trained_meta_model(shell)
    pids = poolmod.current_pool(POOL_NAME).pids
    assert "only these workers hold model, opt (--strategy fsdp): stopping them loses it" in \
        run_cell(shell, "%dataparallel status")[1]
    with pytest.raises(UsageError, match=r"would start new workers, and only the current ones hold model's "
                                         r"weights, opt's state .*--devices cpu --nprocs 2"):
        dp_cell(shell, "--strategy fsdp --devices cpu --nprocs 3", TRAIN)
    with pytest.raises(UsageError, match=r"only the workers hold model's weights, opt's state .* a model on the "
                                         r"meta device: continue with --strategy fsdp"):
        dp_cell(shell, "--devices cpu --nprocs 2", TRAIN)
    assert poolmod.current_pool(POOL_NAME).pids == pids        # nothing was started or stopped
    before = len(ns["losses"])
    dp_cell(shell, FSDP2, TRAIN)                                # the same ranks continue
    assert len(ns["losses"]) == before + 8 and sum(ns["losses"][-4:]) < sum(ns["losses"][:4])


def test_a_failed_cell_says_what_was_lost_and_the_next_cell_starts_afresh(shell):
    _trained_meta_model(shell)
    result, text, _ = run_cell(shell, f"%%dataparallel {FSDP2}\nimport torch.distributed as dist\n"
                                      "out = model(X[:4])\nif dist.get_rank() == 1:\n    raise ValueError('x')\n")
    assert isinstance(result.error_in_exec, WorkerError)
    assert LOST in text and "the cell failed, so they dropped what they kept" in text
    _, cap = dp_cell(shell, "--strategy fsdp --devices cpu --nprocs 3", TRAIN)   # nothing left to keep: allowed
    assert "model sharded over the ranks" in cap.stderr and "lost" not in cap.stderr


def test_stop_says_what_it_discards_once(shell):
    _trained_meta_model(shell)
    with_state = run_cell(shell, "%dataparallel stop")[1]
    assert LOST in with_state and "%dataparallel stop ended them" in with_state
    assert "lost" not in run_cell(shell, "%dataparallel stop")[1]


def test_a_model_bound_anew_is_not_held(shell):
    _trained_meta_model(shell)
    run_cell(shell, "model = Net(width=32, depth=3)\nopt = torch.optim.AdamW(model.parameters(), lr=0.01)")
    _, cap = dp_cell(shell, "--devices cpu --nprocs 2", TRAIN)   # a CPU model, DDP, other ranks: fine
    assert "trained state loaded into model" in cap.stderr


def test_a_meta_model_in_a_ddp_cell_is_refused_before_anything_starts(shell):
    result, text, _ = run_cell(shell, META)
    assert result.success, text
    with pytest.raises(UsageError, match=r"model is on the meta device .*--strategy fsdp"):
        dp_cell(shell, "--devices cpu --nprocs 2", TRAIN)
    assert poolmod.current_pool(POOL_NAME) is None


def test_a_second_meta_model_adds_to_what_the_workers_hold(shell):
    ns = _trained_meta_model(shell)
    run_cell(shell, "with torch.device('meta'):\n    other = Net(width=32, depth=3)\n"
                    "other_opt = torch.optim.AdamW(other.parameters(), lr=0.01)\n")
    dp_cell(shell, FSDP2, TRAIN.replace("model(", "other(").replace("opt.", "other_opt."))
    text = run_cell(shell, "%dataparallel status")[1]
    assert "only these workers hold model, opt, other, other_opt (--strategy fsdp)" in text
    assert all(p.is_meta for p in [*ns["model"].parameters(), *ns["other"].parameters()])
