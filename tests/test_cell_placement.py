"""The placement rewrite and its runtime, without IPython: every CUDA spelling on cpu and meta."""
from __future__ import annotations

import ast
import io
import pickle
import textwrap
import traceback

import numpy as np
import pytest
import torch
import torch.nn as nn

from gpumagic.cell.placement import (
    HELPER,
    LEGACY_TYPES,
    Placement,
    install_passthrough,
    modules_on,
    passthrough,
    rewrite_placement,
)

TARGETS = ["cpu", "meta"]
DTYPES = {
    "FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
    "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8, "BoolTensor": torch.bool,
}


def rewritten(src: str, ns: dict | None = None) -> str:
    tree, _ = rewrite_placement(ast.parse(textwrap.dedent(src)), ns)
    return ast.unparse(tree)


def run(src: str, target, ns: dict | None = None) -> dict:
    """Rewrite and run ``src`` with the helper bound to ``Placement(target)``; returns the namespace."""
    ns = {"torch": torch, "nn": nn, "np": np, **(ns or {})}
    tree, _ = rewrite_placement(ast.parse(textwrap.dedent(src)), ns)
    ns[HELPER] = Placement(target)
    exec(compile(tree, "<cell>", "exec"), ns)
    return ns


def on(t, target):
    return t.device == torch.device(target)


# -- moving --------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("call", [
    "x.cuda()", "x.cuda(0)", "x.cuda(1)", "x.cuda(device=0)", "x.cuda(non_blocking=True)",
    "x.cuda(cuda1)", "x.to('cuda')", "x.to('cuda:0')", "x.to('cuda:1')", "x.to(torch.device('cuda'))",
    "x.to(cuda1)", "x.to(0)", "x.to(device='cuda')", "x.to(device=cuda1, non_blocking=True)",
    "torch.Tensor.cuda(x)", "torch.Tensor.to(x, 'cuda')",
])
def test_tensor_moves_land_on_target(target, call):
    ns = run(f"y = {call}", target, {"x": torch.tensor([1.0, 2.0]), "cuda1": torch.device("cuda:1")})
    assert on(ns["y"], target)
    assert ns["y"].dtype == torch.float32 and ns["y"].shape == (2,)
    if target == "cpu":
        assert ns["y"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("target", TARGETS)
def test_to_keeps_dtype_and_other_tensor_form(target):
    ns = run("""
        a = x.to('cuda', dtype=torch.float16)
        b = x.to('cuda:0', torch.float64)
        c = x.to(torch.float16)
        d = x.to(other)
    """, target, {"x": torch.tensor([1.0, 2.0]), "other": torch.zeros(1, dtype=torch.int32)})
    assert on(ns["a"], target) and ns["a"].dtype == torch.float16
    assert on(ns["b"], target) and ns["b"].dtype == torch.float64
    assert ns["c"].device.type == "cpu" and ns["c"].dtype == torch.float16   # dtype only: untouched
    assert ns["d"].device.type == "cpu" and ns["d"].dtype == torch.int32     # a CPU tensor's device


def test_dtype_only_to_is_not_rewritten():
    assert rewritten("y = x.to(torch.float16)") == "y = x.to(torch.float16)"
    assert rewritten("y = x.to(dtype=torch.half, non_blocking=True)") == "y = x.to(dtype=torch.half, non_blocking=True)"
    assert HELPER in rewritten("y = x.to(d)")


def test_cuda_copy_keeps_cpu_original_intact():
    # ``.cuda()`` of a CPU tensor is a new tensor on the GPU; on a CPU target it must stay a copy.
    ns = run("y = x.cuda()\ny.add_(1)\nz = x.to('cuda')\nz.mul_(10)", "cpu", {"x": torch.tensor([1.0, 2.0])})
    assert ns["x"].tolist() == [1.0, 2.0]
    assert ns["y"].tolist() == [2.0, 3.0]
    assert ns["z"].tolist() == [10.0, 20.0]


@pytest.mark.parametrize("target", TARGETS)
def test_module_cuda_moves_in_place(target):
    sq = nn.Sequential(nn.Linear(20, 20), nn.ReLU(), nn.Linear(20, 4), nn.Softmax(dim=1))
    ns = run("model = sq.cuda()\nm2 = sq.to('cuda:0')\nflag = next(model.parameters()).is_cuda", target, {"sq": sq})
    assert ns["model"] is sq and ns["m2"] is sq
    assert all(on(p, target) for p in sq.parameters())
    assert ns["flag"] is True


# -- devices -------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("expr", [
    "torch.device('cuda')", "torch.device('cuda', 0)", "torch.device('cuda:1')",
    "torch.device(type='cuda', index=1)", "device('cuda')", "th.device('cuda:0')",
])
def test_torch_device_cuda_is_target(target, expr):
    ns = run(f"import torch as th\nd = {expr}", target, {"device": torch.device})
    assert ns["d"] == torch.device(target)


def test_torch_device_cpu_stays_cpu():
    assert run("d = torch.device('cpu')", "meta")["d"] == torch.device("cpu")


