"""Under %%ondevice cpu, a move of a tensor the cell put on (stand-in) CUDA returns it, as on a GPU.

Regression from a test pass: ``x = torch.ones(3).cuda(); y = x.to('cuda')`` gave a copy on a CPU
DEVICE (``y is x`` on a GPU), so ``y += 1`` left ``x`` alone and ``batch.to(device)`` copied every
step. A CPU tensor the notebook made (a loader's batch) must still be copied, as a GPU copies it.
"""
from __future__ import annotations

import ast
import gc
import pickle
import weakref

import numpy as np
import pytest
import torch
import torch.nn as nn

from gpumagic.cell.rewrite import placed as placement_placed
from gpumagic.cell.rewrite.helper import HELPER, rewrite_placement
from gpumagic.cell.rewrite.placed import forget_all, remember, remembered
from tests.placement_helpers import cell_ok, run_rewritten

run = run_rewritten


def ok(shell, src):
    return cell_ok(shell, src)[1]


# -- the repro, through the magic ---------------------------------------------------------------------

def test_the_repro_cell(shell):
    # /tmp/pass_today/t_ond.py
    ok(shell, "import torch")
    out = ok(shell, "%%ondevice cpu\nx = torch.ones(3).cuda()\n"
                    "y = x.to('cuda'); w = x.cuda(); z = x.to(torch.device('cuda'))\n"
                    "print(y is x, w is x, z is x)\n"
                    "d = torch.device('cuda'); x2 = torch.ones(2).to(d); print(x2.to(d) is x2)\n"
                    "x3 = torch.ones(2, device='cuda:0')\n"
                    "print(x3.to('cuda:0') is x3, x3.to('cuda', torch.float32) is x3)\n"
                    "y += 1")
    assert out.split() == ["True", "True", "True", "True", "True", "True"]
    assert shell.user_ns["x"].tolist() == [2.0, 2.0, 2.0]   # y is x: += changed x, as on a GPU


def test_the_repro_moves_keyword_spellings(shell):
    ok(shell, "import torch")
    out = ok(shell, "%%ondevice cpu\nx = torch.ones(2, device='cuda:0')\ny = x.to('cuda:0', non_blocking=True)\n"
                    "yy = x.to(device='cuda')\nz = x.to('cuda', torch.float32)\nprint(y is x, yy is x, z is x)")
    assert out.split() == ["True", "True", "True"]


def test_the_loader_loop_still_copies_its_cpu_batches(shell):
    # The loader yields CPU tensors (library code is not rewritten): on a GPU .to(device) copies each one.
    ok(shell, "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
              "loader = DataLoader(TensorDataset(torch.zeros(6, 2), torch.zeros(6)), batch_size=2)")
    out = ok(shell, "%%ondevice cpu\ndevice = torch.device('cuda')\nmodel = torch.nn.Linear(2, 1).to(device)\n"
                    "same = []\nfor xb, yb in loader:\n    xb2, yb2 = xb.to(device), yb.to(device)\n"
                    "    same.append(xb2 is xb or yb2 is yb)\n    xb2 += 1\n    assert xb.sum() == 0\n"
                    "    model(xb2)\nprint(any(same), len(same))")
    assert out.split() == ["False", "3"]


# -- what the cell put on CUDA, and the moves that return it ---------------------------------------------

MADE = [
    "torch.ones(3).cuda()", "torch.ones(3).cuda(0)", "torch.ones(3).to('cuda')", "torch.ones(3).to(dev)",
    "torch.ones(3).to(device='cuda:0')", "torch.ones(3).to(torch.device('cuda'))", "torch.zeros(3).cuda()",
    "torch.ones(3, device='cuda')", "torch.ones(3, device='cuda:0')", "torch.ones(3, device=0)",
    "torch.ones(3, device=dev)", "torch.ones(3, device=torch.device('cuda'))",
    "torch.tensor([1., 2., 3.], device='cuda')",
    "torch.tensor([1., 2., 3.], device=dev)", "torch.as_tensor([1., 2., 3.], device='cuda')",
    "torch.full((3,), 2., device='cuda')", "torch.zeros_like(src, device='cuda')",
    "torch.cuda.FloatTensor([1., 2., 3.])", "torch.cuda.FloatTensor(3)", "T([1., 2., 3.])",
    "torch.FloatTensor([1., 2., 3.]).cuda()", "torch.ones(3, dtype=torch.float64).type(torch.cuda.FloatTensor)",
    "torch.ones(3, dtype=torch.float64).type(T)", "torch.ones_like(torch.ones(3).cuda())",
    "torch.ones(6).cuda()[::2]", "torch.ones(3).to(other)",
]
MOVES = [
    "x.to('cuda')", "x.cuda()", "x.cuda(0)", "x.to(torch.device('cuda'))", "x.to(dev)", "x.to(device=dev)",
    "x.to(device='cuda')", "x.to('cuda:0', non_blocking=True)", "x.to('cuda', torch.float32)", "x.to(0)",
    "x.to(dev, copy=False)", "x.type(torch.cuda.FloatTensor)", "x.type(T)", "x.to(other)", "torch.Tensor.to(x, dev)",
    "torch.Tensor.cuda(x)",
]


