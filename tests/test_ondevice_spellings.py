"""CUDA spellings held as values, and magics inside the cell, under %%ondevice on cpu and meta.

Regressions from a test pass: ``.to(device)`` with a CUDA device made in the cell aliased its
source; ``Tensor = torch.cuda.FloatTensor`` aliases crashed; ``%timeit``/``%time`` inside the
cell ran their code unrewritten.
"""
from __future__ import annotations

import ast
import pickle

import pytest
import torch
import torch.nn as nn

from gpumagic.cell.device_values import DeviceName, settle, stand_in, stands_for_cell_device
from gpumagic.cell.rewrite.helper import HELPER, LEGACY_TYPES, Placement, made_for, rewrite_placement
from gpumagic.cell.rewrite.magics import rewrite_magic_code
from gpumagic.devices import visible_gpus
from tests.placement_helpers import cell_ok, run_rewritten

TARGETS = ["cpu", "meta"]
run = run_rewritten
ok = cell_ok


# -- 1. a move that copies on a GPU copies here too -------------------------------------------------

@pytest.mark.parametrize("call", [
    "src.to('cuda')", "src.to(torch.device('cuda'))", "src.to(dev)", "src.to(device=dev)",
    "src.to(device='cuda')", "src.to(device='cuda:0', non_blocking=True)", "src.to(0)", "src.to(device=0)",
    "src.to(torch.device('cuda', 0))", "src.to(torch.device(dev))", "src.to(dev, torch.float32)",
    "src.to(acc)", "src.to(acc_type)", "torch.Tensor.to(src, dev)", "torch.Tensor.to(src, device=dev)",
    "src.cuda()",
])
def test_a_move_to_cuda_copies_a_cpu_tensor(call):
    ns = run(f"""
        src = torch.zeros(3)
        dev = torch.device('cuda:0')
        acc = torch.accelerator.current_accelerator()
        acc_type = torch.accelerator.current_accelerator().type
        moved = {call}
        moved += 1
    """, "cpu")
    assert ns["moved"] is not ns["src"]
    assert ns["src"].tolist() == [0.0, 0.0, 0.0] and ns["moved"].tolist() == [1.0, 1.0, 1.0]


def test_the_repro_cell_leaves_its_source_alone():
    # /tmp/pass_article/repro_to_alias.py
    ns = run("""
        src = torch.zeros(3)
        a = src.to('cuda');               a += 1
        b = src.to(torch.device('cuda')); b += 10
        dev = torch.device('cuda:0')
        c = src.to(dev);                  c += 100
        d = src.to(device=dev);           d += 1000
    """, "cpu")
    assert ns["src"].tolist() == [0.0, 0.0, 0.0]
    assert [ns[n].tolist()[0] for n in "abcd"] == [1.0, 10.0, 100.0, 1000.0]


@pytest.mark.parametrize("call", [
    "src.to('cpu')", "src.to(torch.float32)", "src.to(device='cpu')", "src.to(settled)", "src.to(plain_dev)",
    "src.to(other)",
])
def test_a_move_to_where_the_tensor_is_returns_it(call):
    # Torch returns self for .to(its own device); a device value that holds 'cpu' after a cell is one.
    ns = run(f"moved = {call}", "cpu", {"src": torch.zeros(3), "settled": DeviceName("cpu"),
                                          "plain_dev": stand_in("cpu"), "other": torch.ones(1)})
    assert ns["moved"] is ns["src"]


@pytest.mark.parametrize("target", TARGETS)
def test_modules_move_in_place_whatever_the_spelling(target):
    sq = nn.Linear(2, 2)
    ns = run("dev = torch.device('cuda')\na = sq.to(dev)\nb = sq.to(device=dev)\nc = sq.to(torch.device('cuda:0'))",
             target, {"sq": sq})
    assert ns["a"] is sq and ns["b"] is sq and ns["c"] is sq and sq.weight.device.type == target


def test_to_another_tensor_follows_torch():
    cuda_like = torch.zeros(1, device="meta")   # another device: torch moves (a new tensor)
    ns = run("a = src.to(other)\nb = src.to(same)", "cpu",
             {"src": torch.zeros(3), "other": cuda_like, "same": torch.ones(1)})
    assert ns["a"].device.type == "meta" and ns["b"] is ns["src"]


