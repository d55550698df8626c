"""%%sharedtrain and the notebook's other values: what a run leaves them as (real runs on the CPU)."""
from __future__ import annotations

import psutil
import pytest
import torch

from tests.conftest import run_cell

SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.randn(256, 8)
Y = (X[:, 0] > 0).long()
model = nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""


def _loader_workers(loader) -> list[int]:
    return [w.pid for w in loader._iterator._workers]


def test_the_notebooks_dataloader_workers_survive_a_forked_run(shell):
    """Forked workers dropped their copies of the notebook's iterators, and torch's shutdown of each copy
    stopped the kernel's own loader workers: the notebook's next pass failed ('_workers_done_event state
    does not match shutdown flag') after a 5 s wait."""
    run_cell(shell, SETUP + """
train_loader = DataLoader(TensorDataset(X, Y), batch_size=32, shuffle=True, num_workers=1,
                          persistent_workers=True)
first_pass = sum(len(x) for x, y in train_loader)
show_loader = DataLoader(TensorDataset(X, Y), batch_size=64, num_workers=1)
dataiter = iter(show_loader)              # as the tutorials do, to look at a batch
images, labels = next(dataiter)
""")
    ns = shell.user_ns
    persistent, shown = _loader_workers(ns["train_loader"]), [w.pid for w in ns["dataiter"]._workers]
    result, out, _ = run_cell(shell, """%%sharedtrain --nprocs 2 --start-method fork --seed 1
for x, y in train_loader:
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
dataiter = None   # the cell drops the notebook's iterator: its own copy, not the kernel's workers
""")
    assert result.error_in_exec is None, out
    assert [w.steps for w in ns["sharedtrain"].workers] == [4, 4]
    assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in persistent + shown)
    result, out, _ = run_cell(shell, "second_pass = sum(len(x) for x, y in train_loader)\n"
                                     "rest = [len(x) for x, y in dataiter]")
    assert result.error_in_exec is None, out
    assert ns["first_pass"] == ns["second_pass"] == 256
    assert ns["rest"] == [64, 64, 64]
    assert _loader_workers(ns["train_loader"]) == persistent


CHANGES = SETUP + """
import argparse
class Stats:
    def __init__(self):
        self.steps = 0
losses, history, stats = [], {"loss": []}, Stats()
best_loss = float("inf")
seen = torch.zeros(256)                     # which samples a worker saw
args = argparse.Namespace(lr=0.1, log_interval=2)
settings = {"clip": 1.0}
loader = DataLoader(TensorDataset(X, Y, torch.arange(256)), batch_size=32, shuffle=True)

def train_epoch():
    global best_loss
    for batch_idx, (x, y, idx) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings["clip"])
        optimizer.step()
        seen[idx] = 1
        if batch_idx % args.log_interval == 0:
            losses.append(loss.item())
            history["loss"].append(loss.item())
        stats.steps += 1
        best_loss = min(best_loss, loss.item())   # (a notebook function's global: rebound in the worker)
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_notebook_values_a_worker_changes_in_place_are_named(shell, method):
    """mnist_hogwild's habit of collecting losses in a notebook list: each worker appended to its own copy,
    and the notebook's list stayed empty without a word."""
    run_cell(shell, CHANGES)
    result, out, _ = run_cell(shell, f"%%sharedtrain --nprocs 2 --start-method {method} --seed 1\ntrain_epoch()\n")
    assert result.error_in_exec is None, out
    ns = shell.user_ns
    note = ("changed in the workers only, each in its own copy (the notebook's are as before the cell): "
            "best_loss, history, losses, seen, stats; report(name=value) sends values back (sharedtrain.history)")
    assert note in ns["sharedtrain"].notes and note in out
    assert [w.steps for w in ns["sharedtrain"].workers] == [4, 4]
    # as the note says: the notebook's values are untouched, and the ones only read are not named
    assert ns["losses"] == [] and ns["history"] == {"loss": []} and ns["stats"].steps == 0
    assert ns["best_loss"] == float("inf")
    assert float(ns["seen"].sum()) == 0.0
    assert "args" not in note and "settings" not in note


