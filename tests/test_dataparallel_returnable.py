"""Objects a %%dataparallel cell binds, and attributes it sets on the notebook's objects, come back (CPU, 2 ranks).

As after a plain cell: a numpy array, a dataclass, a tensor the cell computed
are in the notebook (tensors on the CPU, detached); an attribute the cell sets
on a notebook object (``args.epochs = 3``) and what a notebook class's method
appends (a callback collecting losses) are there too. What belongs to the
ranks (a wrapper holding modules, a framework trainer) is named with the reason.
"""
from __future__ import annotations

import ast

import numpy as np
import pytest
import torch
from tqdm.auto import tqdm

from gpumagic.cell.names import attributes_assigned
from gpumagic.procs.returning import NotReturnable, pickled_for_notebook
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell

CPU2 = "--nprocs 2"

SETUP = """
import argparse, dataclasses
import numpy as np
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(64, 8)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8)
args = argparse.Namespace(epochs=1, lr=0.1)

class LossLog:
    def __init__(self):
        self.losses = []
        self.best = None
    def record(self, loss):
        self.losses.append(float(loss))
        self.best = min(self.losses)

log = LossLog()
"""

LOOP = """
args.epochs = 2
for epoch in range(args.epochs):
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        log.record(loss)
"""


def test_objects_the_cell_binds_come_back_on_the_cpu(shell):
    run_cell(shell, SETUP)
    _, cap = dp_cell(shell, CPU2, LOOP + """
@dataclasses.dataclass
class Summary:
    final: float
    steps: int

with torch.no_grad():
    preds = model(X)                       # a tensor, rank 0's
predictions = preds.numpy()                # a numpy array
summary = Summary(float(loss), 16)         # an instance of a class the cell defines
config = argparse.Namespace(width=8)
holder = {"net": model, "opt": opt}       # holds the notebook's model and optimizer: those, trained
made = {"net": torch.nn.Linear(2, 2)}      # holds a module made in the cell: it comes back whole
kept = {"net": made["net"], "step": opt}   # holds it too: the same module
made_opt = {"opt": torch.optim.SGD(made["net"].parameters(), lr=0.1)}   # an optimizer made in the ranks: stays
""")
    ns = shell.user_ns
    assert isinstance(ns["preds"], torch.Tensor) and ns["preds"].device.type == "cpu"
    assert not ns["preds"].requires_grad and ns["preds"].shape == (64, 1)
    # rank 0's predictions, from the trained weights now in the notebook's model
    torch.testing.assert_close(ns["preds"], ns["model"](ns["X"]).detach())
    assert isinstance(ns["predictions"], np.ndarray) and np.allclose(ns["predictions"], ns["preds"].numpy())
    assert isinstance(ns["summary"], ns["Summary"]) and ns["summary"].steps == 16   # the notebook's class
    assert ns["config"].width == 8
    assert ns["holder"]["net"] is ns["model"] and ns["holder"]["opt"] is ns["opt"]   # as after a plain cell
    made = ns["made"]["net"]
    assert type(made) is torch.nn.Linear and made.weight.device.type == "cpu" and ns["kept"]["net"] is made
    assert ns["kept"]["step"] is ns["opt"] and "made_opt" not in ns
    note = cap.stderr.split("not brought back")[1].splitlines()[0]
    assert "made_opt (holds an optimizer (SGD), which stays in the ranks)" in note, note
    assert "holder" not in note and "made (" not in note


