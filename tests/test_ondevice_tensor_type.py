"""``x.type()`` in a cell on a device that is not a GPU: a tensor on DEVICE names its CUDA type.

Regression from a review: after ``x = torch.ones(3).cuda()`` under ``%%ondevice cpu``, ``x.type()`` said
``'torch.FloatTensor'`` while ``x.is_cuda`` said True and ``x.get_device()`` 0, so tutorial code checking
``x.type() == 'torch.cuda.FloatTensor'`` took its CPU branch. One rule answers all three: in the cell's
own code a tensor on DEVICE stands in for a tensor on GPU 0.
"""
from __future__ import annotations

import pytest
import torch

from tests.placement_helpers import cell_ok, run_rewritten

TUTORIAL = """\
x = torch.ones(3).cuda()
on_gpu = 'GPU' if x.type() == 'torch.cuda.FloatTensor' else 'CPU'
has_cuda = 'cuda' in x.type()
answers = (x.type(), x.is_cuda, x.get_device())
kinds = [x.half().type(), x.long().type(), torch.cuda.DoubleTensor([1.]).type(), torch.zeros(2).type()]
y = torch.arange(3).type(x.type())          # a type name the cell read back still lands on DEVICE
"""


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_type_of_a_tensor_on_device_names_its_cuda_type(shell, device, no_cuda_init):
    cell_ok(shell, "import torch")
    cell_ok(shell, f"%%ondevice {device}\n{TUTORIAL}")
    ns = shell.user_ns
    assert ns["on_gpu"] == "GPU" and ns["has_cuda"] is True
    assert ns["answers"] == ("torch.cuda.FloatTensor", True, 0)
    assert ns["kinds"] == ["torch.cuda.HalfTensor", "torch.cuda.LongTensor", "torch.cuda.DoubleTensor",
                           "torch.cuda.FloatTensor"]
    assert ns["y"].device.type == device and ns["y"].dtype == torch.float32
    # The tensor itself is what it was: torch's own answer outside the cell's code.
    assert ns["x"].type() == ("torch.FloatTensor" if device == "cpu" else "torch.meta.FloatTensor")
    if device == "cpu":
        assert ns["y"].tolist() == [0.0, 1.0, 2.0]


def test_type_elsewhere_answers_as_torch(no_cuda_init):
    ns = run_rewritten("""
        sparse = torch.ones(2).cuda().to_sparse().type()
        complex_ = torch.ones(2, dtype=torch.complex64).cuda().type()
        class Kind:
            def type(self):
                return 'torch.FloatTensor'
        other = Kind().type()                   # not a tensor: as written
        """, "cpu")
    assert ns["sparse"] == "torch.cuda.sparse.FloatTensor" and ns["complex_"] == "torch.cuda.ComplexFloatTensor"
    assert ns["other"] == "torch.FloatTensor"
    meta = run_rewritten("a = torch.ones(2, device='cpu').type()\nb = torch.ones(2).type()", "meta")
    assert (meta["a"], meta["b"]) == ("torch.FloatTensor", "torch.cuda.FloatTensor")   # a CPU tensor is no GPU's
    passing = run_rewritten("t = torch.ones(2).type()", None)
    assert passing["t"] == "torch.FloatTensor"


def test_code_from_a_plain_cell_is_not_rewritten(shell, no_cuda_init):
    cell_ok(shell, "import torch\ndef kind(t):\n    return t.type()")
    cell_ok(shell, "%%ondevice cpu\nx = torch.ones(3).cuda()\nmine, theirs = x.type(), kind(x)")
    assert (shell.user_ns["mine"], shell.user_ns["theirs"]) == ("torch.cuda.FloatTensor", "torch.FloatTensor")
