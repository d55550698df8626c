"""A training loop kept in a notebook class (a trainer object holding the model, optimizer and
loader, or a runner whose methods read the notebook's globals), run by a %%dataparallel cell
(CPU, 2 ranks): found, averaged, and equal to one process."""
from __future__ import annotations

import copy

import torch

from gpumagic.dataparallel.run import last_result
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(32, 4); Y = X.sum(1, keepdim=True)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)

class Trainer:                     # holds what it trains
    def __init__(self, model, opt, loader):
        self.model, self.opt, self.loader = model, opt, loader
        self.seen = 0
    def epoch(self, data=None):
        for x, y in (data if data is not None else self.loader):
            self.opt.zero_grad(); ((self.model(x) - y) ** 2).mean().backward(); self.opt.step()
            self.seen += len(x)

class Runner:                      # reads the notebook's globals
    def epoch(self):
        for x, y in loader:
            opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()

trainer = Trainer(model, opt, loader)
runner = Runner()
"""


def _one_process(ns, epochs=1):
    model = copy.deepcopy(ns["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(epochs):
        for x, y in ns["loader"]:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    return model


def _same(a, b):
    return all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_trainer_object_holding_the_model_and_loader_trains_split_and_averaged(shell):
    run_cell(shell, SETUP)
    ns = shell.user_ns
    reference = _one_process(ns)
    dp_cell(shell, "--nprocs 2", "trainer.epoch()\n")      # (model, opt and loader only inside trainer)
    result = last_result()
    assert result.modules == ["model"] and result.optimizers == ["opt"] and result.loaders == ["loader"]
    # each rank took its share of every batch through DDP: one process's result, half the samples each
    assert _same(ns["model"], reference)
    assert {r: s["samples"] for r, s in result.per_rank.items()} == {0: 16, 1: 16}
    assert ns["trainer"].seen == 16 and ns["trainer"].model is ns["model"] and ns["trainer"].loader is ns["loader"]


def test_a_model_held_by_an_object_and_called_through_it_is_averaged(shell):
    # the loader comes as an argument (split), the model through self.model: without DDP in between,
    # each rank would train on its half alone and the notebook would get rank 0's
    run_cell(shell, SETUP)
    ns = shell.user_ns
    reference = _one_process(ns, epochs=2)
    dp_cell(shell, "--nprocs 2", "for _ in range(2):\n    trainer.epoch(loader)\n")
    assert _same(ns["model"], reference)


def test_a_runner_whose_methods_read_the_notebooks_model_is_found(shell):
    run_cell(shell, SETUP)
    ns = shell.user_ns
    reference = _one_process(ns)
    dp_cell(shell, "--nprocs 2", "runner.epoch()\n")
    assert last_result().modules == ["model"]
    assert _same(ns["model"], reference)
