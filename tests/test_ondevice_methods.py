"""%%ondevice on cpu and meta: a module's own ``cuda``, storages in ``map_location``, ``cuda``/``to`` taken as
values, and what the user reads when code the rewrite cannot see reaches CUDA."""
from __future__ import annotations

import re
import zipfile

import pytest
import torch

from gpumagic.devices import visible_gpus
from tests.conftest import run_cell
from tests.placement_helpers import cell_ok

HAS_GPU = bool(visible_gpus())
ANSI = re.compile(r"\x1b\[[0-9;]*m")

OWN_CUDA = """\
class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2, device='cpu')
        self.extra = torch.arange(3.)          # neither a parameter nor a buffer: its cuda moves it
    def cuda(self, device=None):
        print('Holder.cuda', device)
        self.extra = self.extra.cuda(device)
        return super().cuda(device)
"""


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_module_own_cuda_defined_in_the_cell_runs(shell, device, no_cuda_init):
    _, out = cell_ok(shell, f"%%ondevice {device}\nimport torch\nimport torch.nn as nn\n{OWN_CUDA}"
                            "h = Holder()\nmoved = h.cuda()\n")
    ns = shell.user_ns
    assert "Holder.cuda None" in out                   # the class's own method ran, as on a GPU
    assert ns["moved"] is ns["h"]
    assert ns["h"].extra.device.type == device          # what only its own cuda moves
    assert ns["h"].lin.weight.device.type == device     # and super().cuda() the parameters
    if device == "cpu":
        assert ns["h"].extra.tolist() == [0.0, 1.0, 2.0]


def test_module_own_cuda_that_calls_module_cuda_unbound(shell, no_cuda_init):
    # The older spelling of super().cuda(): torch's method runs, not the class's own again.
    cell_ok(shell, """%%ondevice meta
import torch
import torch.nn as nn
class Old(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2, device='cpu')
        self.extra = torch.arange(3., device='cpu')
    def cuda(self, device=None):
        self.extra = self.extra.cuda(device)
        return nn.Module.cuda(self, device)
o = Old().cuda()
plain = nn.Module.cuda          # taken as a value: torch's method, which leaves extra alone
p = plain(Old())
""")
    ns = shell.user_ns
    assert (ns["o"].extra.device.type, ns["o"].lin.weight.device.type) == ("meta", "meta")
    assert (ns["p"].extra.device.type, ns["p"].lin.weight.device.type) == ("cpu", "meta")


def test_module_own_cuda_from_a_plain_cell_runs_too(shell, no_cuda_init):
    # Defined in a plain cell, its method is compiled again through the rewrite (more: test_ondevice_own_cuda.py).
    cell_ok(shell, f"import torch\nimport torch.nn as nn\n{OWN_CUDA}")
    _, out = cell_ok(shell, "%%ondevice meta\nh = Holder().cuda()\n")
    assert "Holder.cuda None" in out
    assert (shell.user_ns["h"].extra.device.type, shell.user_ns["h"].lin.weight.device.type) == ("meta", "meta")


def test_cuda_and_to_taken_as_values_follow_the_device(shell, no_cuda_init):
    cell_ok(shell, "import torch\nimport torch.nn as nn\nbatch = [torch.ones(2), torch.arange(3.)]")
    cell_ok(shell, """%%ondevice meta
a = getattr(torch.ones(2), 'cuda')()
b = getattr(torch.Tensor, 'cuda')(torch.ones(2))
moved = list(map(torch.Tensor.cuda, batch))
to_gpu = torch.zeros(1).cuda
c = to_gpu()
d = getattr(torch.ones(1), 'to')('cuda:0')
m = getattr(nn.Linear(2, 2, device='cpu'), 'cuda')()
e = getattr(torch.ones(1), 'no_such_method', 5)
""")
    ns = shell.user_ns
    for name in ("a", "b", "c", "d"):
        assert ns[name].device.type == "meta", name
    assert [t.device.type for t in ns["moved"]] == ["meta", "meta"] and ns["moved"][1].shape == (3,)
    assert [t.device.type for t in ns["batch"]] == ["cpu", "cpu"]     # a move makes new tensors
    assert ns["m"].weight.device.type == "meta" and ns["e"] == 5