@pytest.mark.parametrize("made", MADE)
def test_a_move_of_a_tensor_the_cell_put_on_cuda_returns_it(made):
    ns = run(f"""
        dev = torch.device('cuda')
        T = torch.cuda.FloatTensor
        other = torch.zeros(1).cuda()
        x = {made}
        y = x.to('cuda')
        w = x.cuda()
        y += 1
    """, ns={"src": torch.zeros(3)})
    x = ns["x"]
    assert x.device.type == "cpu" and x.dtype == torch.float32
    assert ns["y"] is x and ns["w"] is x
    assert ns["src"].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("move", MOVES)
def test_every_move_spelling_returns_a_tensor_on_cuda(move):
    ns = run(f"""
        dev = torch.device('cuda:0')
        T = torch.cuda.FloatTensor
        other = torch.zeros(1, device='cuda')
        x = torch.ones(3).cuda()
        y = {move}
        y += 1
    """)
    assert ns["y"] is ns["x"] and ns["x"].tolist() == [2.0, 2.0, 2.0]


def test_another_dtype_is_a_new_tensor_still_on_cuda():
    ns = run("""
        x = torch.ones(3).cuda()
        h = x.to('cuda', torch.float64)
        h2 = x.to(torch.device('cuda'), dtype=torch.float16)
        t = x.type(torch.cuda.DoubleTensor)
        back = [h.to('cuda'), h2.cuda(), t.to('cuda:0')]
    """)
    x = ns["x"]
    assert ns["h"] is not x and ns["h"].dtype == torch.float64 and ns["h2"].dtype == torch.float16
    assert [b is o for b, o in zip(ns["back"], (ns["h"], ns["h2"], ns["t"]))] == [True] * 3


def test_modules_moved_or_built_on_cuda_hold_parameters_on_cuda():
    ns = run("""
        model = nn.Linear(2, 2).cuda()
        built = nn.Linear(2, 2, device='cuda')
        dev = torch.device('cuda')
        built2 = nn.Linear(2, 2, device=dev)
        bn = nn.BatchNorm1d(2).to(dev)
        same = [p.to('cuda') is p for m in (model, built, built2, bn) for p in list(m.parameters()) + list(m.buffers())]
    """)
    assert ns["same"] and all(ns["same"])


# -- CPU tensors the cell did not put on CUDA: still copied ---------------------------------------------------

COPIED = [
    ("host.to('cuda')", "a notebook tensor"), ("host.cuda()", "a notebook tensor"),
    ("host.to(dev)", "a notebook tensor"), ("host.to(dev, copy=False)", "copy=False copies on a GPU too"),
    ("torch.zeros(3).to('cuda')", "a factory without a device"), ("torch.as_tensor(host, device='cuda')", "as_tensor"),
    ("torch.asarray(host, device=dev)", "asarray"), ("torch.as_tensor(host).cuda()", "folded as_tensor"),
    ("torch.cuda.FloatTensor(host)", "a typed constructor of a CPU tensor"),
    ("host.type(torch.cuda.FloatTensor)", "retyped"), ("host.to(x)", "to a tensor on cuda"),
    ("(x + 1).to('cuda')", "a result of an op: not remembered (README, %%ondevice)"),
]


@pytest.mark.parametrize("call, why", COPIED)
def test_a_cpu_tensor_the_cell_did_not_put_on_cuda_is_copied(call, why):
    host = torch.zeros(3)
    ns = run(f"""
        dev = torch.device('cuda')
        x = torch.ones(3).cuda()
        y = {call}
        y += 1
        again = host.to('cuda')
    """, ns={"host": host})
    assert ns["y"] is not host and host.tolist() == [0.0, 0.0, 0.0], why
    assert ns["again"] is not host, "a copy that aliased its source must not mark the source as on CUDA"


def test_numpy_shared_by_as_tensor_is_copied():
    arr = np.zeros(3, dtype=np.float32)
    ns = run("y = torch.as_tensor(arr, device='cuda')\ny += 1\nz = y.to('cuda')", ns={"arr": arr})
    assert arr.tolist() == [0.0, 0.0, 0.0] and ns["z"] is ns["y"]


def test_as_tensor_of_a_tensor_on_cuda_returns_it():
    ns = run("x = torch.ones(3).cuda()\ny = torch.as_tensor(x, device='cuda')\nz = torch.asarray(x, device='cuda')")
    assert ns["y"] is ns["x"]


