"""A module's own ``cuda`` from a plain notebook cell, called in a ``%%ondevice`` cell on cpu or meta.

Regression: a class defined in a plain cell whose ``cuda`` also moves a tensor it keeps outside its
parameters and buffers did not have that method run on a device that is not a GPU: its parameters
landed on meta while the extra tensor stayed on the CPU. On a GPU the class's own method runs; now it
runs here too, its CUDA spellings following the cell's device as a method defined in the cell would.
"""
from __future__ import annotations

import re
import sys
import types

import pytest

from gpumagic.cell.rewrite.methods import rewritten
from gpumagic.devices import visible_gpus
from tests.conftest import run_cell
from tests.placement_helpers import cell_ok

HAS_GPU = bool(visible_gpus())
ANSI = re.compile(r"\x1b\[[0-9;]*m")

HOLDER = """\
import torch
import torch.nn as nn
class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.extra = torch.arange(3.)          # neither a parameter nor a buffer: only its cuda moves it
    def cuda(self, device=None):
        print('Holder.cuda', device)
        self.extra = self.extra.cuda(device)
        return super().cuda(device)
"""


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_own_cuda_from_a_plain_cell_runs_on_the_device(shell, device, no_cuda_init):
    cell_ok(shell, HOLDER)
    _, out = cell_ok(shell, f"%%ondevice {device}\nh = Holder()\nmoved = h.cuda()\nagain = getattr(h, 'cuda')(0)\n")
    ns = shell.user_ns
    assert "Holder.cuda None" in out and "Holder.cuda 0" in out      # its own method ran, as on a GPU
    assert ns["moved"] is ns["h"] and ns["again"] is ns["h"]
    assert ns["h"].extra.device.type == device                       # what only its own cuda moves
    assert ns["h"].lin.weight.device.type == device                  # and super().cuda() the parameters
    if device == "cpu":
        assert ns["h"].extra.tolist() == [0.0, 1.0, 2.0]
    # The class itself is left as the plain cell made it: outside %%ondevice its method is the one written.
    assert not rewritten(ns["Holder"].cuda) and "<locals>" not in ns["Holder"].cuda.__qualname__


def test_own_cuda_with_cuda_spellings_private_names_and_closures(shell, no_cuda_init):
    # Every CUDA spelling of the method follows, names mangled in the class stay mangled, and a class
    # made inside a function keeps its closure.
    cell_ok(shell, """\
import torch
import torch.nn as nn
def make(scale):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.__table = torch.ones(2)
            self.steps = torch.zeros(1)
        def cuda(self, device=None, *, why='gpu'):
            here = torch.device('cuda', torch.cuda.current_device())
            self.__table = self.__table.to(here) * scale
            self.steps = self.steps.to('cuda:0')
            self.why = (why, torch.cuda.is_available(), self.steps.is_cuda)
            return super().cuda(device)
        def table(self):
            return self.__table
    return Scaled
Scaled = make(3.0)
""")
    cell_ok(shell, "%%ondevice cpu\ns = Scaled().cuda(why='test')\n")
    s = shell.user_ns["s"]
    assert s.table().tolist() == [3.0, 3.0] and s.table().device.type == "cpu"
    assert s.steps.device.type == "cpu" and s.why == ("test", True, True)
    cell_ok(shell, "%%ondevice meta\nm = Scaled().cuda()\n")
    m = shell.user_ns["m"]
    assert (m.table().device.type, m.steps.device.type, m.lin.weight.device.type) == ("meta",) * 3


def test_own_cuda_of_a_plain_cell_parent_runs_from_a_cell_subclass(shell, no_cuda_init):
    cell_ok(shell, HOLDER)
    _, out = cell_ok(shell, """%%ondevice meta
class Child(Holder):
    def __init__(self):
        super().__init__()
        self.more = torch.ones(2, device='cpu')
    def cuda(self, device=None):
        print('Child.cuda')
        self.more = self.more.cuda()
        return super().cuda(device)
c = Child().cuda()
""")
    assert "Child.cuda" in out and "Holder.cuda None" in out
    c = shell.user_ns["c"]
    assert (c.more.device.type, c.extra.device.type, c.lin.weight.device.type) == ("meta", "meta", "meta")


