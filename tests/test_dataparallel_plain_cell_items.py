"""%%dataparallel cells that change items and contents of notebook objects the cell does not name in an
assignment, as a plain cell changes them (CPU, gloo, 2 ranks): tensor and array attributes of a notebook
object changed in place by its methods, and items of notebook dicts and lists holding objects, set in
the cell or in a notebook function it calls."""
from __future__ import annotations

import torch

from tests.dataparallel_helpers import REGRESSION, dp_cell, last_result, notebook_from, trained_in_one_process

CPU2 = "--nprocs 2"

SETUP = REGRESSION


def _setup(shell, source):
    return notebook_from(shell, source)


TRAINER = SETUP + """
class Trainer:
    def __init__(self):
        self.preds = torch.zeros(4, 8, 1)
        self.buf = torch.zeros(3)
        self.steps = torch.tensor(0)
        self.arr = np.zeros(3)
        self.untouched = torch.arange(3.0)
        self.best = torch.zeros(1)
    def run(self):
        for i, (x, y) in enumerate(loader):
            opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
            self.buf.add_(1)
            self.steps += 1
            self.arr[i % 3] += 1
        with torch.no_grad():
            for i, (x, y) in enumerate(loader):
                self.preds[i] = model(x)
            self.best = model(X[:1]).squeeze(0)          # bound anew: rank 0's
trainer = Trainer()
"""


def test_tensor_and_array_attributes_a_method_changes_in_place_come_back_in_place(shell):
    """``self.preds[i] = model(x)`` and ``self.buf.add_(1)`` in a notebook class's method were lost: only
    plain attributes were compared."""
    ns = _setup(shell, TRAINER)
    reference = trained_in_one_process(ns)
    trainer = ns["trainer"]
    objects = {k: getattr(trainer, k) for k in ("preds", "buf", "steps", "arr", "untouched")}
    dp_cell(shell, CPU2, "trainer.run()\n")
    for k, v in objects.items():                     # the same objects, as after a plain cell
        assert getattr(trainer, k) is v, k
    with torch.no_grad():
        expected = reference(ns["X"]).reshape(4, 8, 1)
        best = reference(ns["X"][:1]).squeeze(0)
    assert torch.allclose(trainer.preds, expected, atol=1e-5, rtol=0)
    assert torch.equal(trainer.buf, torch.full((3,), 4.0)) and int(trainer.steps) == 4
    assert trainer.arr.tolist() == [2.0, 1.0, 1.0]
    assert torch.equal(trainer.untouched, torch.arange(3.0))
    assert torch.allclose(trainer.best, best, atol=1e-5, rtol=0)
    assert all(torch.allclose(p, q, atol=1e-5, rtol=0)
               for p, q in zip(ns["model"].state_dict().values(), reference.state_dict().values()))
    values = last_result().values
    assert {"trainer.preds", "trainer.buf", "trainer.arr", "trainer.best"} <= set(values)
    assert "trainer.untouched" not in values


CONTAINERS = SETUP + """
held = {"n": 1, "model": model, "buf": torch.zeros(2), "old": 0}
runs = [model, 1]
bag = {"model": model}
def after_step(loss):
    held["n"] += 1
    held["buf"].add_(1)
    runs.append(round(loss.item(), 3))
"""


def test_items_set_in_a_notebook_function_come_back_as_when_set_in_the_cell(shell):
    """``def f(): held["n"] = 2`` on a dict holding objects was lost without a word (the same line in the
    cell was named in the note); ``runs.append(...)`` on a list holding objects was lost either way."""
    ns = _setup(shell, CONTAINERS)
    held, runs, buf, model = ns["held"], ns["runs"], ns["held"]["buf"], ns["model"]
    dp_cell(shell, CPU2, """
        for x, y in loader:
            opt.zero_grad(); loss = ((model(x) - y) ** 2).mean(); loss.backward(); opt.step()
            after_step(loss)
        held["direct"] = [1, 2]
        del held["old"]
        bag["made"] = __import__("threading").Lock()   # (cannot be pickled; a model made in the cell comes
                                                        # back whole: containers_hostile; a picklable object too)
        """)
    assert ns["held"] is held and ns["runs"] is runs                # the same objects, changed in place
    assert held["model"] is model and runs[0] is model             # holding the notebook's own model
    assert held["n"] == 5 and held["direct"] == [1, 2] and "old" not in held
    assert held["buf"] is buf and torch.equal(buf, torch.full((2,), 4.0))
    assert len(runs) == 6 and runs[1] == 1 and all(isinstance(v, float) for v in runs[2:])
    # an object made in the cell that cannot be pickled cannot come back: the note says so, and the dict is as it was
    assert list(ns["bag"]) == ["model"]
    # one note for it (the item written in the cell was named a second time, as an item set "of bag")
    notes = [n for n in last_result().not_returned if "bag" in n]
    assert len(notes) == 1 and notes[0].startswith("bag (the cell changed its items, and 'made' now holds")
    assert "bag is left as it was" in notes[0]
    assert not any(n.startswith("held") for n in last_result().not_returned)
    assert {"held", "runs"} <= set(last_result().values)