def test_explicit_cpu_placement_and_settled_values_unchanged():
    from gpumagic.cell.device_values import DeviceName
    ns = run("a = torch.zeros(2, device='cpu')\nb = a.to('cuda')\n"
             "c = torch.zeros(2, device=settled)\nd = c.to(settled)", ns={"settled": DeviceName("cpu")})
    assert ns["b"] is not ns["a"] and ns["d"] is ns["c"]


# -- the record: nothing on the tensors, nothing kept alive, only on a CPU target -----------------------------

def test_nothing_travels_with_the_tensor():
    ns = run("x = torch.ones(3).cuda()\nm = nn.Linear(2, 2).cuda()")
    x = ns["x"]
    assert not getattr(x, "__dict__", {}) and remembered(x)
    again = pickle.loads(pickle.dumps(x))
    assert torch.equal(again, x) and not getattr(again, "__dict__", {}) and not remembered(again)
    assert set(ns["m"].state_dict()) == {"weight", "bias"}
    assert all(not getattr(t, "__dict__", {}) for t in ns["m"].state_dict().values())


def test_the_record_keeps_nothing_alive_and_a_reused_id_is_not_mistaken():
    forget_all()
    ns = run("x = torch.ones(3).cuda()")
    held = weakref.ref(ns["x"])
    key = id(ns["x"])
    del ns["x"]
    gc.collect()
    assert held() is None
    # A new tensor at the dead one's address is a CPU tensor.
    new = torch.zeros(3)
    placement_placed._refs[id(new)] = placement_placed._refs[key]
    assert not remembered(new)


def test_the_record_stays_small_in_a_loop():
    forget_all()
    keep = []
    ns = run("""
        for i in range(20000):
            t = torch.zeros(2, device='cuda')
            u = torch.ones(2).cuda()
            if i % 1000 == 0:
                keep.append(t)
    """, ns={"keep": keep})
    assert len(placement_placed._refs) < 2100
    assert all(remembered(t) for t in keep) and remembered(ns["u"])


def test_equal_tensors_are_not_confused():
    # Membership is by identity: an equal tensor (or one whose == is elementwise) is not remembered.
    ns = run("x = torch.ones(3).cuda()")
    assert remembered(ns["x"]) and not remembered(torch.ones(3)) and not remembered(ns["x"].clone())


@pytest.mark.parametrize("target", ["meta", None])
def test_no_record_off_a_cpu_target(target):
    forget_all()
    ns = run("x = torch.ones(3, device=dev).to(dev)\ny = torch.zeros(2, device=d2)\nz = torch.ones(2).to(dev)",
             target, {"dev": "cpu" if target is None else torch.device("cuda"), "d2": "cpu"})
    assert not placement_placed._refs
    if target == "meta":
        assert ns["x"].device.type == "meta" and ns["y"].device.type == "cpu"


def test_remember_directly():
    t = torch.ones(2)
    assert not remembered(t)
    remember(t)
    assert remembered(t) and remembered(t[1:]) and not remembered(t + 0)


# -- the rewrite ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src, want", [
    ("torch.zeros(4, device='cuda')", "H.on_cuda(torch.zeros(4, device=H.target or 'cuda'))"),
    ("torch.zeros(4, device=dev)", "H.factory(torch.zeros, 4, device=dev)"),
    ("torch.zeros(4).cuda()", "H.on_cuda(torch.zeros(4, device=H.cuda_target))"),
    ("torch.zeros(4, device='cpu')", "torch.zeros(4, device='cpu')"),
    ("torch.zeros(4)", "torch.zeros(4, device=H.target)"),
    ("torch.as_tensor(t, device='cuda')", "H.factory(torch.as_tensor, t, device='cuda')"),
    ("torch.as_tensor(t).cuda()", "H.cuda(torch.as_tensor(t, device=H.target))"),
    ("torch.cuda.FloatTensor(2, device='cuda')", "H.legacy(torch.cuda.FloatTensor, 2, device='cuda')"),
    ("nn.Linear(2, 2, device=dev)", "H.factory(nn.Linear, 2, 2, device=dev)"),
    ("nn.Linear(2, 2, device='cuda')", "H.on_cuda(nn.Linear(2, 2, device=H.target or 'cuda'))"),
    ("f(device='cuda')", "f(device=H.target or 'cuda')"),
])
def test_the_rewrite_of_factories_given_a_device(src, want):
    got = ast.unparse(rewrite_placement(ast.parse(src), {"torch": torch, "nn": nn})[0])
    assert got == want.replace("H.", HELPER + ".")


def test_factories_given_a_device_pass_through_without_a_target():
    ns = run("a = torch.zeros(2, device=dev)\nb = nn.Linear(2, 2, device=dev)\nc = torch.zeros(2, device='cpu')",
             None, {"dev": "cpu"})
    assert ns["a"].device.type == "cpu" and ns["b"].weight.device.type == "cpu"