def test_objects_the_cell_binds_hold_the_notebooks_objects_and_classes(shell):
    run_cell(shell, SETUP)
    ns = shell.user_ns
    model, X = ns["model"], ns["X"]
    _, cap = dp_cell(shell, CPU2, """
import collections
Out = collections.namedtuple("Out", "loss step")

@dataclasses.dataclass
class Stat:
    loss: float
    step: int

history, stats = [], []
for step, (x, y) in enumerate(loader):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    history.append(Out(loss.detach(), step))
    stats.append(Stat(float(loss), step))
best = {"model": model, "data": X, "copy": model, "log": LossLog()}
runs = [(model, 1), (model, 2)]
""")
    assert "not brought back" not in cap.stderr, cap.stderr
    # the notebook's classes, defined again in the kernel, and instances of them, not of copies
    Out, Stat = ns["Out"], ns["Stat"]
    assert [type(o) for o in ns["history"]] == [Out] * 8 and [o.step for o in ns["history"]] == list(range(8))
    assert all(type(s) is Stat for s in ns["stats"]) and ns["stats"][-1].step == 7
    assert ns["history"][-1].loss.item() == pytest.approx(ns["stats"][-1].loss)
    # the notebook's model (trained in place), tensor and class, once each
    assert ns["best"]["model"] is model and ns["best"]["copy"] is model and ns["best"]["data"] is X
    assert type(ns["best"]["log"]) is ns["LossLog"]
    assert [r[0] is model for r in ns["runs"]] == [True, True]
    # a later cell appends to the notebook's list with the notebook's Out (a name IPython's shell also uses)
    # and to a notebook list with instances of the notebook's Stat, holding its model
    run_cell(shell, "records = []")
    history, records = ns["history"], ns["records"]
    _, cap = dp_cell(shell, CPU2, """
for x, y in loader:
    history.append(Out(float(torch.nn.functional.mse_loss(model(x), y)), len(history)))
    records.append(Stat(model, len(records)))
""")
    assert ns["history"] is history and len(history) == 16 and all(type(o) is Out for o in history)
    assert [o.step for o in history[8:]] == list(range(8, 16))
    assert ns["records"] is records and [type(r) for r in records] == [Stat] * 8
    assert [r.step for r in records] == list(range(8)) and all(r.loss is model for r in records)


def test_a_model_the_cell_made_is_one_object_wherever_the_cell_put_it(shell):
    # ``results = {"model": best_model}`` stayed in the ranks ("holds a torch.nn.Module"), a notebook dict
    # given it held a second copy, and a notebook object's attribute set to it (or to the notebook's model)
    # did not come back
    run_cell(shell, SETUP + "import copy, threading\nboard = {'best': None}\n")
    ns = shell.user_ns
    board = ns["board"]
    _, cap = dp_cell(shell, CPU2, LOOP + """
best_model = copy.deepcopy(model)
results = {"model": best_model, "loss": float(loss)}
board["best"] = best_model
log.best_model, log.net, log.opt = best_model, model, opt   # (on a notebook object: "not a plain value")
odd = copy.deepcopy(model)
odd.lock = threading.Lock()                # a model that cannot travel, and what holds it
odd_holder = [odd]
""")
    assert "best_model" in ns, cap.stderr
    best = ns["best_model"]
    assert ns["results"]["model"] is best and ns["board"] is board and board["best"] is best
    assert best is not ns["model"] and torch.equal(best.weight, ns["model"].weight)   # (rank 0's, trained)
    log = ns["log"]
    assert log.best_model is best and log.net is ns["model"] and log.opt is ns["opt"]
    note = cap.stderr.split("not brought back")[1].splitlines()[0]
    assert "odd (TypeError" in note and "odd_holder (" in note, note
    assert "odd" not in ns and "odd_holder" not in ns


def test_attributes_the_cell_sets_and_a_notebook_classs_changes_come_back(shell):
    run_cell(shell, SETUP)
    ns = shell.user_ns
    log, args = ns["log"], ns["args"]
    losses = log.losses
    _, cap = dp_cell(shell, CPU2, LOOP + "rank0_losses = list(log.losses)\n")
    assert ns["log"] is log and ns["args"] is args          # the notebook's own objects, changed in place
    assert args.epochs == 2                                  # set by the cell
    assert log.losses is losses and log.losses == ns["rank0_losses"] and len(losses) == 16   # 2 epochs x 8 steps
    assert log.best == min(losses)
    assert "log.losses" in cap.stderr and "args.epochs" in cap.stderr