@pytest.mark.parametrize("target", TARGETS)
def test_device_keywords_of_any_call(target):
    ns = run("""
        def f(x, device=None):
            return device
        a = torch.zeros(2, device='cuda:0')
        b = torch.ones(2, device=0)
        c = torch.randn(2, device=dev)
        d = f(1, device='cuda')
        e = f(1, device=dev)
        g = torch.zeros(2, device='cpu')
        h = torch.Tensor([1., 2.], device=cuda1)
    """, target, {"dev": torch.device("cuda", 0), "cuda1": torch.device("cuda:1")})
    for name in "abc":
        assert on(ns[name], target), name
    assert ns["d"] == torch.device(target) and ns["e"] == torch.device(target)
    assert ns["g"].device.type == "cpu"  # explicit CPU placement is left alone
    assert on(ns["h"], target) and ns["h"].dtype == torch.get_default_dtype()


def test_map_location_follows_target():
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buf)
    data = buf.getvalue()
    ns = run("a = torch.load(io.BytesIO(data), map_location='cuda:0')\nb = torch.load(io.BytesIO(data), dev)",
             "cpu", {"io": io, "data": data, "dev": torch.device("cuda")})
    assert ns["a"]["w"].tolist() == [0.0, 1.0, 2.0] and ns["b"]["w"].device.type == "cpu"


# -- legacy typed constructors ------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", LEGACY_TYPES)
def test_legacy_cuda_constructors(target, kind):
    ns = run(f"""
        data = torch.cuda.{kind}([1, 0, 1])
        sized = torch.cuda.{kind}(2, 3)
        sized2 = torch.cuda.{kind}(torch.Size([4]))
        empty = torch.cuda.{kind}()
        arr = torch.cuda.{kind}(np.array([1, 1]))
        folded = torch.{kind}([1, 0]).cuda()
    """, target)
    want = DTYPES[kind]
    for name, shape in [("data", (3,)), ("sized", (2, 3)), ("sized2", (4,)), ("empty", (0,)),
                        ("arr", (2,)), ("folded", (2,))]:
        t = ns[name]
        assert on(t, target) and t.dtype == want and tuple(t.shape) == shape, name
    if target == "cpu":
        assert ns["data"].tolist() == torch.tensor([1, 0, 1], dtype=want).tolist()
        assert ns["folded"].tolist() == torch.tensor([1, 0], dtype=want).tolist()


def test_cpu_constructor_then_cuda_allocates_directly():
    src = rewritten("a = torch.FloatTensor([1., 2.]).cuda()\nb = torch.zeros(8).cuda(non_blocking=True)")
    assert ".cuda(" not in src and "legacy_cuda" in src and "cuda_target" in src


def test_legacy_tensor_from_tensor_and_retype():
    ns = run("""
        a = torch.cuda.DoubleTensor(x)
        b = x.type(torch.cuda.HalfTensor)
        c = x.type('torch.cuda.LongTensor')
        d = torch.DoubleTensor([1., 2.])
    """, "meta", {"x": torch.tensor([1.0, 2.0])})
    assert on(ns["a"], "meta") and ns["a"].dtype == torch.float64
    assert on(ns["b"], "meta") and ns["b"].dtype == torch.float16
    assert on(ns["c"], "meta") and ns["c"].dtype == torch.int64
    assert ns["d"].device.type == "cpu"   # a CPU constructor without .cuda() stays on the CPU


# -- factories and modules -----------------------------------------------------------------

@pytest.mark.parametrize("expr", [
    "torch.zeros(2, 3)", "torch.ones(4)", "torch.empty(2)", "torch.full((2,), 1.5)", "torch.rand(3)",
    "torch.randn(3)", "torch.randint(0, 10, (3,))", "torch.arange(5)", "torch.linspace(0, 1, 5)",
    "torch.eye(3)", "torch.tensor([1, 2])", "torch.randperm(4)", "torch.as_tensor([1.0])",
    "zeros(2)",
])
def test_factories_allocate_on_target(expr):
    ns = run(f"t = {expr}", "meta", {"zeros": torch.zeros})
    assert on(ns["t"], "meta")


def test_factory_with_generator_or_out_keeps_its_device():
    ns = run("g = torch.Generator().manual_seed(0)\na = torch.randn(3, generator=g)\n"
             "o = torch.empty(3)\nb = torch.zeros(3, out=o)", "meta")
    assert ns["a"].device.type == "cpu" and ns["b"] is ns["o"]


def test_like_factories_follow_input():
    ns = run("a = torch.zeros_like(x)\nb = torch.ones_like(torch.zeros(2))", "meta", {"x": torch.ones(2)})
    assert ns["a"].device.type == "cpu"   # input on the CPU: follows it, as torch's default device does
    assert on(ns["b"], "meta")


