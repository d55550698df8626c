"""Training-notebook containers after a ``%%dataparallel`` cell (hand-written loop, CPU, gloo, 2 ranks), against
what a plain cell leaves: metric histories, per-epoch checkpoints, copies of the best model, lists of tuples, names
bound to lists held in the notebook's dicts, lists too long to compare item by item, and the note a real kernel
shows."""
from __future__ import annotations

import collections
import copy

import pytest
import torch

from tests.dataparallel_helpers import REGRESSION, dp_cell, last_result, notebook_from

CPU2 = "--nprocs 2"

# Two epochs of the REGRESSION notebook's training, then ``per_epoch`` after each (``val()``: the loss on all of
# X, which every rank computes alike, so rank 0's equals a plain cell's).
VAL = "def val():\n    with torch.no_grad():\n        return ((model(X) - Y) ** 2).mean()\n"


def _epochs(per_epoch: str, epochs: int = 2) -> str:
    return (f"for epoch in range({epochs}):\n"
            "    for x, y in loader:\n"
            "        opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()\n"
            + "".join(f"    {line}\n" for line in per_epoch.splitlines()))


def _reference(ns: dict, epochs: int = 2) -> tuple[list, list]:
    """``(val losses, state_dicts)`` after each epoch, trained in this process from the notebook's model."""
    ref = copy.deepcopy(ns["model"])
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    vals, states = [], []
    for _ in range(epochs):
        for x, y in ns["loader"]:
            opt.zero_grad()
            ((ref(x) - y) ** 2).mean().backward()
            opt.step()
        with torch.no_grad():
            vals.append(((ref(ns["X"]) - ns["Y"]) ** 2).mean())
        states.append(copy.deepcopy(ref.state_dict()))
    return vals, states


def _quiet(cap) -> None:
    assert last_result().not_returned == [], last_result().not_returned
    assert "not brought back" not in cap.stderr, cap.stderr


def test_lists_inside_a_notebook_dict_of_metrics_stay_the_ones_other_names_hold(shell):
    """``logs = {"train": {"loss": []}}`` with ``train_loss = logs["train"]["loss"]``: the cell's appends came back
    into new lists, so ``train_loss`` stayed empty; a defaultdict history the same, cell after cell. A list the cell
    replaces (``logs["val"]["loss"] = [...]``) is a new one, as in a plain cell: the old name keeps the old list."""
    ns = notebook_from(shell, REGRESSION + VAL + "from collections import defaultdict\n"
                                                 "logs = {'train': {'loss': [], 'n': 0}, 'val': {'loss': [9.0]}}\n"
                                                 "train_loss, val_loss, train = logs['train']['loss'], "
                                                 "logs['val']['loss'], logs['train']\n"
                                                 "history = defaultdict(list, val=[])\nhv = history['val']\n")
    logs, train_loss, val_loss, train, history, hv = (ns[n] for n in ("logs", "train_loss", "val_loss", "train",
                                                                      "history", "hv"))
    vals, _ = _reference(ns, 4)
    _, cap = dp_cell(shell, CPU2, _epochs("logs['train']['loss'].append(val().item()); logs['train']['n'] += 1\n"
                                          "history['val'].append(val().item())") + "logs['val']['loss'] = [0.5]\n")
    _quiet(cap)
    assert ns["logs"] is logs and logs["train"] is train and train["loss"] is train_loss and train["n"] == 2
    assert train_loss == pytest.approx([v.item() for v in vals[:2]], abs=1e-6) and hv == train_loss
    assert logs["val"]["loss"] == [0.5] and val_loss == [9.0] and logs["val"]["loss"] is not val_loss
    assert type(history) is collections.defaultdict and history["val"] is hv

    _, cap = dp_cell(shell, CPU2, _epochs("history['val'].append(val().item())"))   # a second cell goes on
    _quiet(cap)
    assert history["val"] is hv and hv == pytest.approx([v.item() for v in vals], abs=1e-6)


def test_a_defaultdict_or_ordereddict_the_cell_makes_stays_one(shell):
    """``history = defaultdict(list)`` in the cell came back as a plain dict (the next cell's
    ``history["new"].append`` raised KeyError), an ``OrderedDict`` as a dict, and so did those the cell put in a
    notebook dict."""
    ns = notebook_from(shell, REGRESSION + VAL + "import collections\nrun = {'model': model}\n")
    vals, _ = _reference(ns)
    _, cap = dp_cell(shell, CPU2, "history = collections.defaultdict(list)\norder = collections.OrderedDict(b=1, a=2)\n"
                                  "run['hist'] = collections.defaultdict(list)\n"
                                  + _epochs("history['val'].append(val().item()); run['hist']['val'].append(val())"))
    _quiet(cap)
    history, order, hist = ns["history"], ns["order"], ns["run"]["hist"]
    assert type(history) is collections.defaultdict and history.default_factory is list
    assert history["val"] == pytest.approx([v.item() for v in vals], abs=1e-6)
    assert type(order) is collections.OrderedDict and list(order) == ["b", "a"]
    assert type(hist) is collections.defaultdict and hist.default_factory is list and ns["run"]["model"] is ns["model"]
    torch.testing.assert_close(torch.stack(hist["val"]), torch.stack(vals), atol=1e-6, rtol=0)
    history["new"].append(1)
    hist["new"].append(2)