def test_names_bound_to_notebook_objects_and_namespaces_changed_by_functions(shell):
    run_cell(shell, SETUP + """
def set_epochs(a, n):
    a.epochs = n                     # a notebook function changes the namespace the cell passes it
""")
    ns = shell.user_ns
    args, log = ns["args"], ns["log"]
    _, cap = dp_cell(shell, CPU2, LOOP + """
alias = args                         # the notebook's own object, not a copy
same_log = log
set_epochs(args, 7)
setattr(args, "lr", 0.5)
args.note = argparse.Namespace(log=log)   # added, an object made in the cell: rank 0's, holding the notebook's log
args.lock = __import__("threading").Lock()   # one that cannot be pickled: named
weight = torch.nn.Parameter(torch.ones(2))
""")
    assert ns["alias"] is args and ns["same_log"] is log
    assert (args.epochs, args.lr) == (7, 0.5)
    assert args.note.log is log and "args.note" in cap.stderr.split("values:")[1]
    assert not hasattr(args, "lock") and "args.lock (cannot be pickled, or holds what stays in the ranks)" in \
        cap.stderr
    assert type(ns["weight"]) is torch.nn.Parameter and ns["weight"].tolist() == [1.0, 1.0]


def test_attributes_set_deeper_in_the_notebooks_namespaces_and_a_del_come_back(shell):
    run_cell(shell, SETUP + """
import types
cfg = argparse.Namespace(optim=types.SimpleNamespace(lr=0.1, steps=0), name="run")
log.meta = types.SimpleNamespace(epoch=0)
tmp = 1
def bump(c):
    c.optim.steps += 1            # a notebook function changes a namespace the cell's one holds
""")
    ns = shell.user_ns
    optim, meta = ns["cfg"].optim, ns["log"].meta
    _, cap = dp_cell(shell, CPU2, LOOP + """
cfg.optim.lr = 0.05
bump(cfg)
log.meta.epoch = 2
del tmp
""")
    assert ns["cfg"].optim is optim and ns["log"].meta is meta        # the notebook's own objects, changed
    assert (optim.lr, optim.steps, meta.epoch) == (0.05, 1, 2)
    assert "tmp" not in ns                                               # as after a plain cell
    assert "cfg.optim.lr" in cap.stderr and "log.meta.epoch" in cap.stderr


def test_a_del_that_does_not_run_leaves_the_name(shell):
    run_cell(shell, SETUP + "keep = [1]\n")
    keep = shell.user_ns["keep"]
    dp_cell(shell, CPU2, LOOP + "if args.epochs > 5:\n    del keep\n")
    assert shell.user_ns["keep"] is keep


def test_attributes_the_cell_deletes_are_deleted_in_the_notebook(shell):
    """``del cfg.name`` (a namespace), ``del log.best`` (a notebook class's instance) and ``del
    holder.cache`` (any object): the notebook's objects kept them, unlike after a plain cell."""
    run_cell(shell, SETUP + """
import types
cfg = types.SimpleNamespace(name="run", optim=types.SimpleNamespace(lr=0.1, warmup=5))
import string
holder = string.Template("$x")                          # not a namespace, nor the notebook's class
holder.cache = [1]
log.best = 0.5
""")
    dp_cell(shell, CPU2, LOOP + """
del cfg.name, cfg.optim.warmup
del holder.cache
if args.epochs > 5:
    del cfg.optim.lr                                  # (does not run)
log.best = None
del log.best
""")
    ns = shell.user_ns
    assert not hasattr(ns["cfg"], "name") and vars(ns["cfg"].optim) == {"lr": 0.1}
    assert not hasattr(ns["holder"], "cache") and not hasattr(ns["log"], "best")


def test_attributes_a_cell_deletes_are_named_with_the_object_they_leave():
    tree = ast.parse("del cfg.name, a.b.c\ndel d[k].x\nargs.lr = 1\n")
    assert attributes_assigned(tree) == {"cfg": ["name"], "a.b": ["c"], "args": ["lr"]}


# --- the pieces, in one process ---------------------------------------------------------------------

