"""The way back without processes (gpumagic.dataparallel.sync): rank 0's snapshot and capture, and the kernel's apply.

Each test makes the cell's change on rank 0's copies of the notebook's objects (``rank``), sends what rank 0
captures through a pickle (as it travels) into the notebook's own objects (``kernel``), and compares with
the same change made directly on a third set of objects, as a plain one-process cell would make it.
"""
from __future__ import annotations

import collections
import copy
import pickle
import threading
import types

import numpy as np
import pytest
import torch

from gpumagic.dataparallel.protocol import Watch
from gpumagic.dataparallel.sync.apply import apply_changes
from gpumagic.dataparallel.sync.capture import capture, prefix
from gpumagic.dataparallel.sync.snapshot import take


def round_trip(kernel: dict, rank: dict, change, roots=None, assigned=(), set_attributes=(), deleted=()):
    """``change(rank)`` captured on rank 0 and applied to ``kernel``; returns ``(changes, applied)``."""
    watch = Watch(roots=tuple(roots if roots is not None else rank), assigned=tuple(assigned),
                  set_attributes=tuple(set_attributes), deleted=tuple(deleted))
    snap = take(rank, watch)
    change(rank)
    changes, _ = capture(snap, rank, watch)
    travelled = pickle.loads(pickle.dumps(changes))
    return changes, apply_changes(kernel, travelled, assigned=assigned)


class Box:
    pass


Box.__module__ = "__main__"   # (an instance of a notebook class: its public attributes come back)


def test_the_prefix_of_unchanged_items_is_found_by_identity_and_keys():
    a, b = object(), object()
    assert prefix((None, [a, b]), (None, [a, b, 1])) == 2
    assert prefix((None, [a, b]), (None, [b, a])) == 0
    assert prefix((["x", "y"], [a, b]), (["x", "z"], [a, b])) == 1
    assert prefix((None, []), (None, [a])) == 0


def test_containers_holding_objects_take_their_new_items_around_the_notebooks_own():
    model = torch.nn.Linear(1, 1)

    def notebook():
        return {"held": {"n": 1, "model": model, "buf": torch.zeros(2), "old": 0}, "runs": [model, 1],
                "bag": {"model": model}}
    kernel, rank = notebook(), notebook()
    kernel_buf = kernel["held"]["buf"]

    def change(ns):
        ns["held"]["n"] = 2
        ns["held"]["buf"].add_(1)
        del ns["held"]["old"]
        ns["runs"].insert(0, 0.5)
        ns["bag"]["made"] = threading.Lock()
    changes, applied = round_trip(kernel, rank, change)
    assert set(changes.refills) == {("held",), ("runs",)} and list(changes.fills) == [("held", ("item", "buf"))]
    assert changes.not_returned == ["bag (the cell changed its items, and 'made' now holds an object made in the cell, "
                                    "which does not come back (TypeError: cannot pickle '_thread.lock' object), so "
                                    "bag is left as it was; change it in a plain cell)"]
    assert kernel["held"] == {"n": 2, "model": model, "buf": kernel_buf} and "old" not in kernel["held"]
    assert kernel["held"]["buf"] is kernel_buf and torch.equal(kernel_buf, torch.ones(2))
    assert kernel["runs"] == [0.5, model, 1] and kernel["runs"][1] is model
    assert kernel["bag"] == {"model": model}
    assert applied.bound == ["held", "runs"]


def test_lists_and_dicts_inside_a_container_stay_the_notebooks_own():
    model, m2 = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

    def notebook():
        return {"held": {"model": model, "outs": {"val": [torch.zeros(2)], "n": [1]},
                         "order": collections.OrderedDict(a=model, b=[torch.ones(1)])}, "m2": m2}
    kernel, rank = notebook(), notebook()
    held = kernel["held"]
    outs, val, first, n, order = held["outs"], held["outs"]["val"], held["outs"]["val"][0], held["outs"]["n"], \
        held["order"]

    def change(ns):
        r = ns["held"]
        r["outs"]["val"][0].add_(1)                 # filled in place
        r["outs"]["val"].append(torch.full((2,), 3.0))
        r["outs"]["n"].append(2)                    # a plain list inside: still the notebook's
        r["order"].move_to_end("a")
        r["aux"] = ns["m2"]                         # the notebook's object, by its name
        r["new"] = {"t": [torch.ones(3)]}           # made in the cell: built anew
        r["ns"] = types.SimpleNamespace(model=ns["m2"], n=3)   # made in the cell, holding the notebook's m2
    changes, _ = round_trip(kernel, rank, change, roots=["held"])
    assert changes.not_returned == []
    assert held["outs"] is outs and outs["val"] is val and val[0] is first and outs["n"] is n
    assert torch.equal(first, torch.ones(2)) and torch.equal(val[1], torch.full((2,), 3.0)) and n == [1, 2]
    assert held["order"] is order and list(order) == ["b", "a"] and order["a"] is model
    assert held["aux"] is m2 and held["model"] is model and held["ns"].model is m2
    assert list(held["new"]) == ["t"] and torch.equal(held["new"]["t"][0], torch.ones(3))