def test_unbound_cuda_on_cpu_copies_as_a_gpu_would(shell, no_cuda_init):
    cell_ok(shell, "import torch\nbatch = [torch.ones(2), torch.arange(3.)]")
    cell_ok(shell, "%%ondevice cpu\nmoved = list(map(torch.Tensor.cuda, batch))\nsame = moved[0].cuda() is moved[0]")
    ns = shell.user_ns
    assert [t.tolist() for t in ns["moved"]] == [[1.0, 1.0], [0.0, 1.0, 2.0]]
    assert ns["moved"][0] is not ns["batch"][0] and ns["same"] is True


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_map_location_function_moves_storages(shell, device, tmp_path, no_cuda_init):
    # torch.load's documented spelling: map_location=lambda storage, loc: storage.cuda(1)
    path = str(tmp_path / "w.pt")
    torch.save({"w": torch.arange(4.)}, path)
    cell_ok(shell, f"""%%ondevice {device}
import torch
state = torch.load({path!r}, map_location=lambda storage, loc: storage.cuda(1))
other = torch.load({path!r}, map_location=lambda s, loc: s.cuda())
""")
    for name in ("state", "other"):
        loaded = shell.user_ns[name]["w"]
        assert loaded.device.type == device and loaded.shape == (4,)
        if device == "cpu":
            assert loaded.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.skipif(HAS_GPU, reason="on a GPU machine the call reaches CUDA and works")
def test_cuda_reached_outside_the_rewrite_says_why(shell):
    cell_ok(shell, "import torch\ndef to_gpu(t):\n    return t.cuda()")
    result, out, _ = run_cell(shell, "%%ondevice cpu\nx = torch.ones(2)\ny = to_gpu(x)")
    out = ANSI.sub("", out)
    err = result.error_in_exec
    assert err is not None and type(err) in (AssertionError, RuntimeError)
    assert len(err.__notes__) == 1 and "through code the rewrite does not see" in err.__notes__[0]
    assert "%%ondevice cpu: the cell's own CUDA spellings" in out
    assert re.search(r"Cell In\[\d+\], line 3\n.*\n.*\n----> 3 y = to_gpu\(x\)", out), out
    # Nested: the inner cell's note is the only one.
    result, _, _ = run_cell(shell, "%%ondevice cpu\nget_ipython().run_cell_magic('ondevice', 'cpu', 'to_gpu(x)')")
    assert len(result.error_in_exec.__notes__) == 1
    # Without the rewrite the cell's own .cuda() reaches CUDA, and the note says so.
    result, _, _ = run_cell(shell, "%%ondevice cpu --no-rewrite\ny = torch.ones(1).cuda()")
    assert "--no-rewrite: CUDA spellings" in result.error_in_exec.__notes__[0]


@pytest.fixture
def default_dtype():
    yield
    torch.set_default_dtype(torch.float32)


@pytest.mark.filterwarnings("ignore:torch.set_default_tensor_type\\(\\) is deprecated")
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_set_default_tensor_type_cuda_makes_the_device_the_default(shell, device, default_dtype, no_cuda_init):
    cell_ok(shell, f"""%%ondevice {device}
import torch
torch.set_default_tensor_type(torch.cuda.DoubleTensor)
a = torch.ones(2)
torch.set_default_tensor_type('torch.cuda.FloatTensor')
b = torch.zeros(3)
""")
    ns = shell.user_ns
    assert (ns["a"].device.type, ns["a"].dtype) == (device, torch.float64)
    assert (ns["b"].device.type, ns["b"].dtype) == (device, torch.float32)
    # After the cell the default device is what it was; the dtype stays what the cell set, as in torch.
    assert torch.get_default_device() == torch.device("cpu") and torch.ones(1).device.type == "cpu"
    assert torch.get_default_dtype() == torch.float32


