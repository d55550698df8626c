"""%%sharedtrain's notes on optimizers against what the workers' optimizers did (real runs on the CPU)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cell

SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
X = torch.randn(64, 8)
Y = (X[:, 0] > 0).long()
"""

SHARED_ADAM = SETUP + """
class SharedAdam(torch.optim.Adam):
    # The A3C pattern: the moments in shared memory; this variant leaves its 0-d step where it was.
    def __init__(self, params, lr=1e-3):
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p).share_memory_()
                state["exp_avg_sq"] = torch.zeros_like(p).share_memory_()

model = nn.Linear(8, 2)
optimizer = SharedAdam(model.parameters(), lr=0.01)
"""

STEP_AND_REPORT = """%%sharedtrain --nprocs 2 --start-method {method} --seed 1
for _ in range(3):
    {opt}.zero_grad()
    F.cross_entropy({net}(X), Y).backward()
    {opt}.step()
    state = {opt}.state[{net}.weight]
    report(step=float(state["step"]), step_shared=state["step"].is_shared(),
           moments_shared=state["exp_avg"].is_shared())
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_shared_adam_note_says_what_every_worker_updated(shell, method):
    # The note said "all workers update one state" while each worker counted its own `step` from 0: Adam's
    # bias correction then treated the shared moments, updated 6 times, as updated 3 times.
    run_cell(shell, SHARED_ADAM)
    result, out, _ = run_cell(shell, STEP_AND_REPORT.format(method=method, opt="optimizer", net="model"))
    assert result.error_in_exec is None, out
    ns = shell.user_ns
    trained = ns["sharedtrain"]
    note = [n for n in trained.notes if n.startswith("'optimizer'")]
    assert note == ["'optimizer': its state (step, exp_avg, exp_avg_sq) is in shared memory, so all workers "
                    "update one state (step put there too, as exp_avg, exp_avg_sq are)"]
    # What the workers saw: one step counter and one set of moments, all shared.
    reports = [r for r in trained.history.rows()]
    assert len(reports) == 6 and all(r["step_shared"] and r["moments_shared"] for r in reports)
    assert max(r["step"] for r in reports) == 6.0
    for state in ns["optimizer"].state.values():   # the notebook's optimizer is the one they stepped
        assert float(state["step"]) == 6.0 and state["step"].is_shared()


def test_optimizers_in_a_notebook_dict_are_named_in_the_notes(shell):
    # opts = {"g": SGD(...), "d": Adam(...)} got no note while a named optimizer did.
    run_cell(shell, SETUP + """
nets = {"g": nn.Linear(8, 2), "d": nn.Linear(8, 2)}
opts = {"g": torch.optim.SGD(nets["g"].parameters(), lr=0.1, momentum=0.9),
        "d": torch.optim.Adam(nets["d"].parameters(), lr=0.01)}
""")
    result, out, _ = run_cell(shell, """%%sharedtrain --nprocs 2 --start-method fork --seed 1
for _ in range(3):
    for k in ("g", "d"):
        opts[k].zero_grad()
        F.cross_entropy(nets[k](X), Y).backward()
        opts[k].step()
report(d_step=float(opts["d"].state[nets["d"].weight]["step"]),
       d_shared=opts["d"].state[nets["d"].weight]["exp_avg"].is_shared(),
       g_momentum_shared=opts["g"].state[nets["g"].weight]["momentum_buffer"].is_shared())
nets["d"].eval()
""")
    assert result.error_in_exec is None, out
    ns = shell.user_ns
    trained = ns["sharedtrain"]
    own = "each worker steps its own copy ({}, state as in the notebook) over the shared weights; the notebook's " \
          "optimizer is left as it was"
    assert f"\"opts['g']\": {own.format('SGD')}" in trained.notes
    assert f"\"opts['d']\": {own.format('Adam')}" in trained.notes
    # What the workers saw: each its own Adam step count and state; the notebook's optimizers untouched.
    assert [r["d_step"] for r in trained.history.rows()] == [3.0, 3.0]
    assert not any(r["d_shared"] or r["g_momentum_shared"] for r in trained.history.rows())
    assert ns["opts"]["g"].state == {} and ns["opts"]["d"].state == {}
    assert "trained \"nets['g']\" and \"nets['d']\"" in out
    # What the cell set on a module of the dict came back, as for a module bound to a name.
    assert ns["nets"]["g"].training and not ns["nets"]["d"].training


def test_partly_shared_state_names_what_is_per_worker():
    from gpumagic.sharedtrain.sharing import share_optimizer_state
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        optimizer.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p).share_memory_(),
                                  exp_avg_sq=torch.zeros_like(p))
    assert share_optimizer_state("opt", optimizer, on_gpu=False) == (
        "'opt': its exp_avg is in shared memory, one for all workers; its step, exp_avg_sq are per worker, "
        "each its own copy")
    assert not any(s["step"].is_shared() for s in optimizer.state.values())   # left as the notebook made it
    assert share_optimizer_state("opt", optimizer, on_gpu=True).startswith("'opt': each worker steps its own copy")
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    assert share_optimizer_state("plain", plain, on_gpu=False).startswith("'plain': each worker steps its own copy")
