"""What a %%dataparallel cell leaves in the notebook: the cell's functions, classes and imports defined there
(gpumagic.cell.definitions), and a module whose layers the cell replaced taking the trained layers
(gpumagic.dataparallel.strategies.trained)."""
from __future__ import annotations

import ast
import copy
import json
import os.path
import textwrap

import torch
from torch import nn

from gpumagic.cell.definitions import define_in_notebook
from gpumagic.dataparallel.kernel.result import DataParallelResult
from gpumagic.dataparallel.protocol import RankStats, Trained
from gpumagic.dataparallel.strategies.trained import load_trained

CELL = """\
import json as js
from os.path import join as pjoin, basename
SCALE = 3

def scaled(x):
    return x * SCALE + offset()

class Counter:
    start = SCALE

    def bump(self):
        return scaled(self.start)

if True:
    def hidden():
        return 0

def twice():
    return 1

def twice():
    return 2

def broken(a=1 / 0):
    return a

from gpumagic_no_such_module import thing
for i in range(2):
    pass
"""


def define(ns, names, cell=CELL, filename="<cell-7>"):
    return define_in_notebook(ns, ast.parse(textwrap.dedent(cell)), filename, names)


def test_functions_classes_and_imports_are_defined_in_the_notebook():
    ns = {"offset": lambda: 100, "SCALE": 2}
    done, failed = define(ns, ["scaled", "Counter", "js", "pjoin", "basename"])
    assert (done, failed) == (["scaled", "Counter", "js", "pjoin", "basename"], [])
    # The function reads the notebook's names: its globals are the notebook's namespace.
    assert ns["scaled"].__globals__ is ns
    assert ns["scaled"](5) == 5 * 2 + 100
    ns["SCALE"] = 10
    assert ns["scaled"](1) == 110
    # The class body ran in the notebook too (SCALE was 2 then); its methods see later changes.
    assert ns["Counter"].start == 2
    assert ns["Counter"]().bump() == 2 * 10 + 100
    assert ns["js"] is json and ns["pjoin"] is os.path.join and ns["basename"] is os.path.basename
    # Only what was asked for: the assignment SCALE = 3 did not run.
    assert ns["SCALE"] == 10


def test_code_keeps_the_cell_filename_and_line_numbers():
    ns = {"offset": lambda: 0, "SCALE": 1}
    define(ns, ["scaled", "Counter"], filename="<dataparallel-cell-42>")
    code = ns["scaled"].__code__
    assert code.co_filename == "<dataparallel-cell-42>"
    assert code.co_firstlineno == CELL.splitlines().index("def scaled(x):") + 1
    assert ns["Counter"].bump.__code__.co_filename == "<dataparallel-cell-42>"


def test_last_definition_of_a_name_wins():
    ns: dict = {}
    assert define(ns, ["twice"]) == (["twice"], [])
    assert ns["twice"]() == 2


def test_names_without_a_top_level_statement_are_reported():
    ns: dict = {}
    done, failed = define(ns, ["hidden", "SCALE", "i", "scaled"])
    assert done == ["scaled"]
    reason = "(not bound by a def, class, import or namedtuple(...) at the top of the cell)"
    assert failed == [f"hidden {reason}", f"SCALE {reason}", f"i {reason}"]
    assert "hidden" not in ns and "SCALE" not in ns and "i" not in ns


def test_a_class_made_by_namedtuple_or_enum_is_defined_but_no_other_assignment_runs():
    cell = """\
import collections, enum
from dataclasses import make_dataclass
Out = collections.namedtuple("Out", "loss step")
Color = enum.Enum("Color", "RED GREEN")
Stat = make_dataclass("Stat", ["loss"])
made = build()
"""
    ns: dict = {"build": lambda: 1 / 0}
    done, failed = define(ns, ["collections", "enum", "make_dataclass", "Out", "Color", "Stat", "made"], cell=cell)
    assert done == ["collections", "enum", "make_dataclass", "Out", "Color", "Stat"]
    assert failed == ["made (not bound by a def, class, import or namedtuple(...) at the top of the cell)"]
    assert ns["Out"](1.5, 2).step == 2 and ns["Out"]._fields == ("loss", "step")
    assert [c.name for c in ns["Color"]] == ["RED", "GREEN"]
    assert ns["Stat"](3).loss == 3 and "made" not in ns


def test_statements_that_raise_are_reported_with_the_reason_and_the_rest_defined():
    ns: dict = {"offset": lambda: 0}
    done, failed = define(ns, ["broken", "thing", "twice"])
    assert done == ["twice"]
    assert failed == ["broken (ZeroDivisionError: division by zero)",
                      "thing (ModuleNotFoundError: No module named 'gpumagic_no_such_module')"]
    assert "broken" not in ns and "thing" not in ns


