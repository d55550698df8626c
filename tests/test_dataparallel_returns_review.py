"""What comes back of the notebook's lists and dicts, checked against what a plain one-process cell leaves.

Each test runs the cell's change on rank 0's copies (``ns``), sends what rank 0 describes through the
kernel's side into the notebook's objects (``kernel``), and compares with the same change made directly
on a third set of objects, as a plain cell would make it.
"""
from __future__ import annotations

import collections
import copy

import torch

from gpumagic.dataparallel.containers import changes, planned, refill_all, snapshot
from gpumagic.dataparallel.results import _planned_items, cloned
from gpumagic.dataparallel.returnable import attribute_snapshot, changed_attributes


def _round_trip(kernel: dict, ns: dict, names: list[str], change) -> dict:
    """``change`` made on rank 0's ``ns``; its containers' new contents applied to ``kernel``'s."""
    before = snapshot(ns, names)
    change(ns)
    back, dropped = changes(ns, before)
    assert dropped == []
    plans: dict = {}
    planned(kernel, cloned(back), plans)
    refill_all(plans)
    return back


def test_one_list_under_two_names_is_rebuilt_once_from_the_notebook_items():
    """``a = [t0, t1]; b = a``, then ``del a[0]``: the second rebuild read places the first had overwritten
    (an IndexError, the notebook half-updated)."""
    t0, t1 = torch.zeros(2), torch.ones(2)
    kernel_a = [t0, t1]
    kernel = {"a": kernel_a, "b": kernel_a}
    rank_a = [t0.clone(), t1.clone()]
    back = _round_trip(kernel, {"a": rank_a, "b": rank_a}, ["a", "b"], lambda ns: ns["a"].__delitem__(0))
    assert list(back) == ["a"]   # described once
    plain = [t0, t1]
    del plain[0]
    assert kernel["a"] is kernel["b"] is kernel_a and len(kernel_a) == len(plain) == 1
    assert all(x is y for x, y in zip(kernel_a, plain))


def test_one_list_under_two_names_keeps_its_items_on_an_insert():
    """``a.insert(0, new)`` with ``b = a``: the old item was lost and the new one duplicated."""
    t0 = torch.zeros(2)
    kernel_a = [t0]
    kernel = {"a": kernel_a, "b": kernel_a}
    rank_a = [t0.clone()]
    _round_trip(kernel, {"a": rank_a, "b": rank_a}, ["a", "b"],
                lambda ns: ns["a"].insert(0, torch.full((2,), 7.0)))
    assert len(kernel_a) == 2 and torch.equal(kernel_a[0], torch.full((2,), 7.0)) and kernel_a[1] is t0


def test_a_notebook_list_that_is_also_an_attribute_is_rebuilt_once():
    """``outs`` in the notebook and ``box.outs`` the same list: both described, rebuilt twice."""
    class Box:
        pass
    t0, t1 = torch.zeros(2), torch.ones(2)
    kernel_box = Box()
    kernel_box.outs = kernel_outs = [t0, t1]
    kernel = {"box": kernel_box, "outs": kernel_outs}
    rank_box = Box()
    rank_box.outs = rank_outs = [t0.clone(), t1.clone()]
    ns = {"box": rank_box, "outs": rank_outs}
    attrs_before, before = attribute_snapshot(ns, ["box"], {}), snapshot(ns, ["outs"])
    del rank_outs[0]
    attributes = changed_attributes(ns, attrs_before, ["box"])
    back, dropped = changes(ns, before, described=attributes.described)
    assert back == {} and dropped == [] and list(attributes.items["box"]) == ["outs"]
    plans: dict = {}
    names, rebound = _planned_items(kernel, cloned(attributes.items), plans)
    planned(kernel, cloned(back), plans)
    refill_all(plans)
    assert names == ["box.outs"] and rebound == []
    assert kernel_box.outs is kernel_outs and len(kernel_outs) == 1 and kernel_outs[0] is t1


def test_a_plain_list_or_dict_inside_a_changed_container_stays_the_notebook_object():
    """``held["hist"].append(3.0)`` with ``held = {"model": model, "hist": hist, ...}``: ``held["hist"]`` was
    replaced by a copy (``held["hist"] is hist`` False, ``hist`` unchanged) and a defaultdict became a dict."""
    model = torch.nn.Linear(2, 2)

    def notebook():
        hist, counts = [1.0, 2.0], collections.defaultdict(int)
        return hist, counts, {"model": model, "hist": hist, "counts": counts, "od": collections.OrderedDict(b=1)}

    def change(ns):
        ns["held"]["n"] = 1
        ns["held"]["hist"].append(3.0)
        ns["held"]["counts"]["x"] += 1
    hist, counts, held = notebook()
    _, _, rank = notebook()
    rank = {k: (v if k == "model" else copy.copy(v)) for k, v in rank.items()}
    _round_trip({"held": held}, {"held": rank}, ["held"], change)
    plain_hist, plain_counts, plain = notebook()
    change({"held": plain})
    assert held["hist"] is hist and hist == plain_hist == [1.0, 2.0, 3.0]
    assert held["counts"] is counts and type(counts) is collections.defaultdict and counts == plain_counts
    assert type(held["od"]) is collections.OrderedDict and held["model"] is model
    assert held == plain