def test_one_list_under_two_names_is_rebuilt_once_from_the_notebooks_items():
    t0, t1 = torch.zeros(2), torch.ones(2)
    kernel_a = [t0, t1]
    rank_a = [t0.clone(), t1.clone()]
    changes, _ = round_trip({"a": kernel_a, "b": kernel_a}, {"a": rank_a, "b": rank_a}, lambda ns: ns["a"].insert(
        0, torch.full((2,), 7.0)))
    assert list(changes.refills) == [("a",)]   # described once
    assert len(kernel_a) == 3 and torch.equal(kernel_a[0], torch.full((2,), 7.0)) and kernel_a[1] is t0
    del kernel_a[0]
    rank_a.pop(0)
    round_trip({"a": kernel_a, "b": kernel_a}, {"a": rank_a, "b": rank_a}, lambda ns: ns["a"].__delitem__(0))
    assert kernel_a == [t1] and kernel_a[0] is t1


def test_a_list_that_is_also_an_attribute_is_refilled_once():
    t0, t1 = torch.zeros(2), torch.ones(2)
    kernel_box, rank_box = Box(), Box()
    kernel_box.outs = kernel_outs = [t0, t1]
    rank_box.outs = rank_outs = [t0.clone(), t1.clone()]
    changes, _ = round_trip({"box": kernel_box, "outs": kernel_outs}, {"box": rank_box, "outs": rank_outs},
                            lambda ns: ns["outs"].__delitem__(0))
    assert len(changes.refills) == 1 and changes.attributes == {}
    assert kernel_box.outs is kernel_outs and kernel_outs == [t1] and kernel_outs[0] is t1


def test_attributes_come_back_set_on_the_notebooks_objects_and_deleted_there():
    kernel_box, rank_box = Box(), Box()
    for b in (kernel_box, rank_box):
        b.items, b.count, b._private, b.gone, b.buf, b.rebound = [1], 0, 5, "x", torch.zeros(3), torch.zeros(1)
    kernel_buf, kernel_items = kernel_box.buf, kernel_box.items
    other_kernel, other_rank = types.SimpleNamespace(x=1), types.SimpleNamespace(x=1)

    def change(ns):
        box = ns["box"]
        box.items.append(2)               # changed in place: the notebook's list, refilled
        box.count += 1
        box._private = 6                  # private: not the user's
        box.new = "yes"
        del box.gone
        box.buf[1] = 5.0                  # the notebook's tensor, filled in place
        box.rebound = torch.full((1,), 9.0)
        ns["other"].lock = threading.Lock()
    changes, applied = round_trip({"box": kernel_box, "other": other_kernel}, {"box": rank_box, "other": other_rank},
                                  change)
    assert kernel_box.items is kernel_items and kernel_items == [1, 2]
    assert (kernel_box.count, kernel_box._private, kernel_box.new) == (1, 5, "yes") and not hasattr(kernel_box, "gone")
    assert kernel_box.buf is kernel_buf and kernel_buf.tolist() == [0.0, 5.0, 0.0]
    assert kernel_box.rebound.tolist() == [9.0]
    assert changes.not_returned == ["other.lock (cannot be pickled, or holds what stays in the ranks)"]
    assert not hasattr(other_kernel, "lock")
    assert set(applied.bound) == {"box.items", "box.count", "box.new", "box.buf", "box.rebound"}


def test_a_list_attribute_bound_anew_leaves_the_old_list_to_its_other_names():
    def tracker():
        t = Box()
        t.losses, t.log = [0.1], [1]
        return t

    def change(ns):
        ns["tr"].losses = []
        ns["tr"].losses.append(0.5)
        ns["tr"].log.append(2)
    tr = tracker()
    run1, log = tr.losses, tr.log
    round_trip({"tr": tr}, {"tr": tracker()}, change)
    assert run1 == [0.1] and tr.losses == [0.5] and tr.losses is not run1
    assert tr.log is log and log == [1, 2]


