"""What a %%dataparallel cell (hand-written loop) leaves in the notebook's own lists and dicts, and what its
note says does not come back, against what a plain cell leaves (CPU, gloo, 2 ranks)."""
from __future__ import annotations

import ast
import collections
import types

import torch

from tests.dataparallel_helpers import REGRESSION, dp_cell, last_result, notebook_from, trained_in_one_process

CPU2 = "--nprocs 2"


def _trained_cell(extra: str) -> str:
    """One epoch of the REGRESSION notebook's training, then ``extra``."""
    return ("for x, y in loader:\n"
            "    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()\n" + extra)


def test_an_item_set_through_an_attribute_of_a_notebook_object_comes_back_and_is_not_named(shell):
    """``rec.outs[0] = t`` with ``rec`` a notebook object holding a list: the tensor came back, yet the note
    also said "rec.outs[0] (set through an item of rec, a Rec that does not come back...)"."""
    ns = notebook_from(shell, REGRESSION + "class Rec:\n    def __init__(self):\n        self.outs = [torch.zeros(1)]\n"
                                           "rec = Rec()\n")
    rec, outs = ns["rec"], ns["rec"].outs
    reference = trained_in_one_process(ns)
    _, cap = dp_cell(shell, CPU2, _trained_cell("rec.outs[0] = model(X[:1]).detach().squeeze(0)\n"))
    assert rec.outs is outs and len(outs) == 1
    torch.testing.assert_close(outs[0], reference(ns["X"][:1]).detach().squeeze(0), atol=1e-6, rtol=0)
    assert "rec.outs" in last_result().values
    assert not any("rec" in entry for entry in last_result().not_returned), last_result().not_returned
    assert "rec.outs[0]" not in cap.stderr, cap.stderr


def test_a_notebook_object_the_cell_moves_into_a_notebook_dict_is_the_notebooks_own(shell):
    """``reg["aux"] = m2`` with ``m2`` a notebook module the cell trains: noted as "an object made in the cell",
    and ``reg`` left without it."""
    ns = notebook_from(shell, REGRESSION + "m2 = torch.nn.Linear(4, 1)\nopt2 = torch.optim.SGD(m2.parameters(), "
                                           "lr=0.1)\nreg = {'main': model}\n")
    reg, m2, model = ns["reg"], ns["m2"], ns["model"]
    w2 = m2.weight.detach().clone()
    _, cap = dp_cell(shell, CPU2, _trained_cell(
        "for x, y in loader:\n"
        "    opt2.zero_grad(); ((m2(x) - y) ** 2).mean().backward(); opt2.step()\n"
        "reg['aux'] = m2\n"))
    assert ns["reg"] is reg and list(reg) == ["main", "aux"]
    assert reg["aux"] is m2 and reg["main"] is model         # the notebook's own objects, not copies
    assert not torch.equal(m2.weight.detach(), w2)           # holding the trained state
    assert last_result().not_returned == [], last_result().not_returned
    assert "not brought back" not in cap.stderr, cap.stderr


def test_a_notebook_defaultdict_of_lists_filled_with_tensors_comes_back_as_a_defaultdict(shell):
    """``outs = defaultdict(list)`` filled with ``outs["val"].append(out.detach())``: named as "holds objects
    that are not plain values"; one holding a model besides (``runs["model"] = model``) was named as "set
    through an item of runs, a defaultdict that does not come back", or its lists lost without a word. An
    OrderedDict the same."""
    ns = notebook_from(shell, REGRESSION + "import collections\nouts = collections.defaultdict(list)\n"
                                           "runs = collections.defaultdict(list, model=model)\n"
                                           "ordered = collections.OrderedDict(model=model, val=[])\n")
    outs, runs, ordered, model = ns["outs"], ns["runs"], ns["ordered"], ns["model"]
    val = ordered["val"]
    reference = trained_in_one_process(ns)
    _, cap = dp_cell(shell, CPU2, _trained_cell(
        "with torch.no_grad():\n"
        "    out = model(X[:2])\n"
        "    loss = ((out - Y[:2]) ** 2).mean()\n"
        "outs['val'].append(out.detach()); outs['loss'].append(loss.detach())\n"
        "runs['val'].append(out.detach())\n"
        "runs['loss'] = [loss.detach()]\n"
        "ordered['val'].append(out.detach())\n"))
    with torch.no_grad():
        out = reference(ns["X"][:2])
        loss = ((out - ns["Y"][:2]) ** 2).mean()
    assert ns["outs"] is outs and type(outs) is collections.defaultdict and outs.default_factory is list
    assert ns["runs"] is runs and type(runs) is collections.defaultdict and runs.default_factory is list
    assert ns["ordered"] is ordered and type(ordered) is collections.OrderedDict and ordered["val"] is val
    assert list(outs) == ["val", "loss"] and list(runs) == ["model", "val", "loss"] and runs["model"] is model
    for got in (outs["val"], runs["val"], val):
        assert len(got) == 1
        torch.testing.assert_close(got[0], out, atol=1e-6, rtol=0)
    for got in (outs["loss"], runs["loss"]):
        assert len(got) == 1
        torch.testing.assert_close(got[0], loss, atol=1e-6, rtol=0)
    assert last_result().not_returned == [], last_result().not_returned
    assert "not brought back" not in cap.stderr, cap.stderr
    outs["new"].append(1)                                     # still a defaultdict(list)
    assert outs["new"] == [1]


def test_a_key_moved_in_a_notebook_dict_takes_rank_0s_order(shell):
    """``held["a"] = held.pop("a")`` moves the key to the end in a plain cell; the notebook's dict kept its
    old order."""
    ns = notebook_from(shell, REGRESSION + "held = {'a': model, 'b': 1, 'c': torch.zeros(2)}\n")
    held, model, c = ns["held"], ns["model"], ns["held"]["c"]
    dp_cell(shell, CPU2, _trained_cell("held['a'] = held.pop('a')\n"))
    assert ns["held"] is held and list(held) == ["b", "c", "a"]
    assert held["a"] is model and held["b"] == 1 and held["c"] is c
    assert last_result().not_returned == [], last_result().not_returned


def test_the_note_names_only_items_that_do_not_come_back():
    """Items set through attributes of watched objects, lists inside compared dicts and a trained module held in
    one (its attributes come back with it) come back; attributes set on a library's object held in a list, and
    items of what rank 0 does not compare, do not, and are named."""
    from gpumagic.cell.names import items_assigned
    from gpumagic.dataparallel.kernel.survey import item_notes

    class Opaque:   # a class of no notebook's: not watched
        def __init__(self):
            self.outs = [torch.zeros(1)]
    model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    ns = {"rec": types.SimpleNamespace(outs=[torch.zeros(1)], model=model, big=[0] * 1_000_001),
          "held": {"model": model, "outs": {"val": []}, "box": Opaque()}, "opaque": Opaque()}
    tree = ast.parse("rec.outs[0] = t\nrec.new['a'] = t\nrec.model[0] = layer\nrec.big[0] = 1\n"
                     "held['outs']['val'][0] = t\nheld['model'].size = 3\nheld['box'].size = 3\n"
                     "opaque.outs[0] = t\n")
    trained = {id(sub) for sub in model.modules()}
    assert item_notes(ns, items_assigned(tree), trained) == [
        "rec.big[0] (set through an item of rec.big, a list that does not come back; set it in a plain cell)",
        "held['box'].size (set on an object held in held, which does not come back; set it in a plain cell)",
        "opaque.outs[0] (set through an item of opaque.outs, a list that does not come back; set it in a plain "
        "cell)"]