def test_checkpoints_of_state_dicts_per_epoch_come_back(shell):
    """``checkpoints[epoch] = copy.deepcopy(model.state_dict())``: named as holding "objects that are not plain
    values, tensors or arrays" (a state_dict is an OrderedDict of tensors) and left empty; in a dict holding the
    model too, "an object made in the cell"."""
    ns = notebook_from(shell, REGRESSION + "import copy\ncheckpoints = {}\nsaved = {'model': model}\n")
    checkpoints, saved = ns["checkpoints"], ns["saved"]
    _, states = _reference(ns)
    _, cap = dp_cell(shell, CPU2, _epochs("checkpoints[epoch] = copy.deepcopy(model.state_dict())\n"
                                          "saved[f'epoch{epoch}'] = copy.deepcopy(model.state_dict())"))
    _quiet(cap)
    assert ns["checkpoints"] is checkpoints and list(checkpoints) == [0, 1]
    assert ns["saved"] is saved and list(saved) == ["model", "epoch0", "epoch1"] and saved["model"] is ns["model"]
    for got in ([checkpoints[0], checkpoints[1]], [saved["epoch0"], saved["epoch1"]]):
        for sd, want in zip(got, states):
            assert type(sd) is collections.OrderedDict and list(sd) == list(want)
            for k in want:
                torch.testing.assert_close(sd[k], want[k], atol=1e-6, rtol=0)
    ns["model"].load_state_dict(checkpoints[0])   # as a notebook rolls back to the best epoch


def test_a_list_of_tuples_holding_tensors_comes_back(shell):
    """``preds.append((epoch, out))``: the list was named as holding "objects that are not plain values,
    tensors or arrays" and left empty."""
    ns = notebook_from(shell, REGRESSION + VAL + "preds = []\n")
    preds = ns["preds"]
    vals, _ = _reference(ns)
    _, cap = dp_cell(shell, CPU2, _epochs("preds.append((epoch, val().detach().reshape(1), {'v': val().item()}))"))
    _quiet(cap)
    assert ns["preds"] is preds and [(e, type(t)) for e, _, t in preds] == [(0, dict), (1, dict)]
    for (_, got, extra), want in zip(preds, vals):
        assert type(got) is torch.Tensor and torch.allclose(got, want.reshape(1), atol=1e-6)
        assert extra == {"v": pytest.approx(want.item(), abs=1e-6)}


def test_a_name_the_cell_binds_to_a_list_a_notebook_dict_holds_is_that_list(shell):
    """``hv = history["val"]`` in the cell (or ``tv = tracker.history["val"]``), then appends through either name:
    in a plain cell they are one list; ``hv`` came back as a copy, and a later append through it missed
    ``history``."""
    ns = notebook_from(shell, REGRESSION + VAL + "history = {'val': [], 'model': model}\nplain = {'val': []}\n"
                                                 "class Tracker:\n    def __init__(self):\n"
                                                 "        self.history = {'val': []}\ntracker = Tracker()\n")
    history, plain, tracked = ns["history"], ns["plain"], ns["tracker"].history
    _, cap = dp_cell(shell, CPU2, "hv = history['val']\npv = plain['val']\ntv = tracker.history['val']\n"
                                  + _epochs("hv.append(val().item()); pv.append(1); tv.append(2)"))
    _quiet(cap)
    assert ns["hv"] is history["val"] and ns["pv"] is plain["val"] and plain["val"] == [1, 1]
    assert ns["tracker"].history is tracked and ns["tv"] is tracked["val"] and tracked["val"] == [2, 2]
    assert len(history["val"]) == 2


def test_rank0_watches_what_the_cell_reads_but_not_what_it_trains(shell):
    """The kernel's side: rank 0 watches every notebook name the cell reads (lists and dicts of any size, holding
    anything), and not the model, optimizer and loader it trains (those come back as trained state)."""
    import ast

    from gpumagic.dataparallel.kernel.notebook import Notebook
    from gpumagic.dataparallel.kernel.survey import survey_cell
    notebook_from(shell, REGRESSION + "logs = {'train': {'loss': []}}\nflat = [0.5] * 20\n"
                                      "mixed = [model] + [0.0] * 12_000\n")
    cell = ("for x, y in loader:\n    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()\n"
            "logs['train']['loss'].append(1.0); flat.append(1.0); mixed.append(1.0)\n")
    survey = survey_cell(ast.parse(cell), Notebook.of(shell))
    assert sorted(survey.roots) == ["flat", "logs", "mixed"]
    assert (list(survey.modules), list(survey.optimizers), list(survey.loaders)) == (["model"], ["opt"], ["loader"])


