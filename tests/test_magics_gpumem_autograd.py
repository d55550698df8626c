"""%gpumem --vars counts what a kept result's autograd graph saved for backward (activations)."""
from __future__ import annotations

import pytest

from tests.conftest import run_cell

pytestmark = pytest.mark.usefixtures("no_last_error")

B, IN, HIDDEN, OUT = 64, 32, 256, 10
F32 = 4
# What backward needs from the forward of Linear -> ReLU -> Linear -> pow(2).mean(), by shape: the ReLU's
# output (saved by the ReLU and, as its input, by the second Linear: one storage) and the second Linear's
# output (saved by pow). The first Linear saves the batch, and the second its weight: the variables `x`
# and `model` hold those.
ACTIVATIONS = (B * HIDDEN + B * OUT) * F32
PARAMS = (IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT) * F32
BATCH = B * IN * F32

TRAINING_CELL = f"""
import torch
from torch.multiprocessing.reductions import StorageWeakRef
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear({IN}, {HIDDEN}), torch.nn.ReLU(), torch.nn.Linear({HIDDEN}, {OUT}))
x = torch.randn({B}, {IN})

# The test's own record of the storages backward needs, for `del loss` to prove they are freed.
_kept = []
_hooks = [model[i].register_forward_hook(lambda m, i, o: _kept.append(StorageWeakRef(o.untyped_storage())))
          for i in (1, 2)]
loss = model(x).pow(2).mean()
for _h in _hooks:
    _h.remove()
"""

SAVED_BY_TORCH = """
# torch's own count: the distinct storages a second, identical forward saves, less the batch's and
# the weights' (what the variables hold).
_held = {t.untyped_storage().data_ptr() for t in [x, *model.parameters()]}
_saved = {}
def _pack(t):
    _saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return t
with torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
    _again = model(x).pow(2).mean()
saved_by_torch = sum(n for ptr, n in _saved.items() if ptr not in _held)
del _again, _pack
"""


def vars_json(shell) -> dict:
    return shell.run_line_magic("gpumem", "--vars --json")


def row(held: dict, name: str) -> dict | None:
    found = [v for v in held["variables"] if v["name"] == name]
    assert len(found) <= 1
    return found[0] if found else None


def test_a_kept_loss_holds_its_activations_and_del_frees_them(shell, no_cuda_init):
    result, _, _ = run_cell(shell, TRAINING_CELL + SAVED_BY_TORCH)
    assert result.success, result.error_in_exec
    assert shell.user_ns["saved_by_torch"] == ACTIVATIONS   # the shapes' count is torch's count

    # The table: loss is the largest holder, its activations under "autograd".
    result, out, _ = run_cell(shell, "%gpumem --vars")
    assert result.success
    lines = {line.split()[0]: line for line in out.splitlines() if line.split()}
    assert "tensors 4 B, autograd 66.5 KiB" in lines["loss"]          # 68,096 bytes
    assert "autograd: what a result's graph keeps for backward" in out

    # --json: the same bytes exactly; the weights and the batch the graph saved stay the model's and x's.
    held = vars_json(shell)
    assert [v["name"] for v in held["variables"]] == ["loss", "model", "x"]   # largest first
    loss = row(held, "loss")
    assert loss["parts"] == {"tensors": F32, "autograd": ACTIVATIONS}
    assert loss["bytes"] == F32 + ACTIVATIONS and loss["shared"] == 0
    assert row(held, "model")["parts"] == {"params": PARAMS}
    assert row(held, "x")["bytes"] == BATCH
    assert held["totals"] == {"cpu": F32 + ACTIVATIONS + PARAMS + BATCH}

    # Reading the graph kept nothing alive: `del loss` frees the saved activations' storages.
    kept = shell.user_ns["_kept"]
    assert len(kept) == 2 and not any(ref.expired() for ref in kept)
    run_cell(shell, "del loss\nimport gc; gc.collect()")
    assert all(ref.expired() for ref in kept)
    held = vars_json(shell)
    assert row(held, "loss") is None and held["totals"] == {"cpu": PARAMS + BATCH}


def test_backward_frees_the_activations_and_the_row_says_so(shell, no_cuda_init):
    run_cell(shell, TRAINING_CELL)
    run_cell(shell, "loss.backward()")
    held = vars_json(shell)
    assert row(held, "loss")["parts"] == {"tensors": F32}
    assert row(held, "model")["parts"] == {"params": PARAMS, "grads": PARAMS}
    assert not any("autograd" in note for note in held["notes"])


def test_weights_and_batch_count_for_the_loss_once_no_variable_holds_them(shell, no_cuda_init):
    run_cell(shell, TRAINING_CELL)
    run_cell(shell, "del model, x")
    held = vars_json(shell)
    # The graph saved the batch (first Linear) and holds every parameter (to accumulate into): now only
    # `loss` keeps them alive, so they are its memory.
    assert row(held, "loss")["parts"] == {"tensors": F32, "autograd": ACTIVATIONS + PARAMS + BATCH}
    assert held["totals"] == {"cpu": F32 + ACTIVATIONS + PARAMS + BATCH}


def test_two_results_of_one_graph_share_its_activations(shell, no_cuda_init):
    run_cell(shell, TRAINING_CELL.replace("loss = model(x).pow(2).mean()",
                                          "out = model(x)\nloss = out.pow(2).mean()"))
    held = vars_json(shell)
    relu_out = B * HIDDEN * F32
    # `out` holds its own values (which pow saved: `out`'s, not the loss's) and the ReLU's output its graph
    # saved; `loss` keeps that ReLU output too, so both rows show it as shared, and the total counts it once.
    assert row(held, "out")["parts"] == {"tensors": B * OUT * F32, "autograd": relu_out}
    assert row(held, "loss")["parts"] == {"tensors": F32, "autograd": relu_out}
    assert row(held, "loss")["shared"] == relu_out and row(held, "loss")["shared_with"] == ["out"]
    assert held["totals"] == {"cpu": F32 + B * OUT * F32 + relu_out + PARAMS + BATCH}


def test_a_huge_graph_is_read_up_to_the_limit_with_a_note(shell, no_cuda_init, monkeypatch):
    from gpumagic.memory import autograd_graph
    monkeypatch.setattr(autograd_graph, "MAX_NODES", 100)
    run_cell(shell, "import torch\nleaf = torch.ones(10, requires_grad=True)\ny = leaf\n"
                    "for _ in range(300):\n    y = y.exp()")
    held = vars_json(shell)
    # Each exp saves its own output (10 floats). Of the 100 nodes read, the first saved y's own values;
    # the other 99 saved one storage each. Nothing past them was read.
    assert row(held, "y")["parts"] == {"tensors": 40, "autograd": 99 * 40}
    assert "autograd graphs of y: more than 100 nodes; the saved tensors of the rest were not counted." \
        in held["notes"]