def test_a_cell_that_changes_nothing_in_place_gets_no_note(shell):
    run_cell(shell, CHANGES)
    result, out, _ = run_cell(shell, """%%sharedtrain --nprocs 2 --start-method fork --seed 1
for x, y, idx in loader:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y) * settings["clip"]
    loss.backward()
    optimizer.step()
    report(loss=loss, seen=int(seen[idx].sum()), every=args.log_interval, n=len(losses))
""")
    assert result.error_in_exec is None, out
    assert not any("changed in the workers only" in n for n in shell.user_ns["sharedtrain"].notes), out
    assert shell.user_ns["sharedtrain"].history.last("every") == [2, 2]


def test_fingerprints_see_changes_in_place_and_never_compare_values():
    import argparse

    import torch

    from gpumagic.sharedtrain.changes import changed_names, snapshot, watched_names

    class Weird:   # its == raises, as a tensor's truth value would
        def __eq__(self, other):
            raise RuntimeError("compared")

    shared = torch.zeros(3).share_memory_()
    ns = {"a": [1, Weird()], "d": {"k": [1]}, "t": torch.zeros(3), "s": shared, "n": argparse.Namespace(x=1),
          "same": [1, 2], "i": 3, "f": len, "best": None, "gone": 1.5}
    assert watched_names(ns, list(ns)) == ["a", "d", "t", "n", "same", "i", "best", "gone"]
    before = snapshot(ns, watched_names(ns, list(ns)))
    ns["a"].append(2)
    ns["d"]["k"].append(2)
    ns["t"][0] = 1.0
    shared[0] = 1.0
    ns["n"].x = 2
    ns["best"] = 0.5     # rebound, deleted by a notebook function's global
    del ns["gone"]
    assert changed_names(ns, before) == ["a", "d", "t", "n", "best", "gone"]
    big = list(range(200_000))
    before = snapshot({"big": big}, ["big"])
    big.append(1)
    assert changed_names({"big": big}, before) == ["big"]


def test_a_failed_run_says_the_model_keeps_the_updates_made_before_it(shell):
    """'the model is usable' alone left the user to guess whether the failed cell had changed the weights."""
    run_cell(shell, SETUP + "loader = DataLoader(TensorDataset(X, Y), batch_size=32)\n"
                            "before = model.weight.detach().clone()")
    result, out, _ = run_cell(shell, """%%sharedtrain --nprocs 2 --start-method fork --seed 1
for i, (x, y) in enumerate(loader):
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    if rank == 1 and i == 2:
        raise ValueError("bad batch")
""")
    ns = shell.user_ns
    assert type(result.error_in_exec).__name__ == "WorkerError" and result.error_in_exec.rank == 1
    stepped = ns["sharedtrain"].optimizer_steps
    assert stepped >= 3 and not torch.equal(ns["model"].weight.detach(), ns["before"])
    assert (f"stopped 2 workers after {ns['sharedtrain'].seconds:.1f} s (rank 1 failed); the model keeps the "
            f"updates of the {stepped} optimizer steps the workers took until then, and is usable") in out
    # batches alone changed no weight: nothing is claimed
    result, out, _ = run_cell(shell, """%%sharedtrain --nprocs 2 --start-method fork --seed 1
for i, (x, y) in enumerate(loader):
    model(x)
    if rank == 1 and i == 2:
        raise ValueError("bad batch")
""")
    assert ns["sharedtrain"].steps >= 3 and ns["sharedtrain"].optimizer_steps == 0
    assert "(rank 1 failed); the model is usable, and what the workers reported" in out


