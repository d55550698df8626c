"""A training loop kept in a notebook class (a trainer object holding the model, optimizer and
loader, or a runner whose methods read the notebook's globals), run by a %%dataparallel cell
(CPU, 2 ranks): found, averaged, and equal to one process."""
from __future__ import annotations

import copy

import pytest
import torch

from gpumagic.errors import WorkerError
from tests.conftest import run_cell
from tests.dataparallel_helpers import REGRESSION, dp_cell, last_result, trained_in_one_process

SETUP = REGRESSION + """

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
    assert {r: s.samples for r, s in result.per_rank.items()} == {0: 16, 1: 16}
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


ATTRIBUTE_DICT = """
import torch
torch.manual_seed(0)
class AttrDict(dict):              # a missing attribute raises KeyError, not AttributeError
    __getattr__ = dict.__getitem__
    __setattr__ = dict.__setitem__
hp = AttrDict(scale=2.0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(4, 1)
    def forward(self, x):
        return self.fc(x) * hp.scale
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(32, 4); Y = X.sum(1, keepdim=True)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
"""


def test_an_object_whose_getattr_raises_keyerror_is_read_without_asking_it():
    # an attribute dict read in a model's forward (or by the cell) is no trainer object: finding the
    # cell's names must not ask it for torch's attributes (it answers KeyError)
    import ast

    from gpumagic.cell.names import used_names
    from gpumagic.cell.values import is_stateful
    from gpumagic.dataparallel.rank.swaps import held_objects_swapped
    ns = {"__name__": "__main__"}
    exec(ATTRIBUTE_DICT, ns)
    assert used_names(ast.parse("model(X) * hp.scale"), ns)[:3] == ["model", "X", "hp"]
    assert "hp" not in used_names(ast.parse("model(X)"), ns)   # (a torch module's forward is not followed)
    assert not is_stateful(ns["hp"])
    with held_objects_swapped(ns, {}):
        pass


def test_a_forward_reading_an_attribute_dict_still_trains(shell):
    run_cell(shell, ATTRIBUTE_DICT)
    ns = shell.user_ns
    reference = trained_in_one_process(ns)
    dp_cell(shell, "--nprocs 2", """
        for x, y in loader:
            opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
        """)
    assert last_result().modules == ["model"]
    assert _same(ns["model"], reference)


def test_a_module_called_past_its_wrapper_is_refused_not_trained_apart(shell):
    # held in a tuple, the model is not swapped for the wrapper: its gradients would not be averaged,
    # and each rank would train its own copy on its half of the data
    run_cell(shell, SETUP + "class Many:\n    def __init__(self, models):\n        self.models = models\n"
                            "many = Many((model,))\n")
    ns = shell.user_ns
    before = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    for body in ("for x, y in loader:\n    opt.zero_grad(); ((many.models[0](x) - y) ** 2).mean().backward(); "
                 "opt.step()\n",
                 "for x, y in loader:\n    opt.zero_grad(); ((model.module(x) - y) ** 2).mean().backward(); "
                 "opt.step()\n"):
        with pytest.raises(WorkerError) as err:
            dp_cell(shell, "--nprocs 2 --model model", body)
        assert err.value.exc_type == "UnaveragedParameters"
        assert "model (the cell's DDP wrapper of the notebook's module) was never called" in err.value.message
        assert all(torch.equal(v, before[k]) for k, v in ns["model"].state_dict().items())
    # called through its name, the same loop trains
    dp_cell(shell, "--nprocs 2", "for x, y in loader:\n    opt.zero_grad(); ((model(x) - y) ** 2).mean()"
                                 ".backward(); opt.step()\n")
