"""%%ondevice through a real InteractiveShell, on cpu and meta."""
from __future__ import annotations

import ast
import re

import pytest
import torch

from gpumagic import session
from gpumagic.cell.rewrite.helper import HELPER, helper_name
from gpumagic.devices import visible_gpus
from gpumagic.errors import UsageError
from tests.conftest import run_cell

HAS_GPU = bool(visible_gpus())   # through NVML: asking never initialises CUDA
ANSI = re.compile(r"\x1b\[[0-9;]*m")

SEED = """\
import torch
import torch.nn as nn
sq = nn.Sequential(nn.Linear(20, 20), nn.ReLU(), nn.Linear(20, 4), nn.Softmax(dim=1))
cuda1 = torch.device('cuda:1')
"""


def text(output: str) -> str:
    return ANSI.sub("", output)


def ok(shell, src):
    result, out, _ = run_cell(shell, src)
    assert result.error_before_exec is None and result.error_in_exec is None, text(out)
    return result, text(out)


def fails(shell, src):
    result, out, _ = run_cell(shell, src)
    err = result.error_in_exec or result.error_before_exec
    assert err is not None, text(out)
    return err, text(out), result


# -- the seed article's cells -------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_seed_examples_run(shell, device):
    cuda_before = torch.cuda.is_initialized()
    ok(shell, SEED)
    result, out = ok(shell, f"""%%ondevice {device}
a = torch.FloatTensor([1., 2.]).cuda()
b = torch.cuda.FloatTensor([1., 2.])
d = torch.DoubleTensor([1., 2.]).cuda()
model = sq.cuda()
x = torch.Tensor([1., 2.]).to(cuda1)
y = torch.Tensor([3., 4.]).cuda(cuda1)
z = x + y
cuda = torch.device('cuda')
w = torch.Tensor([1., 2.], device=cuda1)
print(torch.cuda.current_device(), next(model.parameters()).is_cuda)
z
""")
    ns = shell.user_ns
    for name in ("a", "b", "d", "x", "y", "z", "w"):
        assert ns[name].device == torch.device(device), name
    assert ns["a"].dtype == torch.float32 and ns["d"].dtype == torch.float64
    assert ns["model"] is ns["sq"] and all(p.device.type == device for p in ns["sq"].parameters())
    assert ns["cuda"] == torch.device(device)
    assert "0 True" in out
    assert result.result is ns["z"]
    if device == "cpu":
        assert ns["z"].tolist() == [4.0, 6.0] and ns["b"].tolist() == [1.0, 2.0]
        assert ns["model"](torch.ones(3, 20)).shape == (3, 4)
    assert torch.cuda.is_initialized() == cuda_before   # the torch.cuda calls never started CUDA


ARTICLE_QUERIES = """%%ondevice {device}
import torch
torch.cuda.is_available()
# True
torch.cuda.current_device()
# 0
name = torch.cuda.get_device_name(0) # Get name device with ID '0'
# Returns the current GPU memory usage by
# tensors in bytes for a given device
allocated = torch.cuda.memory_allocated()
# Returns the current GPU memory managed by the
# caching allocator in bytes for a given device
cached = torch.cuda.memory_cached()
torch.cuda.empty_cache()
a = torch.cuda.FloatTensor([1., 2.])
index = a.get_device()
torch.cuda.set_device(2) # where '2' is Id of device
import os
os.environ["CUDA_VISIBLE_DEVICES"] = "0,2"
"""

ARTICLE_STREAM = """%%ondevice {line}
cuda = torch.device('cuda')
s = torch.cuda.Stream()  # Create a new stream.
A = torch.empty((100, 100), device=cuda).normal_(0.0, 1.0)
with torch.cuda.stream(s):
    # because sum() may start execution before normal_() finishes!
    B = torch.sum(A)
"""


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_seed_article_queries_as_written(shell, device, monkeypatch):
    monkeypatch.setitem(__import__("os").environ, "CUDA_VISIBLE_DEVICES", "")   # the cell sets it
    cuda_before = torch.cuda.is_initialized()
    ok(shell, ARTICLE_QUERIES.format(device=device))
    ns = shell.user_ns
    if device == "cpu":
        from gpumagic.devices.facts import cpu_facts
        assert ns["name"] == cpu_facts()["name"]          # the CPU's own name
    else:
        assert ns["name"] == "meta"
    assert (ns["allocated"], ns["cached"], ns["index"]) == (0, 0, 0)
    assert ns["a"].device.type == device
    assert torch.cuda.is_initialized() == cuda_before