def test_a_cell_that_builds_its_own_model_is_refused_before_anything_starts(shell):
    """The article's whole example pasted into the cell: its model was each worker's own, and the summary
    said the run had 'trained 'loss_fn'' (the only notebook module the cell read, with no weights)."""
    run_cell(shell, SETUP + "loss_fn = nn.CrossEntropyLoss()\n"
                            "data_loader = DataLoader(TensorDataset(X, Y), batch_size=32)")
    before = shell.user_ns["model"]
    result, out, _ = run_cell(shell, """%%sharedtrain --nprocs 2
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for data, labels in data_loader:
    optimizer.zero_grad()
    loss_fn(model(data), labels).backward()
    optimizer.step()
""")
    assert type(result.error_in_exec).__name__ == "UsageError"
    assert str(result.error_in_exec) == (
        "the notebook modules the cell uses (loss_fn) have no weights, so nothing would be shared or trained; "
        "the cell binds model itself, so each worker would train a new one of its own, gone with it: build the "
        "model in an earlier cell and train that one (or name it with --model NAME); valid choices: model")
    assert "sharedtrain" not in shell.user_ns and shell.user_ns["model"] is before
    assert not before.weight.is_shared()   # refused before the notebook changed


def test_a_notebook_function_reading_a_loader_with_running_workers_reaches_spawned_workers(shell):
    """With persistent loader workers in the kernel (which also rule fork out: their queue's thread), a
    notebook train() that read the loader was refused: "'train' (function) cannot be sent to spawned workers
    (... '_MultiProcessingDataLoaderIter' cannot be pickled)"."""
    run_cell(shell, SETUP + """
train_loader = DataLoader(TensorDataset(X, Y), batch_size=32, shuffle=True, num_workers=1,
                          persistent_workers=True)
first_pass = sum(len(x) for x, y in train_loader)
def train():
    for x, y in train_loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
""")
    ns = shell.user_ns
    iterator, workers = ns["train_loader"]._iterator, _loader_workers(ns["train_loader"])
    result, out, _ = run_cell(shell, "%%sharedtrain --nprocs 2 --start-method spawn --seed 1\ntrain()\n")
    assert result.error_in_exec is None, out
    assert [w.steps for w in ns["sharedtrain"].workers] == [4, 4]   # split: 256 samples, 32 a batch, 2 workers
    assert ns["train_loader"]._iterator is iterator and _loader_workers(ns["train_loader"]) == workers
    result, out, _ = run_cell(shell, "second_pass = sum(len(x) for x, y in train_loader)")
    assert result.error_in_exec is None and ns["second_pass"] == 256, out


def test_models_kept_in_a_notebook_dict_are_shared_and_trained(shell):
    """nets = {"a": ..., "b": ...}: refused with 'the cell uses no torch.nn.Module from the notebook; ...;
    valid choices: (none)', and --model takes only a name, so there was no way to train them."""
    run_cell(shell, SETUP + """
nets = {"a": nn.Linear(8, 2), "b": nn.Linear(8, 2)}
opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in nets.items()}
loader = DataLoader(TensorDataset(X, Y), batch_size=32)
before = {k: m.weight.detach().clone() for k, m in nets.items()}
""")
    result, out, _ = run_cell(shell, """%%sharedtrain --nprocs 2 --start-method fork --seed 1
for x, y in loader:
    for k in nets:
        opts[k].zero_grad()
        F.cross_entropy(nets[k](x), y).backward()
        opts[k].step()
""")
    assert result.error_in_exec is None, out
    ns = shell.user_ns
    trained = ns["sharedtrain"]
    assert list(trained.modules) == ["nets['a']", "nets['b']"]
    assert all(trained.modules[f"nets[{k!r}]"] is ns["nets"][k] for k in "ab")
    assert [w.optimizer_steps for w in trained.workers] == [8, 8]   # 4 batches each, 2 optimizers
    for k in "ab":
        assert ns["nets"][k].weight.is_shared() and not torch.equal(ns["nets"][k].weight.detach(), ns["before"][k])
