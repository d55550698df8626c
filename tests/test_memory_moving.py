"""Moving storages in place (memory/moving.py), on the CPU: a copy onto the same device exercises every
re-pointing a GPU-to-CPU move does. The same objects, sharing kept, graphs still differentiable."""
from __future__ import annotations

import gc

import pytest
import torch

from gpumagic.memory import moving


def storage_ptr(t) -> int:
    return t.untyped_storage().data_ptr()


def trained_pair():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    model[2].weight = model[0].weight                # tied
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    model(x).pow(2).sum().backward()
    opt.step()
    return model, opt, x


def test_objects_stay_the_same_and_sharing_survives():
    model, opt, x = trained_pair()
    params = list(model.parameters())
    states = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    view = model[0].weight[:2]
    groups, unmovable = moving.gather(torch, [{"model": model, "opt": opt, "view": view}])
    assert unmovable == []
    before = {k: storage_ptr(g.tensors[0]) for k, g in groups.items()}
    result = moving.move(torch, groups, to="cpu")
    assert result.stayed == [] and result.moved_bytes == sum(g.nbytes for g in groups.values())
    assert all(storage_ptr(g.tensors[0]) != before[k] for k, g in groups.items())
    assert list(model.parameters()) == params and all(type(p) is torch.nn.Parameter for p in params)
    assert model[2].weight is model[0].weight
    assert storage_ptr(view) == storage_ptr(model[0].weight) and view.storage_offset() == 0
    model[0].weight.data[0, 0] = 42.0                # the view still sees the weight's storage
    assert view[0, 0].item() == 42.0
    for p in params:                                  # optimizer state: keyed by the same parameters
        assert all(torch.equal(opt.state[p][k], v) for k, v in states[id(p)].items())


def test_a_graphs_saved_tensors_move_and_backward_still_runs():
    torch.manual_seed(1)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    loss = (x @ w).relu().sin().sum()
    expected, = torch.autograd.grad(loss, w, retain_graph=True)
    groups, _ = moving.gather(torch, [loss], skip_keys={("cpu", storage_ptr(w))})
    saved_before = sum(len(g.saved) for g in groups.values())
    assert saved_before >= 2                          # relu's result, sin's input (x is saved by mm too)
    old = {k for k in groups}
    result = moving.move(torch, groups, to="cpu")
    assert result.saved == saved_before
    del groups
    gc.collect()
    again, = torch.autograd.grad(loss, w)
    assert torch.equal(again, expected)
    # the graph holds the copies now, not the storages it saved
    fresh, _ = moving.gather(torch, [loss], skip_keys={("cpu", storage_ptr(w))})
    assert not (set(fresh) & old)


def test_sparse_tensors_stay_and_are_named():
    dense = torch.ones(4, 4)
    sparse = torch.eye(4).to_sparse()
    groups, unmovable = moving.gather(torch, [[dense, sparse]])
    assert any(t is sparse for t in unmovable)
    result = moving.move(torch, groups, to="cpu")
    assert sorted(why for _, _, why in result.stayed) == ["part of a sparse tensor", "part of a sparse tensor"]
    assert result.tensors == 1 and torch.equal(dense, torch.ones(4, 4))


def test_skip_keys_leave_the_notebooks_storages_alone():
    mine, theirs = torch.ones(16), torch.zeros(16)
    groups, _ = moving.gather(torch, [[mine, theirs]], skip_keys={("cpu", storage_ptr(mine))})
    assert [g.tensors for g in groups.values()] == [[theirs]]
    ptr = storage_ptr(mine)
    moving.move(torch, groups, to="cpu")
    assert storage_ptr(mine) == ptr and storage_ptr(theirs) != ptr


def test_an_interrupt_leaves_nothing_half_moved(monkeypatch):
    import os
    import signal
    tensors = [torch.full((64,), float(i)) for i in range(4)]
    views = [t[:8] for t in tensors]
    ptrs = [storage_ptr(t) for t in tensors]
    groups, _ = moving.gather(torch, [tensors, views])
    bytes_of = moving._bytes_of
    calls = []

    def interrupted_copy(*args):
        calls.append(1)
        if len(calls) == 3:                       # Ctrl-C while the copies are being made
            raise KeyboardInterrupt
        return bytes_of(*args)
    monkeypatch.setattr(moving, "_bytes_of", interrupted_copy)
    with pytest.raises(KeyboardInterrupt):
        moving.move(torch, groups, to="cpu")
    assert [storage_ptr(t) for t in tensors] == ptrs   # nothing was pointed at a copy
    monkeypatch.setattr(moving, "_bytes_of", bytes_of)
    point = moving._point

    def signalled_point(*args):                     # Ctrl-C while tensors are being pointed at copies
        os.kill(os.getpid(), signal.SIGINT)
        return point(*args)
    monkeypatch.setattr(moving, "_point", signalled_point)
    with pytest.raises(KeyboardInterrupt):
        moving.move(torch, groups, to="cpu")
    assert all(storage_ptr(t) != p for t, p in zip(tensors, ptrs))   # every one of them moved
    assert all(storage_ptr(v) == storage_ptr(t) for v, t in zip(views, tensors))
    assert [t[0].item() for t in tensors] == [0.0, 1.0, 2.0, 3.0]