@pytest.mark.parametrize("line", ["cpu", "meta", "cpu --stream", "meta --stream --sync"])
def test_seed_article_stream_snippet_as_written(shell, line):
    ok(shell, "import torch")
    _, out = ok(shell, ARTICLE_STREAM.format(line=line))
    ns = shell.user_ns
    device = line.split()[0]
    assert ns["B"].device.type == device and ns["A"].device.type == device
    assert repr(ns["s"]) == f"<HostStream on {device}: runs in program order>"
    if device == "cpu":
        assert torch.allclose(ns["B"], ns["A"].sum())
    said = f"--stream: {device} runs the cell's work in program order, so there is no stream to order"
    assert (said in out) == ("--stream" in line)
    assert "after the cell" not in out       # torch.device('cuda') was rewritten: cuda already holds DEVICE
    assert ns["cuda"] == torch.device(device)


def test_a_cuda_query_without_an_answer_says_why_at_the_users_line(shell):
    ok(shell, "import torch")
    err, out, result = fails(shell, "%%ondevice cpu\nx = 1\ncap = torch.cuda.get_device_capability()\n")
    assert type(err).__name__ == "NoCudaAnswer" and isinstance(err, RuntimeError)
    assert str(err) == ("torch.cuda.get_device_capability() has no answer under %%ondevice cpu: it asks about a GPU, "
                        "and cpu is not one. Run the cell on a GPU (%%ondevice cuda:0), or leave the call out of it.")
    assert f"Cell In[{result.execution_count}], line 3" in out and "gpumagic" not in out


def test_device_values_hold_the_cells_device_afterwards(shell):
    ok(shell, "import torch")
    _, out = ok(shell, '%%ondevice cpu\ndevice = "cuda" if torch.cuda.is_available() else "cpu"\n'
                       'inside = device\ngpu = torch.device("cuda:0")\nexplicit = "cpu"\n')
    ns = shell.user_ns
    assert ns["inside"] == "cpu" and ns["device"] == "cpu" and ns["gpu"] == torch.device("cpu")
    assert ("after the cell on cpu, device is 'cpu' (what 'cuda' meant in it); "
            "inside is 'cpu' (what 'cuda' meant in it)\n") in out
    ok(shell, "x = torch.ones(2).to(device)\ny = torch.zeros(1, device=gpu)")   # a plain cell
    assert ns["x"].device.type == "cpu" and ns["y"].device.type == "cpu"
    ok(shell, "%%ondevice meta\nz = torch.ones(2).to(device)\nw = torch.ones(1, device=explicit)\n")
    assert ns["z"].is_meta and ns["w"].device.type == "cpu"     # the cell's device; CPU said as such
    assert ns["device"] == "cpu"                                  # not rebound by the meta cell


def test_no_rewrite_leaves_device_values_alone(shell):
    ok(shell, "%%ondevice meta --no-rewrite\ndevice = 'cuda'\n")
    assert shell.user_ns["device"] == "cuda" and type(shell.user_ns["device"]) is str


def test_factories_and_modules_on_meta(shell):
    ok(shell, "import torch\nimport torch.nn as nn\n"
              "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
              "        self.fc = nn.Linear(8, 2)\n        self.register_buffer('seen', torch.zeros(1))\n")
    ok(shell, "%%ondevice meta\nt = torch.zeros(4)\nr = torch.randn(2, 2)\nlin = nn.Linear(3, 3)\nnet = Net()\n")
    ns = shell.user_ns
    assert ns["t"].is_meta and ns["r"].is_meta and ns["lin"].weight.is_meta
    # Net was defined in a plain cell, so the rewrite never saw its nn.Linear: the hooks place it.
    assert ns["net"].fc.weight.is_meta and ns["net"].seen.is_meta
    ok(shell, "after = Net()\nplain = torch.zeros(1)")
    assert ns["after"].fc.weight.device.type == "cpu" and ns["plain"].device.type == "cpu"


