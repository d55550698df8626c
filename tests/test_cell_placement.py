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

from gpumagic.cell.device_values import (
    DeviceName,
    set_process_device,
    settle,
    settle_note,
    stand_in,
    stands_for_cell_device,
)
from gpumagic.cell.rewrite.cuda_calls import HostEvent, HostStream, NoCudaAnswer
from gpumagic.cell.rewrite.helper import (
    HELPER,
    LEGACY_TYPES,
    Placement,
    follow,
    follow_process,
    helper_name,
    install_passthrough,
    made_for,
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


def test_mixed_precision_written_for_cuda_runs_in_the_cpus(recwarn):
    """autocast('cuda') and CUDA's GradScaler would turn themselves off on a CPU (a warning, float32):
    off a GPU they are the CPU's, so the cell computes in the dtype it asked for."""
    ns = run("""
        m = torch.nn.Linear(4, 4).cuda()
        x = torch.randn(2, 4).cuda()
        with torch.autocast('cuda', dtype=torch.bfloat16):
            a = m(x)
        with torch.amp.autocast(device_type='cuda', dtype=torch.bfloat16):
            b = m(x)
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):
            c = m(x)
        scalers = [torch.amp.GradScaler('cuda'), torch.amp.GradScaler(device='cuda'), torch.cuda.amp.GradScaler()]
    """, "cpu")
    assert [ns[k].dtype for k in "abc"] == [torch.bfloat16] * 3
    assert [s._device for s in ns["scalers"]] == ["cpu"] * 3
    assert not [w for w in recwarn if "CUDA is not available" in str(w.message)]
    assert "__gpumagic_device__.amp(torch.autocast, 'cuda'" in rewritten("torch.autocast('cuda')")


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


# -- functions made in a cell follow where they run ----------------------------------------

CELL_FUNCTIONS = """
def make():
    return torch.zeros(2)
def to_gpu(x):
    return x.to('cuda')
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
"""


def made_in_cell(src: str, device: str) -> dict:
    """``src`` as a ``%%ondevice DEVICE`` cell writes it: rewritten for the device's helper name."""
    ns = {"torch": torch, "nn": nn}
    tree, _ = rewrite_placement(ast.parse(textwrap.dedent(src)), ns, helper_name(device))
    ns[helper_name(device)] = made_for(device)
    with follow(device):
        exec(compile(tree, "<cell>", "exec"), ns)
    return ns


def test_functions_made_for_a_device_follow_where_they_run():
    ns = made_in_cell(CELL_FUNCTIONS, "meta")
    assert helper_name("meta") == "__gpumagic_device_meta__" and helper_name("cuda:1") == "__gpumagic_device_cuda_1__"
    # A plain cell: the device they were made for.
    assert on(ns["make"](), "meta") and on(ns["to_gpu"](torch.ones(1)), "meta") and ns["Net"]().fc.weight.is_meta
    with follow("cpu"):                            # a later %%ondevice cpu cell
        assert on(ns["make"](), "cpu") and on(ns["to_gpu"](torch.ones(1)), "cpu")
        assert on(ns["Net"]().fc.weight, "cpu")
        with follow("meta"):                       # nested
            assert on(ns["make"](), "meta")
        assert on(ns["make"](), "cpu")
    assert on(ns["make"](), "meta")
    assert made_for("meta") is ns[helper_name("meta")]


def test_made_for_placement_pickles_as_the_receivers_own():
    placement = made_for("meta")
    assert pickle.loads(pickle.dumps(placement)) is placement    # in the kernel: the same object
    try:
        follow_process("cpu")                     # what a %%dataparallel rank on cpu does at start-up
        assert placement.target == torch.device("cpu")
        assert made_for("cuda:3").target == torch.device("cpu")
        ns = made_in_cell("def make():\n    return torch.zeros(2)\n", "meta")
        assert on(ns["make"](), "cpu")
    finally:
        follow_process(None)
    assert placement.target == torch.device("meta") and made_for("cuda:3").target == torch.device("cuda:3")


# -- values that stand for the cell's device ------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_settle_makes_device_values_hold_the_cells_device(target):
    ns = {"a": "cuda", "b": "cuda:1", "c": torch.device("cuda"), "d": "cpu", "e": torch.device("cpu"),
          "f": 3, "g": DeviceName("cuda"), "h": "cudax"}
    changed = settle(ns, list(ns) + ["missing"], target)
    assert [name for name, _, _ in changed] == ["a", "b", "c", "g"]
    for name in "abcg":
        assert ns[name] == (torch.device(target) if name == "c" else target) and stands_for_cell_device(ns[name])
    assert type(ns["a"]) is DeviceName and isinstance(ns["a"], str) and str(ns["a"]) == target
    assert ns["c"] is stand_in(target) and ns["c"] is not stand_in("cuda:5")
    assert (ns["d"], ns["e"], ns["f"], ns["h"]) == ("cpu", torch.device("cpu"), 3, "cudax")   # said as such
    assert not stands_for_cell_device(ns["d"]) and not stands_for_cell_device(ns["e"])
    assert settle_note(changed, target).startswith(f"after the cell on {target}, a is '{target}' (what 'cuda' meant")


def test_settle_keeps_a_name_that_already_names_the_device():
    ns = {"t": "cuda", "i": "cuda:0"}
    assert settle(ns, ["t", "i"], "cuda:0") == []              # 'cuda' is cuda:0 in the kernel
    assert ns["t"] == "cuda" and type(ns["t"]) is DeviceName and ns["i"] == "cuda:0"
    assert settle(ns, ["t"], "cuda:1") == [("t", "cuda", "cuda:1")]


def test_stand_ins_follow_a_later_cell():
    ns = {"device": DeviceName("cpu"), "dev": stand_in("cpu"), "x": torch.ones(2)}
    out = run("a = x.to(device)\nb = torch.zeros(2, device=dev)\nc = torch.device(device)\n"
              "e = x.to('cpu')\nf = torch.device('cpu')", "meta", ns)
    assert on(out["a"], "meta") and on(out["b"], "meta") and out["c"] == torch.device("meta")
    assert on(out["e"], "cpu") and out["f"] == torch.device("cpu")   # CPU said as such stays CPU
    same = run("a = x.to(device)", "cpu", ns)
    assert same["a"] is ns["x"]          # already there: no copy (a 'cuda' spelling would copy, as .cuda() does)


def test_device_name_travels_as_the_workers_device_and_back():
    name = DeviceName("cpu")
    assert pickle.loads(pickle.dumps(name)) == "cpu"
    try:
        set_process_device("cuda:1")                    # unpickled in a worker on cuda:1
        there = pickle.loads(pickle.dumps(name))
    finally:
        set_process_device(None)
    assert there == "cuda:1" and there.home == "cpu"
    back = pickle.loads(pickle.dumps(there))            # rank 0 returns it to the kernel
    assert back == "cpu" and type(back) is DeviceName


# -- torch.accelerator and the rest of torch.cuda on a device without CUDA ----------------------

@pytest.mark.parametrize("target", TARGETS)
def test_torch_accelerator_follows_the_target(target):
    cuda_before = torch.cuda.is_initialized()
    ns = run("""
        avail = torch.accelerator.is_available()
        acc = torch.accelerator.current_accelerator()
        kind = torch.accelerator.current_accelerator().type
        count = torch.accelerator.device_count()
        index = torch.accelerator.current_device_index()
        torch.accelerator.set_device_index(0)
        torch.accelerator.synchronize()
        with torch.accelerator.device_index(0):
            t = torch.ones(2).to(acc)
        allocated = torch.accelerator.memory_allocated()
        torch.accelerator.empty_cache()
    """, target)
    assert (ns["avail"], ns["count"], ns["index"], ns["allocated"]) == (True, 1, 0, 0)
    assert ns["acc"] == torch.device(target) and stands_for_cell_device(ns["acc"])
    assert ns["kind"] == target and type(ns["kind"]) is DeviceName
    assert on(ns["t"], target)
    assert torch.cuda.is_initialized() == cuda_before


def test_torch_accelerator_passes_through_without_a_target():
    tree, _ = rewrite_placement(ast.parse("a = torch.accelerator.is_available()\n"
                                          "k = torch.accelerator.current_accelerator()\n"
                                          "n = torch.accelerator.device_count()"), {"torch": torch})
    ns = {"torch": torch, HELPER: Placement(None)}
    exec(compile(tree, "<cell>", "exec"), ns)
    assert (ns["a"], ns["k"], ns["n"]) == (torch.accelerator.is_available(), torch.accelerator.current_accelerator(),
                                           torch.accelerator.device_count())


@pytest.mark.parametrize("target", TARGETS)
def test_torch_cuda_queries_answer_for_the_target(target):
    cuda_before = torch.cuda.is_initialized()
    ns = run("""
        name = torch.cuda.get_device_name(0)
        counters = [torch.cuda.memory_allocated(), torch.cuda.memory_reserved(0), torch.cuda.max_memory_allocated(),
                    torch.cuda.memory_cached()]
        stats = torch.cuda.memory_stats()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        a = torch.cuda.FloatTensor([1., 2.])
        where = a.get_device()
        elsewhere = torch.zeros(1, device='cpu').get_device()
    """, target)
    if target == "cpu":
        from gpumagic.devices.facts import cpu_facts
        assert ns["name"] == cpu_facts()["name"]
    else:
        assert ns["name"] == "meta"
    assert ns["counters"] == [0, 0, 0, 0] and ns["stats"] == {}
    assert ns["where"] == 0                                   # a tensor on DEVICE: GPU 0, which DEVICE stands for
    assert ns["elsewhere"] == (0 if target == "cpu" else -1)  # torch's own answer for a CPU tensor
    assert torch.cuda.is_initialized() == cuda_before


def test_torch_cuda_queries_without_an_answer_say_why():
    free, total = run("m = torch.cuda.mem_get_info()", "cpu")["m"]
    assert 0 < free <= total
    for call in ("torch.cuda.get_device_capability()", "torch.cuda.get_device_properties(0)"):
        with pytest.raises(NoCudaAnswer, match=r"has no answer under %%ondevice cpu: it asks about a GPU"):
            run(f"p = {call}", "cpu")
    with pytest.raises(NoCudaAnswer, match=r"torch.cuda.mem_get_info\(\) has no answer under %%ondevice meta"):
        run("m = torch.cuda.mem_get_info()", "meta")


@pytest.mark.parametrize("target", TARGETS)
def test_streams_and_events_on_a_device_without_streams(target):
    # torch's CUDA semantics notes, as the seed article quotes them, then the corrected form.
    ns = run("""
        cuda = torch.device('cuda')
        s = torch.cuda.Stream()  # Create a new stream.
        A = torch.empty((100, 100), device=cuda).normal_(0.0, 1.0)
        with torch.cuda.stream(s):
            # because sum() may start execution before normal_() finishes!
            B = torch.sum(A)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            C = A * 2
        A.record_stream(s)
        torch.cuda.current_stream().wait_stream(s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        D = A @ A
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        default = torch.cuda.default_stream()
    """, target)
    assert isinstance(ns["s"], HostStream) and ns["s"].query() and isinstance(ns["default"], HostStream)
    assert on(ns["B"], target) and on(ns["C"], target) and on(ns["D"], target)
    assert ns["ms"] >= 0
    if target == "cpu":
        assert torch.allclose(ns["B"], ns["A"].sum()) and torch.equal(ns["C"], ns["A"] * 2)
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        HostEvent().elapsed_time(HostEvent())