def test_a_cuda_device_made_in_the_cell_still_settles_and_follows():
    ns = run("dev = torch.device('cuda')\nacc = torch.accelerator.current_accelerator()", "cpu")
    for name in ("dev", "acc"):
        assert ns[name] == torch.device("cpu") and stands_for_cell_device(ns[name])
    settle(ns, ["dev", "acc"], "cpu")
    assert ns["dev"] is stand_in("cpu") and ns["acc"] is stand_in("cpu")
    later = run("a = x.to(dev)\nb = torch.zeros(1, device=dev)", "meta", {"x": torch.ones(1), "dev": ns["dev"]})
    assert later["a"].device.type == "meta" and later["b"].device.type == "meta"


@pytest.mark.skipif(bool(visible_gpus()), reason="bare %%ondevice means cuda:0 here, where torch's .to returns self")
def test_bare_ondevice_on_a_cpu_only_machine_copies_too(shell):
    ok(shell, "import torch")
    ok(shell, "%%ondevice\nsrc = torch.zeros(3)\nb = src.to(torch.device('cuda')); b += 10\n"
              "dev = torch.device('cuda:0')\nc = src.to(dev); c += 100\nd = src.to(device=dev); d += 1000")
    ns = shell.user_ns
    assert ns["src"].tolist() == [0.0, 0.0, 0.0] and [ns[n][0].item() for n in "bcd"] == [10.0, 100.0, 1000.0]


# -- 2. torch.cuda.<Type>Tensor held as a value --------------------------------------------------------