def test_no_rewrite_keeps_only_the_device_context(shell):
    ok(shell, "import torch")
    ok(shell, "%%ondevice meta --no-rewrite\nt = torch.zeros(2)\nd = torch.device('cuda')\n")
    assert shell.user_ns["t"].is_meta                       # default device
    assert shell.user_ns["d"] == torch.device("cuda")       # not rewritten
    assert torch.get_default_device() == torch.device("cpu")
    if HAS_GPU:
        ok(shell, "%%ondevice cpu --no-rewrite\nx = torch.zeros(2).cuda()\n")
        assert shell.user_ns["x"].is_cuda                     # .cuda() as written
    else:
        err, out, _ = fails(shell, "%%ondevice cpu --no-rewrite\nx = torch.zeros(2).cuda()\n")
        assert isinstance(err, (AssertionError, RuntimeError))  # .cuda() as written needs CUDA


# -- behaving like a normal cell ------------------------------------------------------

def test_last_expression_is_displayed(shell):
    result, out = ok(shell, "%%ondevice cpu\nx = 20\nx + 22\n")
    assert result.result == 42
    assert re.search(r"Out\[\d+\]: 42", out)
    result, out = ok(shell, "%%ondevice cpu\nx = 20\nx + 22;\n")
    assert "42" not in out


def test_traceback_points_at_user_line(shell):
    ok(shell, "import torch")
    err, out, result = fails(shell, "%%ondevice cpu\nx = torch.zeros(2).cuda()\n\nraise ValueError('boom')\n")
    assert type(err) is ValueError and str(err) == "boom"
    n = result.execution_count
    assert f"Cell In[{n}], line 4" in out and "raise ValueError('boom')" in out
    assert "gpumagic" not in out and HELPER not in out
    assert shell.user_ns["x"].device.type == "cpu"   # what ran before the error stays


def test_error_inside_rewritten_call_shows_no_gpumagic_frame(shell):
    ok(shell, "import torch")
    err, out, result = fails(shell, "%%ondevice cpu\nx = None\n\ny = x.cuda()\n")
    assert type(err) is AttributeError and "'NoneType' object has no attribute 'cuda'" in str(err)
    assert f"Cell In[{result.execution_count}], line 4" in out
    assert "gpumagic" not in out
    err, out, result = fails(shell, "%%ondevice meta\nx = torch.zeros(2)\ny = x.to('cuda', 'not a dtype')\n")
    assert type(err) is TypeError
    assert f"Cell In[{result.execution_count}], line 3" in out and "gpumagic" not in out


def test_syntax_error_points_at_user_line(shell):
    err, out, result = fails(shell, "%%ondevice cpu\nx = 1\n\ny = (x +\n")
    assert isinstance(err, SyntaxError)
    assert err.lineno == 4
    assert f"Cell In[{result.execution_count}], line 4" in out and "y = (x +" in out


def test_getsource_of_function_defined_in_cell(shell):
    ok(shell, "import torch")
    ok(shell, "%%ondevice cpu\ndef helper(x):\n    '''Double it.'''\n    return x.cuda() * 2\n")
    ok(shell, "import inspect\nsrc = inspect.getsource(helper)")
    assert shell.user_ns["src"] == "def helper(x):\n    '''Double it.'''\n    return x.cuda() * 2\n"


def test_functions_from_cell_follow_where_they_run(shell):
    ok(shell, "import torch")
    ok(shell, "%%ondevice meta\ndef make():\n    return torch.zeros(2)\ninside = make()\n")
    assert shell.user_ns["inside"].is_meta
    assert HELPER not in shell.user_ns and helper_name("meta") in shell.user_ns_hidden
    ok(shell, "outside = make()")
    assert shell.user_ns["outside"].is_meta                 # a plain cell: the device it was made for
    ok(shell, "%%ondevice cpu\nagain = make()\n")
    assert shell.user_ns["again"].device.type == "cpu"      # another %%ondevice cell: that cell's device