def save_as_if_on_cuda(obj, path, location: str = "cuda:0") -> None:
    """``torch.save(obj, path)`` with each storage's location written as ``location`` (``cuda:N``), as a GPU
    machine saves it."""
    torch.save(obj, path)
    with zipfile.ZipFile(path) as z:
        entries = [(info, z.read(info.filename)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for info, data in entries:
            if info.filename.endswith("/data.pkl"):
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00" + location.encode())
            z.writestr(info, data)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_torch_load_of_a_gpu_checkpoint_lands_on_the_device(shell, device, tmp_path, no_cuda_init):
    gpu, cpu = str(tmp_path / "gpu.pt"), str(tmp_path / "cpu.pt")
    save_as_if_on_cuda({"w": torch.arange(4.)}, gpu)
    torch.save({"w": torch.arange(2.)}, cpu)
    with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
        torch.load(gpu)                                    # what it is without a GPU
    cell_ok(shell, f"""%%ondevice {device}
import torch
a = torch.load({gpu!r})                                 # written for the GPU it was saved on
b = torch.load(f={gpu!r}, weights_only=True, map_location=None)
c = torch.load({cpu!r})                                 # saved on the CPU: stays there, as on a GPU
""")
    ns = shell.user_ns
    for name in ("a", "b"):
        assert ns[name]["w"].device.type == device and ns[name]["w"].shape == (4,), name
    assert ns["c"]["w"].device.type == "cpu" and ns["c"]["w"].tolist() == [0.0, 1.0]
    if device == "cpu":
        assert ns["a"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_torch_load_with_a_dict_map_location_lands_on_the_device(shell, device, tmp_path, no_cuda_init):
    # torch's documented dict form: every CUDA location in it, listed or not, is DEVICE's.
    on0, on1 = str(tmp_path / "on0.pt"), str(tmp_path / "on1.pt")
    save_as_if_on_cuda({"w": torch.arange(4.)}, on0, "cuda:0")
    save_as_if_on_cuda({"w": torch.arange(3.)}, on1, "cuda:1")
    cell_ok(shell, f"""%%ondevice {device}
import torch
remap = {{'cuda:1': 'cuda:0'}}
a = torch.load({on0!r}, map_location=remap)             # cuda:0 is not in the dict
b = torch.load({on1!r}, map_location=remap)             # cuda:1 is, sent to cuda:0
c = torch.load({on0!r}, {{'cuda:0': 'cuda:1'}})          # positional, to another GPU
d = torch.load({on0!r}, map_location={{'cuda:0': torch.device('cuda:1')}})
e = torch.load({on1!r}, map_location={{'cuda:1': 'cpu'}})  # sent to the CPU as written
f = torch.load({on0!r}, map_location={{}})
""")
    ns = shell.user_ns
    for name in "abcdf":
        assert ns[name]["w"].device.type == device, name
        assert ns[name]["w"].shape == ((3,) if name == "b" else (4,)), name
    assert ns["remap"] == {"cuda:1": "cuda:0"} and type(ns["remap"]) is dict    # the user's dict is left alone
    assert ns["e"]["w"].device.type == "cpu" and ns["e"]["w"].tolist() == [0.0, 1.0, 2.0]
    if device == "cpu":
        assert ns["a"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and ns["b"]["w"].tolist() == [0.0, 1.0, 2.0]
        assert ns["c"]["w"].tolist() == ns["d"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_dict_map_location_maps_every_cuda_location():
    from gpumagic.cell.rewrite.helper import Placement
    mapped = Placement("meta").map({"cuda:1": "cuda:0", "cuda:2": "cpu", "cpu": 0})
    assert isinstance(mapped, dict) and dict(mapped) == {"cuda:1": "meta", "cuda:2": "cpu", "cpu": "meta"}
    assert mapped.get("cuda:0", "cuda:0") == "meta" and mapped.get("cuda", "cuda") == "meta"
    assert mapped.get(torch.device("cuda", 3), None) == "meta"      # how torch asks for a rebuilt tensor
    assert mapped.get("mps", "mps") == "mps"
    assert Placement(None).map({"cuda:1": "cuda:0"}) == {"cuda:1": "cuda:0"}


@pytest.mark.skipif(HAS_GPU, reason="on a GPU machine the plain cell's .cuda() works")
def test_in_a_jupyter_kernel(tmp_path):
    from tests.notebook_helpers import run_notebook, stream_text
    gpu = str(tmp_path / "gpu.pt")
    save_as_if_on_cuda({"w": torch.arange(4.)}, gpu)
    sources = [
        "%load_ext gpumagic\nimport torch\nbatch = [torch.ones(2), torch.arange(3.)]\n"
        "def to_gpu(t):\n    return t.cuda()",
        f"%%ondevice cpu\nmoved = list(map(torch.Tensor.cuda, batch))\nsd = torch.load({gpu!r})\n"
        "print(f'{[t.device.type for t in moved]} {sd[\"w\"].tolist()}')",
        "%%ondevice cpu\nx = torch.ones(2)\ny = to_gpu(x)",
        "print(torch.get_default_device(), x.tolist())",
    ]
    nb = run_notebook(sources, timeout=120, allow_errors=True)

    def text(index):
        return stream_text(nb.cells[index])
    assert text(1).strip() == "['cpu', 'cpu'] [0.0, 1.0, 2.0, 3.0]"
    errors = [o for o in nb.cells[2].outputs if o.output_type == "error"]
    assert len(errors) == 1
    shown = ANSI.sub("", "\n".join(errors[0].traceback))
    assert "Cell In[3], line 3" in shown and "----> 3 y = to_gpu(x)" in shown
    assert "this call reached CUDA through code the rewrite does not see" in shown
    assert text(3).strip() == "cpu [1.0, 1.0]"