def test_an_object_whose_attribute_the_cell_sets_takes_it_whatever_its_class():
    import string
    kernel, rank = string.Template("$x"), string.Template("$x")
    kernel.cache = rank.cache = None
    round_trip({"holder": kernel}, {"holder": rank}, lambda ns: setattr(ns["holder"], "size", 3),
               set_attributes=[("holder", ("size", "cache"))])
    assert kernel.size == 3


def test_a_long_history_sends_the_change_not_the_history():
    """A watched object's list and dict of 200,000 floats, appended to: what travels is a few hundred bytes;
    read and not changed, nothing. Changed in the middle, everything after the change travels (and lands)."""
    def box():
        b = Box()
        b.losses = [float(i) for i in range(200_000)]
        b.history = {i: float(i) for i in range(200_000)}
        return b
    kernel, rank = box(), box()
    losses, history = kernel.losses, kernel.history
    changes, _ = round_trip({"box": kernel}, {"box": rank}, lambda ns: None)
    assert changes.refills == {} and changes.attributes == {}

    def append(ns):
        ns["box"].losses.append(0.5)
        ns["box"].history[200_000] = 0.5
    changes, _ = round_trip({"box": kernel}, {"box": rank}, append)
    assert len(pickle.dumps(changes)) < 1_000
    assert kernel.losses is losses and losses == rank.losses and kernel.history is history

    def middle(ns):
        ns["box"].losses[100_000] = -1.0
        del ns["box"].losses[3]
        del ns["box"].history[3]
    round_trip({"box": kernel}, {"box": rank}, middle)
    assert kernel.losses is losses and losses == rank.losses and len(losses) == 200_000
    assert list(history.items()) == list(rank.history.items())


def test_a_history_past_a_million_items_is_named_when_changed():
    kernel, rank = Box(), Box()
    kernel.big, rank.big = [0.0] * 1_000_001, [0.0] * 1_000_001
    changes, _ = round_trip({"box": kernel}, {"box": rank}, lambda ns: None)
    assert changes.not_returned == []
    changes, _ = round_trip({"box": kernel}, {"box": rank}, lambda ns: ns["box"].big.append(1.0))
    assert changes.not_returned[0].startswith("box.big (a list of 1,000,001 items") and len(kernel.big) == 1_000_001


def test_a_defaultdict_or_ordereddict_keeps_its_type_and_rank_0s_key_order():
    def notebook():
        return {"by_key": collections.defaultdict(list), "ordered": collections.OrderedDict(n=1, m=2)}
    kernel = notebook()
    by_key, ordered = kernel["by_key"], kernel["ordered"]

    def change(ns):
        ns["by_key"]["a"].append(torch.ones(2))
        ns["ordered"]["b"] = torch.zeros(1)
        ns["ordered"]["n"] = ns["ordered"].pop("n")
    round_trip(kernel, notebook(), change)
    assert type(by_key) is collections.defaultdict and by_key.default_factory is list
    assert torch.equal(by_key["a"][0], torch.ones(2))
    assert type(ordered) is collections.OrderedDict and list(ordered) == ["m", "b", "n"]


def test_names_the_cell_binds_alias_the_notebooks_objects_and_lists_inside_them():
    model = torch.nn.Linear(1, 1)

    def notebook():
        return {"history": {"val": [], "model": model}, "args": types.SimpleNamespace(lr=0.1), "model": model}
    kernel = notebook()

    def change(ns):
        ns["hv"] = ns["history"]["val"]
        ns["alias"] = ns["args"]
        ns["hv"].append(1.0)
        ns["holder"] = {"net": ns["model"], "made": copy.deepcopy(ns["model"])}
    _, applied = round_trip(kernel, notebook(), change, roots=["history", "args"],
                            assigned=["hv", "alias", "holder"])
    assert kernel["hv"] is kernel["history"]["val"] and kernel["hv"] == [1.0]
    assert kernel["alias"] is kernel["args"] and kernel["holder"]["net"] is model
    made = kernel["holder"]["made"]
    assert type(made) is torch.nn.Linear and made is not model and torch.equal(made.weight, model.weight)
    assert applied.made == [made]


def test_a_model_the_cell_made_is_one_object_wherever_the_cell_put_it():
    model = torch.nn.Linear(1, 1)

    def notebook():
        return {"model": model, "board": {"best": None}}
    kernel = notebook()

    def change(ns):
        ns["best"] = copy.deepcopy(ns["model"])
        ns["results"] = {"model": ns["best"]}
        ns["board"]["best"] = ns["best"]
    round_trip(kernel, notebook(), change, roots=["board"], assigned=["best", "results"])
    assert kernel["results"]["model"] is kernel["best"] is kernel["board"]["best"]


