"""%%dataparallel runs framework training unchanged, in launch mode (CPU, gloo, 2 processes).

Hugging Face Trainer, accelerate, Lightning's Trainer (three strategies) and
Fabric, and a hand-written DDP loop: each sees two processes, does half the
steps, and leaves its trained weights in the notebook's model. A rank error
names the rank and the cell line and leaves the model untouched; an interrupt
ends the ranks and the next cell works. The cells are in framework_cells.py.
"""
from __future__ import annotations

import pytest
import torch

from gpumagic.errors import WorkerError
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, dp_pool, interrupt_once_training, wait_dead
from tests.framework_cells import CASES, SETUP

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

CPU2 = "--nprocs 2"


def setup(shell, case, mode="train", epochs=1, tmp_path=None):
    marker = str(tmp_path / "training") if tmp_path is not None else ""
    extra, cell = CASES[case]
    for source in (SETUP.format(mode=mode, marker=marker, epochs=epochs), extra):
        if source:
            result, text, _ = run_cell(shell, source)
            assert result.success, text
    return cell


def trained(ns, case):
    return ns["bert"] if case == "hf-trainer" else ns["model"]


def equal_states(a: dict, b: dict, tol=0.0) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=tol, rtol=0) for k in a)


@pytest.mark.parametrize("case", list(CASES))
def test_framework_trains_on_two_ranks_and_the_weights_come_back(shell, case):
    cell = setup(shell, case)
    ns = shell.user_ns
    model_object = trained(ns, case)
    _, cap = dp_cell(shell, CPU2, cell)
    assert "launch mode, because the cell" in cap.stderr, cap.stderr
    assert ns["world"] == 2 and ns["agree"] is True
    assert trained(ns, case) is model_object          # the notebook's own object, trained in place
    # rank 0's trained weights, in the notebook's model
    assert [float(p.detach().double().sum()) for p in model_object.parameters()] == ns["final"]
    if case == "hf-trainer":
        # half the steps one process takes at the same per-device batch
        result, text, _ = run_cell(shell, "single = transformers.Trainer(model=copy.deepcopy(bert), args=args, "
                                          "train_dataset=texts).train().global_step")
        assert result.success, text
        assert ns["result"].global_step * 2 == ns["single"] == 8
        assert not equal_states(ns["bert"].state_dict(), ns["bert_before"])
        note = cap.stderr.split("not brought back")[1].splitlines()[0]
        assert "trainer (holds a Trainer" in note and "history = trainer.state.log_history" in note
    else:
        assert ns["batches"] == 4                      # 8 batches of 8, shared by two ranks
        assert not equal_states(ns["model"].state_dict(), ns["before"])
    if case in ("accelerate", "fabric", "hand-ddp"):
        # the same samples per step as one process at batch 16: the same weights
        assert equal_states(ns["model"].state_dict(), ns["reference"].state_dict(), tol=1e-5)
        # the notebook's optimizer, with its momentum
        for p, q in zip(ns["opt"].param_groups[0]["params"], ns["ref_opt"].param_groups[0]["params"]):
            assert torch.allclose(ns["opt"].state[p]["momentum_buffer"], ns["ref_opt"].state[q]["momentum_buffer"],
                                  atol=1e-5)


def test_progress_bars_and_logs_of_rank_0_show_in_the_cell(shell):
    cell = setup(shell, "lightning-ddp")
    _, cap = dp_cell(shell, CPU2, cell)
    out = cap.stdout + cap.stderr
    assert "max_epochs=1` reached" in out                       # Lightning's log line
    assert "4/4" in out                                          # its progress bar, rank 0's steps


def test_progress_bars_in_a_jupyter_kernel_send_no_cursor_moves(shell, monkeypatch):
    """ipykernel sets FORCE_COLOR, which made rich (Lightning's bar) draw as on a terminal: cursor moves
    and erases, ten frames a second, that a notebook shows as a growing pile of lines."""
    pytest.importorskip("rich")
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("CLICOLOR_FORCE", "1")
    run_cell(shell, "%dataparallel stop")        # workers that start with the kernel's environment as it is now
    cell = setup(shell, "lightning-ddp")
    cell = cell.replace("callbacks=[StepHook()]", "callbacks=[StepHook(), L.pytorch.callbacks.RichProgressBar()]")
    _, cap = dp_cell(shell, CPU2, cell + "import rich.console\nterminal = rich.console.Console().is_terminal\n")
    out = cap.stdout + cap.stderr
    assert shell.user_ns["terminal"] is False
    assert "4/4" in out and "Epoch 0" in out                     # the bar's last frame
    assert "\x1b[" not in out                                    # no cursor moves, erases or colours


def test_the_next_hand_written_cell_finds_the_pool_group_again(shell):
    """A launch cell that destroyed the group, or left its own, does not break the next cells."""
    cell = setup(shell, "hand-ddp")
    dp_cell(shell, CPU2, cell)
    dp_cell(shell, CPU2, "import torch.distributed as dist\ndist.init_process_group('gloo')\nkept = 1\n")
    dp_cell(shell, CPU2, "for x, y in loader:\n    opt.zero_grad()\n"
                         "    torch.nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n"
                         "import torch.distributed as dist\nsize = dist.get_world_size()\n")
    assert shell.user_ns["size"] == 2


@pytest.mark.parametrize("case", ["accelerate", "fabric", "hand-ddp", "lightning-ddp", "hf-trainer"])
def test_a_rank_error_names_rank_and_line_and_leaves_the_model(shell, case, tmp_path):
    cell = setup(shell, case, mode="fail")
    ns = shell.user_ns
    state = {k: v.clone() for k, v in trained(ns, case).state_dict().items()}
    with pytest.raises(WorkerError) as err:
        dp_cell(shell, CPU2, cell)
    assert (err.value.rank, err.value.exc_type) == (1, "ValueError"), err.value.all_errors
    assert "rank one fails" in err.value.message
    # the line that raised, in the set-up cell that defined on_step
    assert "raise ValueError(\"rank one fails\")" in err.value.remote_traceback
    assert "Cell In[" in err.value.remote_traceback
    assert equal_states(trained(ns, case).state_dict(), state)
    dp_cell(shell, CPU2, "ok = 5\nmodel(X)\n")
    assert ns["ok"] == 5


@pytest.mark.parametrize("case", ["accelerate", "fabric", "hand-ddp", "lightning-ddp", "hf-trainer"])
def test_an_interrupt_ends_the_ranks_and_the_next_cell_works(shell, case, tmp_path):
    cell = setup(shell, case, mode="hang", epochs=10_000, tmp_path=tmp_path)
    dp_cell(shell, CPU2, "warm = 1\nmodel(X)\n")
    pids = list(dp_pool().pids)
    marker = tmp_path / "training"

    interrupt_once_training(shell, CPU2, cell, marker)
    assert wait_dead(pids, timeout=5.0) == []
    shell.user_ns["MODE"] = "train"
    dp_cell(shell, CPU2, "ok = os.getpid()\nmodel(X)\n")
    assert shell.user_ns["ok"] not in pids and dp_pool().alive
