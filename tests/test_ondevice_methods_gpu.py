"""%%ondevice on real GPUs: a module's own ``cuda``, storages in ``map_location``, ``cuda`` taken as a value,
``torch.set_default_tensor_type(torch.cuda.FloatTensor)``.

Run on the GPU machine: ``python -m pytest tests/test_ondevice_methods_gpu.py -m gpu -q``.
"""
from __future__ import annotations

import pytest
import torch

from tests.placement_helpers import cell_ok
from tests.test_ondevice_methods import OWN_CUDA, save_as_if_on_cuda

pytestmark = pytest.mark.gpu


@pytest.fixture
def default_dtype():
    yield
    torch.set_default_dtype(torch.float32)


def test_module_own_cuda_runs_on_the_device(shell):
    cell_ok(shell, f"import torch\nimport torch.nn as nn\n{OWN_CUDA}")     # a plain cell's class
    _, out = cell_ok(shell, "%%ondevice cuda:0\nh = Holder().cuda()\nk = Holder().cuda(3)\n")
    ns = shell.user_ns
    assert "Holder.cuda None" in out and "Holder.cuda 0" in out            # every CUDA index means cuda:0
    for name in ("h", "k"):
        assert ns[name].extra.device == torch.device("cuda:0"), name        # moved by its own cuda
        assert ns[name].lin.weight.device == torch.device("cuda:0"), name
    assert ns["h"].extra.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.gpu2
def test_module_own_cuda_on_the_second_gpu(shell):
    cell_ok(shell, f"import torch\nimport torch.nn as nn\n{OWN_CUDA}")
    cell_ok(shell, "%%ondevice cuda:1\nh = Holder().cuda()\nk = Holder().cuda(0)\n")
    for name in ("h", "k"):
        assert shell.user_ns[name].extra.device == torch.device("cuda:1"), name
        assert shell.user_ns[name].lin.weight.device == torch.device("cuda:1"), name
    assert torch.cuda.current_device() == 0


def test_map_location_function_on_the_gpu(shell, tmp_path):
    path = str(tmp_path / "w.pt")
    torch.save({"w": torch.arange(4.)}, path)
    cell_ok(shell, f"%%ondevice cuda:0\nimport torch\n"
                   f"state = torch.load({path!r}, map_location=lambda storage, loc: storage.cuda(1))\n")
    loaded = shell.user_ns["state"]["w"]
    assert loaded.device == torch.device("cuda:0") and loaded.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_dict_map_location_on_the_gpu(shell, tmp_path):
    # Saved on a GPU this machine lacks (cuda:9): a dict that leaves it out, or sends it to another
    # GPU it lacks, still loads onto DEVICE, as every CUDA index means DEVICE.
    path = str(tmp_path / "w.pt")
    save_as_if_on_cuda({"w": torch.arange(4.)}, path, "cuda:9")
    with pytest.raises(RuntimeError, match="CUDA device 9"):
        torch.load(path, map_location={"cuda:8": "cuda:0"})              # torch's own, outside the cell
    cell_ok(shell, f"%%ondevice cuda:0\nimport torch\n"
                   f"a = torch.load({path!r}, map_location={{'cuda:8': 'cuda:0'}})\n"
                   f"b = torch.load({path!r}, map_location={{'cuda:9': 'cuda:8'}})\n")
    for name in ("a", "b"):
        loaded = shell.user_ns[name]["w"]
        assert loaded.device == torch.device("cuda:0") and loaded.tolist() == [0.0, 1.0, 2.0, 3.0], name


def test_cuda_taken_as_a_value_on_the_gpu(shell):
    cell_ok(shell, "import torch\nbatch = [torch.ones(2), torch.arange(3.)]")
    cell_ok(shell, "%%ondevice cuda:0\nmoved = list(map(torch.Tensor.cuda, batch))\n"
                   "a = getattr(torch.ones(1), 'cuda')(5)\n")
    ns = shell.user_ns
    assert [t.device for t in ns["moved"]] == [torch.device("cuda:0")] * 2
    assert ns["moved"][1].tolist() == [0.0, 1.0, 2.0] and ns["a"].device == torch.device("cuda:0")


@pytest.mark.filterwarnings("ignore:torch.set_default_tensor_type\\(\\) is deprecated")
def test_set_default_tensor_type_cuda_is_put_back_after_the_cell(shell, default_dtype):
    cell_ok(shell, "%%ondevice cuda:0\nimport torch\ntorch.set_default_tensor_type(torch.cuda.DoubleTensor)\n"
                   "a = torch.ones(2)\n")
    a = shell.user_ns["a"]
    assert a.device == torch.device("cuda:0") and a.dtype == torch.float64
    # The cell's default device ends with it; the dtype stays what the cell set, as in torch.
    assert torch.ones(1).device.type == "cpu" and torch.get_default_dtype() == torch.float64


def test_torch_load_of_a_gpu_checkpoint_under_cpu(shell, tmp_path):
    path = str(tmp_path / "gpu.pt")
    torch.save({"w": torch.arange(4., device="cuda:0")}, path)
    cell_ok(shell, f"%%ondevice cpu\nimport torch\nsd = torch.load({path!r})\n")
    w = shell.user_ns["sd"]["w"]
    assert w.device == torch.device("cpu") and w.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.gpu2
def test_torch_load_of_a_checkpoint_saved_on_gpu0_under_cuda1(shell, tmp_path):
    path = str(tmp_path / "gpu.pt")
    torch.save({"w": torch.arange(4., device="cuda:0"), "c": torch.ones(2)}, path)
    cell_ok(shell, f"%%ondevice cuda:1\nimport torch\nsd = torch.load({path!r})\n")
    sd = shell.user_ns["sd"]
    assert sd["w"].device == torch.device("cuda:1") and sd["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sd["c"].device == torch.device("cpu")      # saved on the CPU: stays there, as torch.load does