def test_two_views_of_one_tensor_each_keep_the_items_the_cell_set():
    base = torch.zeros(4, 6)
    kernel = {"base": base, "row": base[1], "cols": base.t()}
    rank_base = torch.zeros(4, 6)
    rank = {"base": rank_base, "row": rank_base[1], "cols": rank_base.t()}

    def change(ns):
        ns["row"][3] = 5.0
        ns["cols"][2, 1] = 7.0
    round_trip(kernel, rank, change)
    assert base[1, 3] == 5.0 and base[1, 2] == 7.0 and base.count_nonzero() == 2


def test_a_view_appended_to_an_objects_list_comes_back_by_its_storage():
    """``self.outs.append(mask)`` with an expanded view (4 bytes of storage, 1.6 GB of elements): described by
    its storage on rank 0, not made dense, and the same view in the notebook."""
    kernel, rank = Box(), Box()
    kernel.outs, rank.outs = [], []
    changes, _ = round_trip({"box": kernel}, {"box": rank},
                            lambda ns: ns["box"].outs.append(torch.ones(1).expand(20000, 20000)))
    assert len(pickle.dumps(changes)) < 4096
    (view,) = kernel.outs
    assert view.shape == (20000, 20000) and view.stride() == (0, 0) and view.untyped_storage().nbytes() == 4


def test_what_is_too_large_for_a_cell_is_named_and_left():
    from gpumagic.dataparallel.sync import capture as capture_module
    kernel, rank = Box(), Box()
    kernel.outs, rank.outs = [], []
    room = capture_module.Room

    class Small(room):
        def __init__(self):
            super().__init__(300)
    capture_module.Room = Small
    try:
        changes, _ = round_trip({"box": kernel}, {"box": rank}, lambda ns: ns["box"].outs.extend(
            [torch.zeros(64), torch.zeros(64)]))
    finally:
        capture_module.Room = room
    assert changes.not_returned == ["box.outs (larger than the 0 MB a cell brings back; save it from the cell, so "
                                    "box.outs is left as it was; change it in a plain cell)"]
    assert kernel.outs == []


def test_a_numpy_array_and_a_tensor_changed_in_place_are_filled_in_place():
    arr, t = np.zeros(3), torch.zeros(2)
    round_trip({"arr": arr, "t": t}, {"arr": np.zeros(3), "t": torch.zeros(2)},
               lambda ns: (ns["arr"].__setitem__(0, 7), ns["t"].add_(1)))
    assert arr.tolist() == [7.0, 0.0, 0.0] and t.tolist() == [1.0, 1.0]


