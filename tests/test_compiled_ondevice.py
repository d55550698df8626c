"""torch.compile and torch.jit.trace of code written for .cuda() under %%ondevice cpu, as notebooks write them.

The compiles use dynamo's eager backend where inductor would only add minutes on two cores:
what is under test is what dynamo traces.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cell

SETUP = """
import torch
from torch import nn
from torch._dynamo.utils import counters
torch.manual_seed(0)
x = torch.randn(3, 4)
"""


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def ok(shell, src):
    result, out, _ = run_cell(shell, src)
    assert result.success, out
    return out


def test_a_function_compiled_with_fullgraph_in_an_ondevice_cell_is_one_graph(shell):
    # The rewritten .cuda() and device='cuda' recorded each tensor by id: a side effect dynamo cannot
    # replay, so fullgraph=True raised and, without it, the function ran uncompiled.
    ok(shell, SETUP)
    ok(shell, """%%ondevice cpu
@torch.compile(fullgraph=True, backend="eager")
def f(t):
    t = t.cuda()
    return torch.sin(t) * torch.ones(3, 4, device='cuda').add(1) + t.to('cuda') + torch.zeros_like(t)
y = f(x)
graphs = counters['stats']['unique_graphs']
""")
    ns = shell.user_ns
    x = ns["x"]
    torch.testing.assert_close(ns["y"], torch.sin(x) * 2 + x)
    assert ns["graphs"] == 1 and not counters_of(ns, "graph_break")
    ok(shell, "y2 = f(x)")                       # called from a plain cell: the same graph, nothing traced again
    torch.testing.assert_close(ns["y2"], ns["y"])
    assert ns["counters"]["stats"]["unique_graphs"] == 1


def counters_of(ns, kind):
    return dict(ns["counters"][kind])


def test_a_compiled_model_whose_forward_says_cuda_is_one_graph_and_moves_do_not_alias(shell):
    ok(shell, SETUP)
    ok(shell, """%%ondevice cpu
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 2)
        self.register_buffer('b', torch.ones(2, device='cuda'))
    def forward(self, t):
        return self.l(t.cuda()) + torch.cuda.FloatTensor([1., 2.]) + self.b
m = M().cuda()
ref = m(x)
cm = torch.compile(m, fullgraph=True, backend="eager")
y = cm(x.cuda())
same = x.cuda().cuda()
""")
    ns = shell.user_ns
    torch.testing.assert_close(ns["y"], ns["ref"])
    assert ns["counters"]["stats"]["unique_graphs"] == 1
    ok(shell, "%%ondevice cpu\nsame_again = same.cuda() is same")   # outside compile, moves still remember
    assert ns["same_again"] is True


def test_torch_jit_trace_of_a_forward_that_says_cuda(shell):
    # The trace's check runs the module again on copies of the inputs: .cuda() of the remembered input was
    # no copy, of the copy a copy, and the check failed ("Graphs differed across invocations").
    ok(shell, SETUP)
    ok(shell, """%%ondevice cpu
class N(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 2)
    def forward(self, t):
        return self.l(t.cuda())
n = N().cuda()
traced = torch.jit.trace(n, x.cuda())
y = traced(x)
""")
    ns = shell.user_ns
    torch.testing.assert_close(ns["y"], ns["n"](ns["x"]))


def test_time_says_what_compiling_took(shell):
    ok(shell, SETUP + "f = torch.compile(lambda t: torch.sin(t) + 1, backend='eager')\n")
    first = ok(shell, "%%ondevice cpu --time\ny = f(x.cuda())")
    assert "of it compiling (torch.compile)" in first, first
    again = ok(shell, "%%ondevice cpu --time\ny = f(x.cuda())")
    assert "cpu: wall" in again and "compiling" not in again, again
    # torch.compiler.reset() in the cell empties torch's record of compile times: still said
    after_reset = ok(shell, "%%ondevice cpu --time\ntorch.compiler.reset()\ny = f(x.cuda())")
    assert "of it compiling (torch.compile)" in after_reset, after_reset