def test_other_ast_transformers_apply(shell):
    class FortyTwo(ast.NodeTransformer):
        def visit_Name(self, node):
            if node.id == "ANSWER":
                return ast.copy_location(ast.Constant(42), node)
            return node

    transformer = FortyTwo()
    shell.ast_transformers.append(transformer)
    try:
        result, _ = ok(shell, "%%ondevice cpu\nANSWER + 0\n")
    finally:
        shell.ast_transformers.remove(transformer)
    assert result.result == 42


def test_magics_inside_the_cell(shell):
    result, out = ok(shell, "%%ondevice cpu\n%time y = 5\ny * 2\n")
    assert result.result == 10 and "Wall time" in out


def test_keyboard_interrupt_propagates_and_state_is_restored(shell):
    ok(shell, "import torch")
    err, out, _ = fails(shell, "%%ondevice meta\ntorch.set_default_device('meta')\nraise KeyboardInterrupt\n")
    assert type(err) is KeyboardInterrupt
    assert torch.get_default_device() == torch.device("cpu")
    assert HELPER not in shell.user_ns


def test_default_device_restored_after_success_and_failure(shell):
    ok(shell, "import torch")
    ok(shell, "%%ondevice cpu\ntorch.set_default_device('cuda')\ninside = torch.get_default_device()\n")
    assert shell.user_ns["inside"] == torch.device("cpu")   # 'cuda' followed the cell's device
    assert torch.get_default_device() == torch.device("cpu")
    fails(shell, "%%ondevice meta --no-rewrite\nx = torch.zeros(1)\n1 / 0\n")
    assert shell.user_ns["x"].is_meta
    assert torch.get_default_device() == torch.device("cpu")
    torch.set_default_device("meta")
    try:
        ok(shell, "%%ondevice cpu --no-rewrite\ny = torch.zeros(1)\n")
        assert shell.user_ns["y"].device.type == "cpu"
        assert torch.get_default_device() == torch.device("meta")
    finally:
        torch.set_default_device(None)


def test_helper_name_is_restored_when_nested(shell):
    ok(shell, "import torch")
    ok(shell, "%%ondevice meta\nget_ipython().run_cell_magic('ondevice', 'cpu', 'inner = torch.zeros(1)')\n"
              "outer = torch.zeros(1)\n")
    assert shell.user_ns["inner"].device.type == "cpu" and shell.user_ns["outer"].is_meta
    assert HELPER not in shell.user_ns


# -- choosing the device ------------------------------------------------------------------

def test_device_omitted_uses_session_device(shell):
    ok(shell, "import torch")
    ok(shell, "%%ondevice\nx = torch.zeros(1).cuda()\n")
    assert str(shell.user_ns["x"].device) == ("cuda:0" if HAS_GPU else "cpu")
    session.set_picked_device("meta")
    ok(shell, "%%ondevice\ny = torch.zeros(1).cuda()\n")
    assert shell.user_ns["y"].is_meta


@pytest.mark.parametrize("line", ["tpu", "cuda:99", "99", "cuda:x", "cuda:0", "cuda", "0", "mps", "-3"])
def test_bad_device_is_usage_error_naming_devices(shell, line):
    if line == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has mps")
    if line in ("cuda:0", "cuda", "0") and HAS_GPU:
        pytest.skip("this machine has a GPU")
    err, out, _ = fails(shell, f"%%ondevice {line}\nx = 1\n")
    assert type(err) is UsageError
    if line != "-3":   # argparse's own message for an unknown option
        assert "valid choices: cpu" in str(err) and "meta" in str(err)
    assert "x" not in shell.user_ns