def test_a_large_tensor_is_judged_by_its_version_not_read(monkeypatch):
    from gpumagic.dataparallel.sync import reach
    from gpumagic.procs import tensor_cache
    big = torch.zeros(reach.READ_WHOLE_BYTES // 4 + 1)
    read: list = []
    monkeypatch.setattr(tensor_cache, "fingerprint_keys", lambda ts: read.append(len(ts)) or
                        [(str(t.dtype), tuple(t.shape), int(t.sum())) for t in ts])
    watch = Watch(roots=("big", "small"), assigned=())
    ns = {"big": big, "small": torch.zeros(8)}
    snap = take(ns, watch)
    assert read == [1]                                    # only the small one's bytes were read
    big[5] = 1.0
    changes, _ = capture(snap, ns, watch)
    assert list(changes.fills) == [("big",)]


@pytest.mark.parametrize("value", [np.arange(3, dtype=">f4"), torch.empty(3, device="meta")])
def test_what_cannot_be_fingerprinted_is_not_compared_rather_than_failing_the_cell(value):
    watch = Watch(roots=("v",), assigned=())
    snap = take({"v": value}, watch)
    assert snap.seen == {}


def test_lazy_conjugate_views_are_compared_by_their_contents():
    from gpumagic.dataparallel.sync.reach import fingerprint
    z = torch.tensor([1 + 2j, 3 - 1j])
    ns = {"conj": z.conj(), "neg": z.conj().imag}
    assert fingerprint(ns["conj"]) == fingerprint(z.conj().resolve_conj())
    assert fingerprint(ns["neg"]) == fingerprint(z.conj().imag.resolve_neg())
    watch = Watch(roots=("conj", "neg"), assigned=())
    snap = take(ns, watch)
    assert capture(snap, ns, watch)[0].fills == {}
    z.mul_(2)   # the views see it, as in a plain cell
    assert set(capture(snap, ns, watch)[0].fills) == {("conj",), ("neg",)}


def test_a_strided_numpy_array_over_the_limit_is_not_copied(monkeypatch):
    from gpumagic.dataparallel.sync.reach import fingerprint
    from gpumagic.procs.returning import RETURN_LIMIT
    arr = np.zeros((RETURN_LIMIT // 8 // 1000 + 1, 1000)).T     # strided, just over what comes back
    monkeypatch.setattr(np, "ascontiguousarray", lambda *a, **k: pytest.fail("copied"))
    assert fingerprint(arr) is None
    assert fingerprint(np.array([object()])) is None           # object arrays: not compared


def test_tensors_kept_with_their_graph_come_back_detached():
    """``log.losses.append(loss)`` keeps each loss's graph (fine in a plain cell); it comes back without it."""
    kernel, rank = Box(), Box()
    kernel.losses, rank.losses = [], []
    w = torch.ones(2, requires_grad=True)
    changes, _ = round_trip({"log": kernel}, {"log": rank}, lambda ns: ns["log"].losses.append((w * 3).sum()))
    assert changes.not_returned == [] and kernel.losses == [torch.tensor(6.0)]
    assert not kernel.losses[0].requires_grad


def test_datasets_set_on_notebook_objects_hold_the_notebooks_own():
    """A DataModule's ``self.train_set, self.val_set = random_split(full, ...)``: rank 0's Subsets come back over
    the notebook's ``full`` (not a copy), two splits of one dataset share it; what cannot be pickled is named."""
    from torch.utils.data import Subset, TensorDataset, random_split
    X = torch.arange(10.0)
    kernel_full, rank_full = TensorDataset(X), TensorDataset(X.clone())
    kernel_dm, rank_dm = Box(), Box()
    kernel_dm.source, rank_dm.source = kernel_full, rank_full

    def change(ns):
        dm = ns["dm"]
        dm.train_set, dm.val_set = random_split(ns["full"], [7, 3], generator=torch.Generator().manual_seed(0))
        own = TensorDataset(torch.ones(2))
        dm.a, dm.b = Subset(own, [0]), Subset(own, [1])
        dm.locked = threading.Lock()
    changes, _ = round_trip({"full": kernel_full, "dm": kernel_dm}, {"full": rank_full, "dm": rank_dm}, change)
    assert kernel_dm.train_set.dataset is kernel_full and kernel_dm.val_set.dataset is kernel_full
    assert list(kernel_dm.train_set.indices) == list(rank_dm.train_set.indices)
    assert torch.equal(kernel_dm.a.dataset.tensors[0], torch.ones(2))
    assert changes.not_returned == ["dm.locked (cannot be pickled, or holds what stays in the ranks)"]


def test_long_lists_held_in_a_container_or_holding_objects_come_back():
    """A list of more than 10,000 plain values held in a notebook dict, and a long notebook list holding an object
    (``[model] + losses``), appended to and changed: both come back, the notebook's objects staying theirs."""
    model = torch.nn.Linear(1, 1)

    def notebook():
        return {"held": {"model": model, "losses": [0.5] * 12_000}, "mixed": [model] + [0.0] * 12_000}
    kernel = notebook()
    losses, mixed = kernel["held"]["losses"], kernel["mixed"]

    def change(ns):
        ns["held"]["losses"].append(0.25)
        ns["mixed"].append(0.25)
        ns["mixed"][1] = 2.0
    round_trip(kernel, notebook(), change)
    assert kernel["held"]["losses"] is losses and len(losses) == 12_001 and losses[-1] == 0.25
    assert kernel["mixed"] is mixed and len(mixed) == 12_002 and mixed[0] is model and mixed[1:3] == [2.0, 0.0]


def test_a_layer_of_a_trained_model_put_in_a_container_is_that_layer():
    """``reg["head"] = model[1][1]``: the notebook's layer, found by its path in the notebook's model (the
    strategy names the trained model's layers: ``known``)."""
    def notebook():
        model = torch.nn.Sequential(torch.nn.Linear(1, 2), torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(2, 1)))
        return {"model": model, "reg": {"main": model}, "plain": {}}
    kernel, rank = notebook(), notebook()
    known = {id(sub): (("path", ("model", ("layer", path))), sub)
             for path, sub in rank["model"].named_modules() if path}
    watch = Watch(roots=("reg", "plain"), assigned=())
    snap = take(rank, watch, known)
    rank["reg"]["head"] = rank["model"][1][1]
    rank["plain"]["first"] = rank["model"][0]
    changes, _ = capture(snap, rank, watch)
    apply_changes(kernel, pickle.loads(pickle.dumps(changes)))
    assert kernel["reg"]["head"] is kernel["model"][1][1] and kernel["reg"]["main"] is kernel["model"]
    assert kernel["plain"]["first"] is kernel["model"][0]