def test_a_copy_of_the_model_kept_in_a_notebook_dict_or_list_comes_back(shell):
    """``best["model"] = copy.deepcopy(model)`` when the loss improves, and ``snapshots.append(copy.deepcopy(
    model))``: named as holding "objects that are not plain values", and ``best`` left as it was, its score
    too. A model the cell made comes back whole, as one it binds to a name does (``best_model =
    copy.deepcopy(model)``)."""
    ns = notebook_from(shell, REGRESSION + VAL + "import copy\nbest = {'model': None, 'score': float('inf')}\n"
                                                 "snapshots = [model]\n")
    best, snapshots, model = ns["best"], ns["snapshots"], ns["model"]
    vals, states = _reference(ns)
    _, cap = dp_cell(shell, CPU2, _epochs("v = val().item()\nif v < best['score']:\n"
                                          "    best['score'], best['model'] = v, copy.deepcopy(model)\n"
                                          "snapshots.append(copy.deepcopy(model))"))
    _quiet(cap)
    assert ns["best"] is best and best["score"] == pytest.approx(vals[1].item(), abs=1e-6)
    assert ns["snapshots"] is snapshots and len(snapshots) == 3 and snapshots[0] is model
    for got, want in [(best["model"], states[1]), (snapshots[1], states[0]), (snapshots[2], states[1])]:
        assert type(got) is torch.nn.Sequential and got is not model
        for k, t in got.state_dict().items():
            torch.testing.assert_close(t, want[k], atol=1e-6, rtol=0)
    assert best["model"] is not snapshots[2]
    snapshots[1][0].weight.data.zero_()                       # its own tensors: the notebook's model is untouched
    assert model[0].weight.abs().sum() > 0


def test_an_early_stopping_object_keeps_its_copy_of_the_best_model(shell):
    """An early-stopping helper of the notebook's (``self.best_model = copy.deepcopy(model)``, ``self.best_state =
    copy.deepcopy(model.state_dict())``): the model was named "not a plain value" and left None, the state
    dict came back as a plain dict."""
    ns = notebook_from(shell, REGRESSION + VAL + "import copy\nclass EarlyStopping:\n    def __init__(self):\n"
                                                 "        self.best, self.best_state, self.best_model = float('inf'), "
                                                 "None, None\n    def __call__(self, v, model):\n"
                                                 "        if v < self.best:\n            self.best = v\n"
                                                 "            self.best_state = copy.deepcopy(model.state_dict())\n"
                                                 "            self.best_model = copy.deepcopy(model)\n"
                                                 "stopper = EarlyStopping()\n")
    stopper = ns["stopper"]
    vals, states = _reference(ns)
    _, cap = dp_cell(shell, CPU2, _epochs("stopper(val().item(), model)"))
    _quiet(cap)
    assert stopper.best == pytest.approx(vals[1].item(), abs=1e-6)
    assert type(stopper.best_state) is collections.OrderedDict and type(stopper.best_model) is torch.nn.Sequential
    assert stopper.best_model is not ns["model"]
    for k, want in states[1].items():
        torch.testing.assert_close(stopper.best_state[k], want, atol=1e-6, rtol=0)
        torch.testing.assert_close(stopper.best_model.state_dict()[k], want, atol=1e-6, rtol=0)


def test_a_training_notebook_in_a_kernel_says_only_what_did_not_come_back():
    """Through a real Jupyter kernel (nbclient), as a user runs it: checkpoints, a metrics dict another name
    holds into, a best-model copy, and one object of the cell's own kind that cannot come back; the cell's
    note names that one alone."""
    from tests.notebook_helpers import run_notebook, stream_text
    train = _epochs("checkpoints[epoch] = copy.deepcopy(model.state_dict())\n"
                    "logs['train']['loss'].append(val().item())\n"
                    "if val().item() < best['score']:\n"
                    "    best['score'], best['model'] = val().item(), copy.deepcopy(model)")
    cells = ["%load_ext gpumagic", REGRESSION + VAL + "import copy\ncheckpoints = {}\n"
             "logs = {'train': {'loss': []}}\ntrain_loss = logs['train']['loss']\n"
             "best = {'score': float('inf'), 'model': None}\nbag = {}\n",
             "%%dataparallel --nprocs 2\n" + train + "bag['lock'] = __import__('threading').Lock()\n",
             "print(list(checkpoints), len(train_loss), train_loss is logs['train']['loss'],"
             " type(best['model']).__name__, bag)", "%dataparallel stop"]
    nb = run_notebook(cells, timeout=300)
    err = stream_text(nb.cells[2], "stderr")
    notes = [line for line in err.splitlines() if "not brought back" in line]
    assert len(notes) == 1 and "bag (" in notes[0] and "checkpoints" not in notes[0], err
    assert "logs" not in notes[0] and "best" not in notes[0], err
    out = stream_text(nb.cells[3])
    assert out.strip() == "[0, 1] 2 True Sequential {}", out