def _loaded(kernel: dict, attributes) -> None:
    """The kernel's side of the attributes rank 0 found changed."""
    from gpumagic.dataparallel.results import load_into_notebook
    state = {"modules": {}, "optimizers": {}, "stateful": {}, "values": {},
             "attributes": cloned(attributes.changed), "attributes_kept": attributes.kept,
             "attribute_items": cloned(attributes.items)}
    load_into_notebook(kernel, state, {}, {}, [])


def test_a_list_attribute_the_cell_binds_anew_leaves_the_old_list_to_its_other_names():
    """``run1 = tr.losses`` earlier, then ``tr.losses = []; tr.losses.append(0.5)``: the old list was refilled
    in place, so ``run1`` lost its losses."""
    class Tracker:
        def __init__(self):
            self.losses, self.log = [0.1], [1]

    def change(ns):
        ns["tr"].losses = []
        ns["tr"].losses.append(0.5)
        ns["tr"].log.append(2)
    tr = Tracker()
    run1, log = tr.losses, tr.log
    rank = {"tr": Tracker()}
    before = attribute_snapshot(rank, ["tr"], {})
    change(rank)
    _loaded({"tr": tr}, changed_attributes(rank, before, ["tr"]))
    plain = Tracker()
    plain_run1, plain_log = plain.losses, plain.log
    change({"tr": plain})
    assert run1 == plain_run1 == [0.1] and tr.losses == plain.losses == [0.5] and tr.losses is not run1
    assert tr.log is log and log == plain_log == [1, 2]   # changed in place: still the notebook's list


def test_a_tensor_or_array_that_cannot_be_fingerprinted_is_not_compared_rather_than_failing_the_cell():
    """A big-endian numpy array, a meta tensor or a conjugate view in the notebook failed every cell."""
    import numpy as np

    from gpumagic.dataparallel.touched import changed, fingerprint, fingerprints
    z = torch.tensor([1 + 2j, 3 - 1j])
    ns = {"big_endian": np.arange(3, dtype=">f4"), "meta": torch.empty(3, device="meta"), "conj": z.conj(),
          "neg": z.conj().imag}
    assert fingerprint(ns["big_endian"]) is None and fingerprint(ns["meta"]) is None
    assert fingerprint(ns["conj"]) == fingerprint(z.conj().resolve_conj())
    assert fingerprint(ns["neg"]) == fingerprint(z.conj().imag.resolve_neg())
    before = fingerprints(ns, list(ns))
    assert set(before) == {"conj", "neg"} and changed(ns, before) == []
    z.mul_(2)   # the views see it, as in a plain cell
    assert changed(ns, before) == ["conj", "neg"]


def test_a_notebook_defaultdict_of_plain_values_filled_with_tensors_comes_back_into_itself():
    """``outs = defaultdict(list)``-like notebook dicts (a defaultdict, an OrderedDict) the cell filled with
    tensors were neither returned nor named in the note."""
    from gpumagic.dataparallel.containers import Room, grown

    def change(ns):
        ns["by_key"]["a"] = torch.ones(2)
        ns["ordered"]["b"] = torch.zeros(1)
    by_key, ordered = collections.defaultdict(int), collections.OrderedDict(n=1)
    rank = {"by_key": collections.defaultdict(int), "ordered": collections.OrderedDict(n=1)}
    change(rank)
    back, dropped = grown(rank, ["by_key", "ordered"], Room())
    assert dropped == []
    plans: dict = {}
    planned({"by_key": by_key, "ordered": ordered}, cloned(back), plans)
    refill_all(plans)
    plain = {"by_key": collections.defaultdict(int), "ordered": collections.OrderedDict(n=1)}
    change(plain)
    assert type(by_key) is collections.defaultdict and type(ordered) is collections.OrderedDict
    assert list(by_key) == list(plain["by_key"]) and torch.equal(by_key["a"], plain["by_key"]["a"])
    assert list(ordered) == ["n", "b"] and ordered["n"] == 1 and torch.equal(ordered["b"], torch.zeros(1))