@pytest.mark.parametrize("target", TARGETS)
def test_nn_constructors_get_device(target):
    ns = run("""
        from torch import nn as tnn
        lin = nn.Linear(4, 3)
        seq = nn.Sequential(nn.Linear(20, 20), nn.ReLU(), tnn.Linear(20, 4))
        lstm = nn.LSTM(4, 8)
        emb = torch.nn.Embedding(10, 3)
        bn = nn.BatchNorm1d(3)
    """, target)
    for name in ("lin", "seq", "lstm", "emb", "bn"):
        tensors = list(ns[name].parameters()) + list(ns[name].buffers())
        assert tensors and all(on(t, target) for t in tensors), name
    src = rewritten("r = nn.ReLU()\nl = nn.Linear(2, 2)", {"nn": nn})
    assert "ReLU()" in src and "Linear(2, 2, device=" in src


def test_modules_built_elsewhere_land_on_target():
    class Tied(nn.Module):   # defined outside the rewritten code, as in an earlier cell
        def __init__(self):
            super().__init__()
            w = nn.Parameter(torch.randn(3, 3))
            self.a = nn.Linear(3, 3)
            self.register_parameter("w1", w)
            self.register_parameter("w2", w)
            self.register_buffer("steps", torch.zeros(1))

    with modules_on("meta"):
        model = Tied()
    assert all(on(t, "meta") for t in list(model.parameters()) + list(model.buffers()))
    assert model.w1 is model.w2   # tied stays tied
    after = Tied()
    assert after.a.weight.device.type == "cpu"   # the hooks are gone


# -- torch.cuda calls ----------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_torch_cuda_calls_run_without_cuda(target):
    cuda_before = torch.cuda.is_initialized()
    ns = run("""
        avail = torch.cuda.is_available()
        count = torch.cuda.device_count()
        torch.cuda.set_device(0)
        cur = torch.cuda.current_device()
        torch.cuda.synchronize()
        with torch.cuda.device(0):
            t = torch.ones(2).cuda()
        flag = t.is_cuda
        p = torch.zeros(2).pin_memory()
        e = torch.empty(2, pin_memory=True)
    """, target)
    assert (ns["avail"], ns["count"], ns["cur"], ns["flag"]) == (True, 1, 0, True)
    assert on(ns["t"], target)
    assert torch.cuda.is_initialized() == cuda_before


# -- hygiene -------------------------------------------------------------------------------

def test_rewrite_keeps_line_numbers():
    src = ("import torch\n\nx = torch.zeros(2)\ny = (x.cuda()\n     .to('cuda'))\n"
           "z = torch.cuda.FloatTensor(\n    [1., 2.])\n")
    tree, rewriter = rewrite_placement(ast.parse(src), {"torch": torch})
    assert rewriter.rewrites >= 4 and not rewriter.nested
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            assert node.lineno in (1, 3, 4, 6)
        if isinstance(node, ast.Name) and node.id == HELPER:
            assert node.lineno in (3, 4, 5, 6)
    ns = {"torch": torch, HELPER: Placement("cpu")}
    exec(compile(tree, "<cell>", "exec"), ns)
    bad = compile(rewrite_placement(ast.parse("x = 1\n\ny = None.cuda()\n"))[0], "<cell>", "exec")
    with pytest.raises(AttributeError) as info:
        exec(bad, {HELPER: Placement("cpu")})
    user_frames = [f for f in traceback.extract_tb(info.value.__traceback__) if f.filename == "<cell>"]
    assert user_frames[-1].lineno == 3
    assert "'NoneType' object has no attribute 'cuda'" in str(info.value)


def test_names_not_torch_are_left_alone():
    ns = {"torch": torch, "device": "not torch"}
    assert rewritten("d = device('cuda')", ns) == "d = device('cuda')"
    assert "zeros(2)" in rewritten("zeros = lambda n: n\nzeros(2)", {})


@pytest.mark.cuda_if_present
def test_functions_from_a_cell_pass_through_afterwards():
    src = "def make():\n    return torch.zeros(2)\ndef to_gpu(x):\n    return x.cuda()\n"
    tree, rewriter = rewrite_placement(ast.parse(src), {"torch": torch})
    assert rewriter.nested
    ns = {"torch": torch, HELPER: Placement("meta")}
    install_passthrough()
    exec(compile(tree, "<cell>", "exec"), ns)
    assert on(ns["make"](), "meta")
    del ns[HELPER]                                  # the cell is over
    assert ns["make"]().device.type == "cpu"        # as written: the default device
    if torch.cuda.is_available():
        assert ns["to_gpu"](torch.zeros(1)).is_cuda     # as written: on the current GPU
    else:
        with pytest.raises((AssertionError, RuntimeError)):
            ns["to_gpu"](torch.zeros(1))            # as written: needs CUDA, this machine has none
    ns[HELPER] = Placement("meta")                  # a later %%ondevice meta cell
    assert on(ns["to_gpu"](torch.zeros(1)), "meta")


def test_placement_pickles_as_passthrough():
    clone = pickle.loads(pickle.dumps(Placement("meta")))
    assert clone is passthrough() and clone.target is None
    assert clone.map("cuda:3") == "cuda:3"
