"""``torch.typename(x)`` in a cell on a device that is not a GPU answers as ``x.type()`` does.

Regression: under ``%%ondevice cpu``, after ``x = torch.cuda.FloatTensor([1., 2.])``, ``x.type()`` said
``'torch.cuda.FloatTensor'`` but ``torch.typename(x)`` (which torch computes from ``x.type()``) said
``'torch.FloatTensor'``, so a cell checking ``torch.typename(x) == 'torch.cuda.FloatTensor'`` took its CPU
branch while ``x.is_cuda`` said True.
"""
from __future__ import annotations

import pytest

from tests.placement_helpers import cell_ok, run_rewritten

TYPED = """\
x = torch.cuda.FloatTensor([1., 2.])
on_gpu = 'GPU' if torch.typename(x) == 'torch.cuda.FloatTensor' else 'CPU'
names = [torch.typename(x), torch.typename(x.long()), torch.typename(torch.ones(2).half().cuda())]
same = torch.typename(x) == x.type()
"""


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_typename_of_a_tensor_on_device_names_its_cuda_type(shell, device, no_cuda_init):
    cell_ok(shell, "import torch")
    cell_ok(shell, f"%%ondevice {device}\n{TYPED}")
    ns = shell.user_ns
    assert ns["on_gpu"] == "GPU" and ns["same"] is True
    assert ns["names"] == ["torch.cuda.FloatTensor", "torch.cuda.LongTensor", "torch.cuda.HalfTensor"]
    assert ns["x"].device.type == device
    if device == "cpu":
        assert ns["x"].tolist() == [1.0, 2.0]


def test_typename_imported_by_name(shell, no_cuda_init):
    # Imported in the cell itself, and in an earlier plain cell under another name.
    cell_ok(shell, "import torch\nfrom torch import typename as tn")
    cell_ok(shell, "%%ondevice cpu\nfrom torch import typename\nx = torch.ones(2).cuda()\n"
                   "a, b = typename(x), tn(x)\n"
                   "def kind(t):\n    return typename(t)\n")
    ns = shell.user_ns
    assert (ns["a"], ns["b"]) == ("torch.cuda.FloatTensor", "torch.cuda.FloatTensor")
    assert ns["kind"](ns["x"]) == "torch.cuda.FloatTensor"      # a function made in the cell keeps following
    assert torch_typename(ns["x"]) == "torch.FloatTensor"       # torch's own answer outside the cell's code


def torch_typename(x):
    import torch
    return torch.typename(x)


def test_typename_of_other_things_answers_as_torch(no_cuda_init):
    ns = run_rewritten("""
        import torch.nn as nn
        layer = torch.typename(nn.Linear)
        number = torch.typename(3)
        here = torch.typename(torch.ones(2, device='cpu'))
        """, "meta")
    assert ns["layer"] == "torch.nn.modules.linear.Linear" and ns["number"] == "int"
    assert ns["here"] == "torch.FloatTensor"              # a CPU tensor is not on the meta DEVICE: no GPU's
    passing = run_rewritten("t = torch.typename(torch.ones(2).cuda() if False else torch.ones(2))", None)
    assert passing["t"] == "torch.FloatTensor"


def test_a_name_that_only_looks_like_typename_is_left_alone(shell, no_cuda_init):
    cell_ok(shell, "import torch\ndef typename(t):\n    return 'mine'")
    cell_ok(shell, "%%ondevice cpu\nx = torch.ones(2).cuda()\nmine = typename(x)")
    assert shell.user_ns["mine"] == "mine"