def test_gpu_torch_cannot_use_is_usage_error(shell, monkeypatch):
    # NVML sees a GPU, but this torch has no CUDA: say so, naming what is usable.
    from gpumagic.devices import Gpu
    from gpumagic.ondevice import run as ondevice
    monkeypatch.setattr(ondevice, "_gpus", lambda: [Gpu(0, "GPU-x", None, "Fake GPU")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err, _, _ = fails(shell, "%%ondevice cuda:0\nx = 1\n")
    assert type(err) is UsageError
    assert "not usable by this torch" in str(err) and "valid choices: cpu, meta" in str(err)
    assert "x" not in shell.user_ns


def test_bad_flag_is_usage_error(shell):
    err, _, _ = fails(shell, "%%ondevice cpu --bogus\nx = 1\n")
    assert type(err) is UsageError
    assert "unrecognized arguments: --bogus; usage: %%ondevice [--stream] [--sync]" in str(err)   # a cell magic


def test_a_long_device_name_is_cut_in_the_error(shell):
    err, _, _ = fails(shell, "%%ondevice " + "x" * 5000 + "\nx = 1\n")
    assert type(err) is UsageError and len(str(err)) < 300
    assert "unknown device 'xxxxxxxxxx" in str(err) and "... (5000 characters); valid choices: cpu" in str(err)


def test_gpu_means_cuda(shell):
    from gpumagic.devices import Gpu, parse_device
    assert parse_device("GPU", [Gpu(0, "GPU-a", None, "Fake GPU")]) == "cuda:0"


def test_empty_cell_does_nothing(shell):
    def names():
        return {n for n in shell.user_ns if not n.startswith("_")}
    before = names()
    result, out = ok(shell, "%%ondevice cpu\n\n# nothing here\n\n")
    assert out.strip() == "" and result.result is None
    assert names() == before


# -- --move ------------------------------------------------------------------------------

def test_move_modules_in_place_and_tensors_rebound(shell):
    ok(shell, SEED + "x = torch.ones(4)\nbias = nn.Parameter(torch.zeros(3))\nn = 3\n")
    ns = shell.user_ns
    sq, x = ns["sq"], ns["x"]
    sq_bytes = sum(p.nelement() * p.element_size() for p in sq.parameters())
    params = [(p, p.detach().clone()) for p in sq.parameters()]
    bias = ns["bias"]
    result, out = ok(shell, "%%ondevice meta --move sq,x --move bias\nprobe = (x.device, bias.device, "
                            "[p.device.type for p in sq.parameters()])\n")
    # in the cell they were on meta ...
    assert ns["probe"] == (torch.device("meta"), torch.device("meta"), ["meta"] * len(params))
    assert "(for this cell: a dry run; they are put back after it)" in out
    assert f"moved to meta: sq (Sequential, {sq_bytes / 1024:.1f} KiB), x (tensor, 16 B), bias (tensor, 12 B)" in out
    # ... and after it, meta holding no values, the same objects with their values are back
    assert ns["sq"] is sq and all(p is q and torch.equal(p, v) for (q, v), p in zip(params, sq.parameters()))
    assert ns["x"] is x and ns["bias"] is bias and torch.equal(x, torch.ones(4))
    _, out = ok(shell, "%%ondevice meta --move x\nx = torch.zeros(2, device='meta')\n")
    assert ns["x"].is_meta and ns["x"].shape == (2,)   # what the cell bound to the name stays


@pytest.mark.parametrize("name, message", [("nope", "no such variable"), ("n", "is a int, not a tensor")])
def test_move_bad_name_names_movable_variables(shell, name, message):
    ok(shell, SEED + "x = torch.ones(4)\nn = 3\n")
    err, _, _ = fails(shell, f"%%ondevice meta --move x,{name}\ny = 1\n")
    assert type(err) is UsageError and message in str(err)
    assert "valid choices: sq, x" in str(err)
    assert shell.user_ns["x"].device.type == "cpu" and "y" not in shell.user_ns   # nothing changed


# -- flags on a CPU machine ------------------------------------------------------------------

def test_time_reports_wall_on_cpu(shell):
    _, out = ok(shell, "%%ondevice cpu --time\nimport time\ntime.sleep(0.02)\n")
    match = re.search(r"cpu: wall ([\d.]+) ms", out)
    assert match and 15 < float(match.group(1)) < 1000


def test_stream_and_sync_are_harmless_on_cpu(shell):
    result, _ = ok(shell, "%%ondevice cpu --stream --sync\nimport torch\ntorch.ones(2).cuda().sum()\n")
    assert result.result.item() == 2.0