def test_pickled_for_notebook_detaches_copies_and_refuses_what_stays_in_the_ranks():
    import pickle
    t = torch.ones(4, requires_grad=True) * 2
    back = pickle.loads(pickled_for_notebook({"t": t, "view": t[:2]}))
    assert not back["t"].requires_grad and back["t"].tolist() == [2.0] * 4
    for value, why in [({"m": torch.nn.Linear(2, 2)}, "holds a torch.nn.Module (Linear)"),
                       ([torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)], "holds an optimizer (SGD)"),
                       (torch.utils.data.DataLoader([1, 2]), "holds a DataLoader"),
                       ({"acc": _accelerator_like()}, "holds an Accelerator, which stays in the ranks"),
                       (tqdm(range(3), disable=True), "holds a tqdm progress bar, which stays in the ranks"),
                       ((x for x in [1]), "TypeError: cannot pickle")]:
        with pytest.raises(NotReturnable, match=__import__("re").escape(why)):
            pickled_for_notebook(value)
    with pytest.raises(NotReturnable, match="larger than the 1 MB a cell brings back"):
        pickled_for_notebook(np.zeros(2**20), limit=2**20)


def _accelerator_like():
    return type("Accelerator", (), {"__module__": "accelerate.accelerator"})()


def test_module_settings_carry_what_a_module_collects_into_the_same_list():
    from gpumagic.cell.module_settings import apply_settings, module_settings
    trained, notebook = torch.nn.Sequential(torch.nn.Linear(2, 1)), torch.nn.Sequential(torch.nn.Linear(2, 1))
    kept = notebook.losses = []
    trained.losses = [(torch.ones(1, requires_grad=True) * 2).sum()]
    trained[0].history = {"epoch": [1, 2]}
    settings = module_settings(trained)
    apply_settings(notebook, settings)
    assert notebook.losses is kept and kept == [torch.tensor(2.0)] and not kept[0].requires_grad
    assert notebook[0].history == {"epoch": [1, 2]}


def test_a_view_comes_back_by_its_storage_not_densely():
    import pickle
    # an expanded mask: 4 bytes of storage, 1.6 GB as dense elements; it comes back as the same view
    mask = torch.ones(1).expand(20000, 20000)
    blob = pickled_for_notebook({"mask": mask}, limit=2**20)
    assert len(blob) < 4096
    back = pickle.loads(blob)["mask"]
    assert back.shape == (20000, 20000) and back.stride() == (0, 0)
    assert back.untyped_storage().nbytes() == 4 and back[19999, 19999].item() == 1.0
    assert back.untyped_storage().data_ptr() != mask.untyped_storage().data_ptr()   # a copy, not the rank's
    # a small slice of a large storage comes back as its own elements, not with the whole storage
    base = torch.arange(1_000_000, dtype=torch.float32)
    part = pickle.loads(pickled_for_notebook(base[10:20:2], limit=2**20))
    assert part.tolist() == [10.0, 12.0, 14.0, 16.0, 18.0] and part.untyped_storage().nbytes() == 20
    # what fits neither way is refused by its size
    with pytest.raises(NotReturnable, match="larger than the 1 MB a cell brings back"):
        pickled_for_notebook(base, limit=2**20)


def test_an_expanded_view_the_cell_binds_comes_back_as_a_view(shell):
    # bound to a name, set on a notebook object, put in a notebook dict or list, appended to a list a notebook
    # object holds (``self.outs.append(view)``): each the view it was, judged by its storage on rank 0 (1.6 GB
    # of elements, past the 256 MB a cell brings back, would be named had it been made dense)
    run_cell(shell, SETUP + "held = {'n': 1, 'model': model}\nrows = []\nlog.outs = []\n")
    _, cap = dp_cell(shell, CPU2, "mask = torch.ones(1).expand(20000, 20000)\nlog.mask = mask[:2]\n"
                                  "held['m'] = mask.T\nrows.append(mask)\nlog.outs.append(mask)\nout = model(X)\n")
    ns = shell.user_ns
    assert "not brought back" not in cap.stderr, cap.stderr
    for view, shape in [(ns["mask"], (20000, 20000)), (ns["log"].mask, (2, 20000)), (ns["held"]["m"], (20000, 20000)),
                        (ns["rows"][0], (20000, 20000)), (ns["log"].outs[0], (20000, 20000))]:
        assert view.shape == shape and view.stride() == (0, 0) and view.untyped_storage().nbytes() == 4
        assert view[-1, -1].item() == 1.0