DTYPES = {
    "FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
    "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8, "BoolTensor": torch.bool,
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", LEGACY_TYPES)
def test_typed_tensor_aliases_make_tensors_on_the_target(target, kind):
    ns = run(f"""
        use_cuda = torch.cuda.is_available()
        Tensor = torch.cuda.{kind} if use_cuda else torch.{kind}
        filled = Tensor(2, 1).fill_(1)
        data = Tensor([1, 0])
        retyped = torch.ones(3).type(Tensor)
        is_it = isinstance(data, Tensor)
        is_it_direct = isinstance(data, torch.cuda.{kind})
        is_not = isinstance(torch.ones(1, dtype=torch.complex64, device='{target}'), Tensor)
    """, target)
    want = DTYPES[kind]
    for name, shape in [("filled", (2, 1)), ("data", (2,)), ("retyped", (3,))]:
        t = ns[name]
        assert t.device.type == target and t.dtype == want and tuple(t.shape) == shape, name
    assert ns["is_it"] is True and ns["is_it_direct"] is True and ns["is_not"] is False
    if target == "cpu":
        assert ns["filled"].tolist() == torch.ones(2, 1, dtype=want).tolist()


def test_the_repro_aliases_run_on_cpu():
    # /tmp/pass_article/repro_type_alias.py
    ns = run("""
        dtype = torch.cuda.FloatTensor
        a = torch.randn(3).type(dtype)
        LT = torch.cuda.LongTensor
        b = LT([1, 2])
        from torch.cuda import HalfTensor
        c = isinstance(HalfTensor(2), HalfTensor)
        d = torch.cuda.FloatTensor([1.0])
    """, "cpu")
    assert ns["a"].dtype == torch.float32 and ns["a"].device.type == "cpu"
    assert ns["b"].dtype == torch.int64 and ns["b"].tolist() == [1, 2]
    assert ns["c"] is True and ns["d"].tolist() == [1.0]


def test_typed_tensor_alias_passes_through_without_a_target():
    tree, _ = rewrite_placement(ast.parse("T = torch.cuda.FloatTensor\nk = x.type('torch.FloatTensor')"), {})
    ns = {"torch": torch, "x": torch.ones(1, dtype=torch.int64), HELPER: Placement(None)}
    exec(compile(tree, "<cell>", "exec"), ns)
    assert ns["T"] is torch.cuda.FloatTensor and ns["k"].dtype == torch.float32


def test_typed_tensor_alias_rewrite_leaves_calls_and_cpu_types_alone():
    src = ast.unparse(rewrite_placement(ast.parse(
        "a = torch.cuda.FloatTensor(2)\nb = x.type(torch.cuda.HalfTensor)\nT = torch.FloatTensor\n"
        "c = x.type(torch.float16)\nd = x.type()\nt = torch.cuda.FloatTensor"), {})[0])
    assert src.count("tensor_type(") == 1 and "legacy(torch.cuda.FloatTensor, 2)" in src
    assert "retype(x, torch.cuda.HalfTensor)" in src and "T = torch.FloatTensor" in src
    assert "c = x.type(torch.float16)" in src
    assert f"d = {HELPER}.type_name(x)" in src   # the type's name answers for DEVICE (test_ondevice_tensor_type)


def test_a_typed_tensor_alias_follows_where_it_runs_and_pickles():
    helper = made_for("cpu")
    ns = {"torch": torch, helper_name_of(helper): helper}
    tree, _ = rewrite_placement(ast.parse("T = torch.cuda.DoubleTensor"), ns, helper_name_of(helper))
    exec(compile(tree, "<cell>", "exec"), ns)
    alias = ns["T"]
    assert alias(2).device.type == "cpu" and alias(2).dtype == torch.float64
    again = pickle.loads(pickle.dumps(alias))
    assert again(1).dtype == torch.float64
    assert "DoubleTensor" in repr(alias)


def helper_name_of(placement) -> str:
    from gpumagic.cell.rewrite.helper import helper_name
    return helper_name(placement.made_for)


# -- 3. %time, %timeit and %prun inside the cell --------------------------------------------------------

def _rewrite(code: str) -> str:
    return ast.unparse(rewrite_placement(ast.parse(code), {})[0])


@pytest.mark.parametrize("magic, line, kept", [
    ("timeit", "-n 3 -r 1 model(x.cuda())", "-n 3 -r 1 "),
    ("timeit", "-n3 -qo y = x.cuda()", "-n3 -qo "),
    ("timeit", "-- x.cuda()", "-- "),
    ("time", "y = torch.ones(2).cuda()", ""),
    ("time", "--no-raise-error x.cuda()", "--no-raise-error "),
    ("prun", "-q -l 5 -s cumulative x.cuda()", "-q -l 5 -s cumulative "),
])
def test_magic_code_is_rewritten_after_its_options(magic, line, kept):
    code = _rewrite(f"get_ipython().run_line_magic({magic!r}, {line!r})")
    new = ast.literal_eval(code[code.index(", ") + 2:-1])
    assert new.startswith(kept) and HELPER in new and ".cuda()" not in new


@pytest.mark.parametrize("magic, line", [
    ("timeit", "-x y.cuda()"),          # an option the magic does not know: its own error, unchanged
    ("timeit", "-n"),                   # no code
    ("time", "x.cuda(  "),              # not Python: the magic reports it
    ("time", "for i in r: x.cuda()"),   # would not stay one line
    ("who", "x.cuda()"),                # not a magic that runs code
    ("timeit", "y = x + 1"),            # nothing to rewrite: untouched, spacing kept
])
def test_magic_code_left_as_is(magic, line):
    code = f"get_ipython().run_line_magic({magic!r}, {line!r})"
    assert _rewrite(code) == ast.unparse(ast.parse(code))


def test_cell_magic_bodies_are_rewritten():
    code = _rewrite("get_ipython().run_cell_magic('timeit', '-n 1 z = x.cuda()', 'y = z.cuda()\\n')")
    line, body = ast.literal_eval(code[code.index("('timeit', ") + 11:-1])
    assert HELPER in line and HELPER in body and line.startswith("-n 1 ")
    assert rewrite_magic_code("time", "", "y = 1\n", lambda tree: 0) is None


def test_line_magics_inside_the_cell_run_on_the_device(shell):
    # /tmp/pass_article/repro_line_magic.py
    ok(shell, "import torch, torch.nn as nn")
    _, out = ok(shell, "%%ondevice cpu\nmodel = nn.Linear(20, 4).cuda()\nx = torch.randn(64, 20).cuda()\n"
                       "%timeit -n 3 -r 1 model(x.cuda())\n%time y = torch.ones(2).cuda()\n"
                       "%prun -q z = x.cuda().sum()\nw = y.cuda()")
    ns = shell.user_ns
    assert "loops each" in out and "Wall time" in out
    assert ns["y"].device.type == "cpu" and ns["z"].device.type == "cpu"
    assert ns["w"] is ns["y"]   # y is on (stand-in) CUDA already: .cuda() returns it, as on a GPU


def test_cell_magic_inside_the_cell_runs_on_the_device(shell):
    ok(shell, "import torch")
    _, out = ok(shell, "%%ondevice meta\n%%time\ny = torch.ones(2).cuda()\nt = torch.cuda.FloatTensor\nk = t(3)")
    assert shell.user_ns["y"].device.type == "meta" and shell.user_ns["k"].device.type == "meta"
    assert "Wall time" in out


def test_the_repro_alias_cells_through_the_magic(shell):
    ok(shell, "import torch\nuse_cuda = torch.cuda.is_available()\n"
              "Tensor = torch.cuda.FloatTensor if use_cuda else torch.FloatTensor")
    ok(shell, "%%ondevice cpu\nuse_cuda = torch.cuda.is_available()\n"
              "Tensor = torch.cuda.FloatTensor if use_cuda else torch.FloatTensor\nt = Tensor(2, 1).fill_(1.0)\n"
              "dtype = torch.cuda.FloatTensor\nu = torch.randn(3).type(dtype)\n"
              "LT = torch.cuda.LongTensor\nv = LT([1, 2])")
    ns = shell.user_ns
    assert ns["t"].tolist() == [[1.0], [1.0]] and ns["u"].dtype == torch.float32 and ns["v"].tolist() == [1, 2]
    # a later plain cell: the alias still makes tensors on the cell's device
    ok(shell, "w = Tensor(1)\nok_ = isinstance(w, Tensor)")
    assert ns["w"].device.type == "cpu" and ns["ok_"] is True


def test_a_name_that_held_a_cuda_type_and_now_holds_a_tensor():
    ns = run("T = torch.ones(2)\nk = T.sum()\nt = isinstance(T, torch.Tensor)", "cpu", {"T": torch.cuda.FloatTensor})
    assert ns["k"].item() == 2.0 and ns["t"] is True


def test_magic_code_sees_the_cells_imports_and_keeps_its_semicolon():
    code = _rewrite("import torch as th\nget_ipython().run_line_magic('time', 'y = th.zeros(2).cuda();')")
    new = ast.literal_eval(code[code.index("('time', ") + 9:-1])
    assert new.startswith("y = ") and "on_cuda(th.zeros(2, device=" in new and new.endswith(";")


# -- on a real GPU: the classes themselves, and torch's own moves --------------------------------------

@pytest.mark.gpu
def test_on_a_gpu_the_aliases_are_the_real_classes_and_moves_follow_torch():
    ns = run("""
        src = torch.zeros(3)
        same = src.to(torch.device('cuda'))
        dev = torch.device('cuda:0')
        same2 = src.to(device=dev)
        moved = host.to(dev)
        T = torch.cuda.FloatTensor
        t = T(2)
        u = torch.ones(2, dtype=torch.int64).type(T)
        is_it = isinstance(t, T)
    """, "cuda:0", {"host": torch.zeros(2)})
    assert ns["same"] is ns["src"] and ns["same2"] is ns["src"] and ns["src"].device == torch.device("cuda:0")
    assert ns["moved"].device == torch.device("cuda:0") and ns["host"].device.type == "cpu"
    assert ns["T"] is torch.cuda.FloatTensor and ns["is_it"] is True
    assert ns["t"].device == torch.device("cuda:0") and ns["u"].dtype == torch.float32 and ns["u"].is_cuda


@pytest.mark.gpu
def test_on_a_gpu_magics_in_a_cell_and_a_cpu_cell_beside_cuda(shell):
    ok(shell, "import torch")
    ok(shell, "%%ondevice cuda:0\nT = torch.cuda.FloatTensor\nt = T(2)\n%time y = torch.ones(2).cuda()\n"
              "%timeit -n 1 -r 1 z = y.to(torch.device('cuda'))")
    ns = shell.user_ns
    assert ns["T"] is torch.cuda.FloatTensor and ns["t"].is_cuda and ns["y"].device == torch.device("cuda:0")
    ok(shell, "%%ondevice cpu\nsrc = torch.zeros(3)\nc = src.to(torch.device('cuda'))\nc += 1\n"
              "L = torch.cuda.LongTensor\nv = L([1, 2])\n%time w = torch.ones(2).cuda()")
    assert ns["src"].tolist() == [0.0, 0.0, 0.0] and ns["c"].device.type == "cpu"
    assert ns["v"].device.type == "cpu" and ns["v"].dtype == torch.int64 and ns["w"].device.type == "cpu"
