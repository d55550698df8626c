"""%%dataparallel cells that fill lists and dicts of tensors held by notebook objects, as a plain cell fills
them (CPU, gloo, 2 ranks): ``self.outs.append(model(x).detach())`` in a method of a notebook class."""
from __future__ import annotations

import copy

import torch

from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, last_result

CPU2 = "--nprocs 2"

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(16, 4)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=4)

class Runner:
    def __init__(self):
        self.outs = []
        self.weights = {}
    def fit(self):
        for (x,) in loader:
            opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
        self.weights[len(self.weights)] = model.weight.detach().clone()
    def evaluate(self):
        with torch.no_grad():                 # read whole on every rank, as the tutorials' test()
            for (x,) in loader:
                self.outs.append(model(x).detach())
trainer = Runner()
preds = []
"""


def _reference(ns):
    """The model after one epoch in this process, as a plain cell trains it."""
    ref = copy.deepcopy(ns["model"])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for (x,) in ns["loader"]:
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    return ref


def test_a_list_of_tensors_a_notebook_object_holds_comes_back(shell):
    """``self.outs.append(model(x).detach())`` in a notebook class's method: a plain cell leaves the
    tensors in ``trainer.outs``; under %%dataparallel the list stayed empty and the note said
    "trainer.outs (not a plain value)"."""
    result, text, _ = run_cell(shell, SETUP)
    assert result.success, text
    ns = shell.user_ns
    trainer = ns["trainer"]
    outs, weights, preds = trainer.outs, trainer.weights, ns["preds"]
    reference = _reference(ns)
    dp_cell(shell, CPU2, """
        trainer.fit()
        trainer.evaluate()
        with torch.no_grad():
            preds.append(model(X))
        """)
    assert trainer.outs is outs and trainer.weights is weights        # the notebook's own, refilled
    with torch.no_grad():
        expected = [reference(x) for (x,) in ns["loader"]]
    assert len(outs) == 4 and all(o.device.type == "cpu" and not o.requires_grad for o in outs)
    assert all(torch.allclose(o, e, atol=1e-6, rtol=0) for o, e in zip(outs, expected))
    assert list(weights) == [0] and torch.allclose(weights[0], reference.weight, atol=1e-6, rtol=0)
    # a notebook list of plain values (empty) the cell appended a tensor to: lost without a word before
    assert ns["preds"] is preds and len(preds) == 1
    assert torch.allclose(preds[0], reference(ns["X"]).detach(), atol=1e-6, rtol=0)
    assert {"trainer.outs", "trainer.weights", "preds"} <= set(last_result().values)
    assert last_result().not_returned == []

    # A later cell: the list holds tensors as it starts; they stay the notebook's objects, one of them
    # changed in place, and the new ones are appended.
    first = outs[0]
    dp_cell(shell, CPU2, "trainer.evaluate()\ntrainer.outs[0].zero_()\n")
    assert trainer.outs is outs and len(outs) == 8 and outs[0] is first
    assert torch.equal(first, torch.zeros(4, 2))
    assert all(torch.allclose(o, e, atol=1e-6, rtol=0) for o, e in zip(outs[4:], expected))