def test_one_import_binding_several_names_runs_once():
    ns: dict = {"runs": []}
    cell = "from os.path import join, basename\nimport os\n"
    # A statement with a visible effect: a class whose body records that it ran.
    cell += "class Marker:\n    runs.append(1)\n"
    done, failed = define(ns, ["join", "basename", "Marker"], cell=cell)
    assert (done, failed) == (["join", "basename", "Marker"], [])
    assert ns["runs"] == [1]
    assert "os" not in ns


# --- a module whose layers the cell replaced --------------------------------------------------------

def storages(module) -> set:
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}


def test_reshaped_module_adopts_the_trained_layers_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Dropout())
    model.register_buffer("steps", torch.zeros(1))
    first, first_weight, head = model[0], model[0].weight, model[2]
    # What rank 0 sends back: the cell replaced the head (8 -> 3), dropped the dropout, added a
    # non-persistent buffer, and trained.
    trained = copy.deepcopy(model)
    trained[2] = nn.Linear(8, 3)
    del trained[3]
    trained.register_buffer("scratch", torch.ones(2), persistent=False)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
        trained.steps.fill_(5)
    expected = {k: v.clone() for k, v in trained.state_dict().items()}
    ns = {"model": model}
    state = Trained(modules={"model": trained.state_dict()}, reshaped={"model": trained})

    assert load_trained(ns, state, {"model": model}, {}, []) == ([], [])

    assert ns["model"] is model                                   # the notebook's object, in place
    assert len(model) == 3
    assert model[2].weight.shape == (3, 8) and model[2].out_features == 3
    assert model[2] is not head and model[2] is not trained[2]   # the new layer: a copy of the trained one
    assert model[0] is first and model[0].weight is first_weight  # an unchanged layer: same objects, new values
    assert model(torch.randn(5, 4)).shape == (5, 3)
    assert list(model.state_dict()) == list(expected)
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert model._non_persistent_buffers_set == {"scratch"}
    assert "scratch" not in model.state_dict() and torch.equal(model.scratch, torch.ones(2))
    # No tensor shares storage with what was received (views of a buffer the next cell reuses).
    assert not storages(trained) & storages(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.zero_()
    assert torch.equal(model[0].weight, expected["0.weight"]) and torch.equal(model[2].weight, expected["2.weight"])


def test_modules_not_reshaped_still_load_their_state_dict_in_place():
    model = nn.Linear(3, 2)
    other = nn.Sequential(nn.Linear(3, 1))
    weight = model.weight
    got = {k: v + 1 for k, v in model.state_dict().items()}
    trained_other = nn.Sequential(nn.Linear(3, 4))
    state = Trained(modules={"model": got, "other": {}}, reshaped={"other": trained_other})
    load_trained({}, state, {"model": model, "other": other}, {}, [])
    assert model.weight is weight and torch.equal(model.weight, got["weight"])
    assert len(other) == 1 and other[0].out_features == 4 and other[0] is not trained_other[0]


def test_a_stateful_object_that_refuses_its_state_is_named_with_what_was_loaded_already():
    import pytest

    class Picky:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            raise ValueError("wrong version")

    model = nn.Linear(3, 2)
    got = {k: v + 1 for k, v in model.state_dict().items()}
    ns = {"model": model, "sched": Picky(), "epochs": 1}
    state = Trained(modules={"model": got}, stateful={"sched": {"v": 2}})
    with pytest.raises(RuntimeError, match=r"sched.load_state_dict raised ValueError: wrong version. The trained "
                                           r"state was already loaded into model, which keep it; sched and the "
                                           r"cell's other values are as before the cell"):
        load_trained(ns, state, {"model": model}, {}, ["sched"])
    assert torch.equal(model.weight, got["weight"]) and ns["epochs"] == 1


def test_the_summary_names_what_came_back_but_not_a_throwaway_loop_variable():
    result = DataParallelResult(devices=["cpu", "cpu"], backend="gloo", modules=["model"], optimizers=["opt"],
                                loaders=[], stateful=[], values=["_", "losses"],
                                per_rank={0: RankStats(steps=4), 1: RankStats(steps=4)})
    assert result.summary() == ("%%dataparallel: 2 ranks (gloo), 4 optimizer steps each; trained state loaded "
                                "into model, opt; values: losses")


def test_a_reshaped_module_takes_the_last_gradients_too():
    # the cell replaced the head and trained: the kept layer's gradient is the cell's, not the one an
    # earlier plain cell left, and the new head has the cell's as well
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model(torch.randn(3, 4)).sum().backward()
    trained = copy.deepcopy(model)
    trained[1] = nn.Linear(8, 3)
    grads = {k: torch.full_like(p, 0.5) for k, p in trained.named_parameters()}
    state = Trained(modules={"model": trained.state_dict()}, reshaped={"model": trained}, grads={"model": grads})
    load_trained({"model": model}, state, {"model": model}, {}, [])
    assert model[1].out_features == 3
    for k, p in model.named_parameters():
        assert torch.equal(p.grad, grads[k]), k