def test_an_error_in_the_own_cuda_points_at_the_plain_cells_line(shell, no_cuda_init):
    cell_ok(shell, "import torch\nimport torch.nn as nn\nclass Bad(nn.Module):\n"
                   "    def cuda(self, device=None):\n        x = torch.ones(2).cuda()\n"
                   "        raise ValueError('boom')\n")
    defined = shell.execution_count - 1
    result, out, _ = run_cell(shell, "%%ondevice cpu\nb = Bad().cuda()\n")
    out = ANSI.sub("", out)
    assert type(result.error_in_exec) is ValueError and str(result.error_in_exec) == "boom"
    assert f"Cell In[{defined}], line 6" in out and "raise ValueError('boom')" in out
    assert "gpumagic" not in out


def test_own_cuda_from_a_library_moves_its_parameters(shell, no_cuda_init):
    # Code outside the notebook is not rewritten (a library's cuda may ask CUDA itself, as Lightning's does):
    # the module's parameters and buffers move instead, and its own method does not run.
    import torch
    lib = types.ModuleType("own_cuda_lib")
    exec("import torch\nimport torch.nn as nn\nclass Lib(nn.Module):\n"
         "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(2, 2)\n"
         "    def cuda(self, device=None):\n"
         "        device = torch.device('cuda', torch.cuda.current_device())\n"
         "        return super().cuda(device)\n", lib.__dict__)
    sys.modules["own_cuda_lib"] = lib
    try:
        shell.user_ns["Lib"] = lib.Lib
        cell_ok(shell, "%%ondevice meta\nm = Lib().cuda()\n")
        assert shell.user_ns["m"].lin.weight.device == torch.device("meta")
    finally:
        del sys.modules["own_cuda_lib"]


@pytest.mark.skipif(HAS_GPU, reason="on a GPU machine the plain cell's .cuda() works")
def test_in_a_jupyter_kernel():
    # ipykernel keeps a cell's source under its own file name: the method's source is found there too.
    from tests.notebook_helpers import run_notebook, stream_text
    sources = ["%load_ext gpumagic\n" + HOLDER,
               "%%ondevice meta\nh = Holder().cuda()\nprint(h.extra.device, h.lin.weight.device)"]
    nb = run_notebook(sources, timeout=120, allow_errors=True)
    text = stream_text(nb.cells[1])
    assert text.strip().splitlines() == ["Holder.cuda None", "meta meta"], nb.cells[1].outputs


def test_decorated_own_cuda(shell, no_cuda_init):
    # A decorator that returns the method itself changes nothing; one that wraps it (its own code runs
    # around the method's) is left alone, and the module's parameters move as before.
    cell_ok(shell, """\
import functools
import torch
import torch.nn as nn
def same(f):
    return f
def logged(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        print('logged')
        return f(*args, **kwargs)
    return wrapper
class Kept(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.extra = torch.ones(2)
    @same
    def cuda(self, device=None):
        self.extra = self.extra.cuda(device)
        return super().cuda(device)
class Wrapped(Kept):
    @logged
    def cuda(self, device=None):
        self.extra = self.extra.cuda(device)
        return super().cuda(device)
""")
    _, out = cell_ok(shell, "%%ondevice meta\nk = Kept().cuda()\nw = Wrapped().cuda()\n")
    k, w = shell.user_ns["k"], shell.user_ns["w"]
    assert (k.extra.device.type, k.lin.weight.device.type) == ("meta", "meta")
    assert "logged" not in out and (w.extra.device.type, w.lin.weight.device.type) == ("cpu", "meta")
