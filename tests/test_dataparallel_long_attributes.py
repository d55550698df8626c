"""Long histories held by notebook objects after a ``%%dataparallel`` cell (hand-written loop, CPU, gloo, 2 ranks):
``self.losses.append(loss.item())`` in a notebook class's ``train()``, on a list that already holds more than
10,000 floats, and the same on a dict, come back into the notebook's own list or dict as after a plain cell;
what rank 0 sends is the change, not the history; a history too long to compare is named in the note."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.dataparallel_helpers import dp_cell, last_result, notebook_from

CPU2 = "--nprocs 2"

# Each batch of 8 is 4 samples twice: each rank's half of it holds the batch's samples, so rank 0's
# ``loss.item()`` is the loss one process computes on the whole batch.
NOTEBOOK = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
halves = torch.randn(4, 4, 4)
X = torch.cat([torch.cat([h, h]) for h in halves]); Y = X.sum(1, keepdim=True)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)

class Trainer:
    def __init__(self, n):
        self.losses = [float(i) for i in range(n)]
        self.history = {i: float(i) for i in range(n)}
        self.step = n - 1
    def train(self):
        for x, y in loader:
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            self.step += 1
            self.losses.append(loss.item())
            self.history[self.step] = loss.item()

trainer = Trainer(12_000)
"""


def _losses(ns: dict, epochs: int) -> list[float]:
    """Each step's ``loss.item()``, trained in this process from the notebook's model, as a plain cell's."""
    ref = copy.deepcopy(ns["model"])
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out = []
    for _ in range(epochs):
        for x, y in ns["loader"]:
            opt.zero_grad()
            loss = ((ref(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            out.append(loss.item())
    return out


def _quiet(cap) -> None:
    assert last_result().not_returned == [], last_result().not_returned
    assert "not brought back" not in cap.stderr, cap.stderr


def test_a_trainers_long_loss_list_gets_the_cells_losses_in_place(shell):
    """``trainer.train()`` appending ``loss.item()`` to ``self.losses``, which held 12,000 floats: the appends were
    lost without a note (a list that long was not compared); a second cell that goes on training, and sets and
    deletes items, leaves what a plain cell leaves, in the same list."""
    ns = notebook_from(shell, NOTEBOOK)
    trainer = ns["trainer"]
    losses = trainer.losses
    first = losses[0]
    want = _losses(ns, 2)
    _, cap = dp_cell(shell, CPU2, "trainer.train()\n")
    _quiet(cap)
    assert ns["trainer"] is trainer and trainer.losses is losses
    assert len(losses) == 12_004 and losses[0] is first and losses[11_999] == 11_999.0
    assert losses[-4:] == pytest.approx(want[:4], abs=1e-6)

    _, cap = dp_cell(shell, CPU2, "trainer.train()\ntrainer.losses[0] = -1.0\ndel trainer.losses[1]\n")
    _quiet(cap)
    assert trainer.losses is losses and len(losses) == 12_007
    assert losses[:3] == [-1.0, 2.0, 3.0] and losses[11_998] == 11_999.0
    assert losses[-8:] == pytest.approx(want, abs=1e-6)


def test_a_trainers_long_loss_dict_gets_the_cells_losses_in_place(shell):
    """``self.history[step] = loss.item()`` on a dict of 12,000 floats: lost without a note as the list was; a
    second cell's item sets, deletes and a moved key land in the same dict, in a plain cell's key order."""
    ns = notebook_from(shell, NOTEBOOK)
    trainer = ns["trainer"]
    history = trainer.history
    want = _losses(ns, 2)
    _, cap = dp_cell(shell, CPU2, "trainer.train()\n")
    _quiet(cap)
    assert trainer.history is history and len(history) == 12_004 and trainer.step == 12_003
    assert list(history)[-5:] == [11_999, 12_000, 12_001, 12_002, 12_003]
    assert [history[k] for k in range(12_000, 12_004)] == pytest.approx(want[:4], abs=1e-6)

    _, cap = dp_cell(shell, CPU2, "trainer.train()\ndel trainer.history[0]\ntrainer.history[5] = -1.0\n"
                                  "trainer.history[7] = trainer.history.pop(7)\n")
    _quiet(cap)
    assert trainer.history is history and len(history) == 12_007 and 0 not in history and history[5] == -1.0
    assert list(history)[:4] == [1, 2, 3, 4] and list(history)[-2:] == [12_007, 7]
    assert [history[k] for k in range(12_000, 12_008)] == pytest.approx(want, abs=1e-6)


def test_a_history_longer_than_a_million_items_is_named_in_the_note(shell):
    """Past the million items rank 0 compares, the cell's appends do not come back: the note names the list,
    which stays as it was; a cell that only reads it says nothing."""
    notebook_from(shell, NOTEBOOK + "big = Trainer(1)\nbig.losses = [0.0] * 1_000_001\n")
    big = shell.user_ns["big"]
    _, cap = dp_cell(shell, CPU2, "n = len(big.losses)\n")
    _quiet(cap)
    _, cap = dp_cell(shell, CPU2, "big.train()\n")
    assert any(n.startswith("big.losses (") and "1,000,000" in n for n in last_result().not_returned), \
        last_result().not_returned
    assert "big.losses (" in cap.stderr and len(big.losses) == 1_000_001


def test_in_a_kernel_the_note_names_only_the_history_past_the_bound():
    """Through a real Jupyter kernel (nbclient), as a user runs it: the trainer's 12,000-loss list and dict take
    the cell's losses in place, and the cell's note names the one list past a million items, alone."""
    from tests.notebook_helpers import run_notebook, stream_text
    cells = ["%load_ext gpumagic", NOTEBOOK + "big = Trainer(1)\nbig.losses = [0.0] * 1_000_001\n"
             "ids = id(trainer.losses), id(trainer.history)\n",   # (not names: those would come back as values)
             "%%dataparallel --nprocs 2\ntrainer.train()\nbig.train()\n",
             "print(len(trainer.losses), id(trainer.losses) == ids[0], len(trainer.history), "
             "id(trainer.history) == ids[1], len(big.losses), len(big.history))", "%dataparallel stop"]
    nb = run_notebook(cells, timeout=300)
    err = stream_text(nb.cells[2], "stderr")
    notes = [line for line in err.splitlines() if "not brought back" in line]
    assert len(notes) == 1 and "big.losses (a list of 1,000,001 items" in notes[0], err
    assert "trainer." not in notes[0] and "big.history" not in notes[0], err
    assert stream_text(nb.cells[3]).split() == ["12004", "True", "12004", "True", "1000001", "5"]
