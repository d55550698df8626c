"""The seed article's explicit data parallelism (``nn.parallel.replicate`` / ``scatter`` /
``parallel_apply`` / ``gather``) under %%ondevice on devices that are not GPUs.

Regression: under ``%%ondevice cpu`` the article's four lines failed deep in torch with
``AssertionError: Broadcast function not implemented for CPU tensors``; ``data_parallel`` with
"device type could not be determined"; on a machine with GPUs ``nn.DataParallel`` under a CPU cell
asked CUDA about its GPUs. Now they run on the cell's device with the numbers one GPU per device id
gives; on a CUDA device they are torch's own.
"""
from __future__ import annotations

import ast
import re
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.parallel.scatter_gather as scatter_gather

from gpumagic.cell.rewrite.helper import HELPER, Placement, rewrite_placement
from tests.conftest import run_cell

ANSI = re.compile(r"\x1b\[[0-9;]*m")

SEED = """\
import torch
import torch.nn as nn
torch.manual_seed(0)
module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).double()
input = torch.randn(10, 8, dtype=torch.float64)
"""

# The seed article's snippet, as it stands there (section 6).
ARTICLE = """\
# Replicate module to devices in device_ids
replicas = nn.parallel.replicate(module, device_ids)
# Distribute input to devices in device_ids
inputs = nn.parallel.scatter(input, device_ids)
# Apply the models to corresponding inputs
outputs = nn.parallel.parallel_apply(replicas, inputs)
# Gather result from all devices to output_device
result = nn.parallel.gather(outputs, output_device)
"""

def ok(shell, src):
    result, out, _ = run_cell(shell, src)
    out = ANSI.sub("", out)
    assert result.error_before_exec is None and result.error_in_exec is None, out
    return out


def article_cell(device: str, ids: str = "[0, 1, 2]") -> str:
    return f"%%ondevice {device}\ndevice_ids = {ids}\noutput_device = 0\nmodule = module.cuda()\n" \
           f"input = input.cuda()\n{ARTICLE}"


def same_structure(got, want) -> None:
    """``got`` and ``want`` are the same nest of containers, with equal tensors in the same places."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.device == want.device
        if want.device.type != "meta":
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            same_structure(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            same_structure(g, w)
    else:
        assert got == want


# -- 1. the article's four lines -------------------------------------------------------------------

def test_article_snippet_on_cpu_gives_the_module_output(shell):
    ok(shell, SEED)
    ok(shell, article_cell("cpu"))
    ns = shell.user_ns
    module, input = ns["module"], ns["input"]
    assert len(ns["replicas"]) == 3 and all(isinstance(r, nn.Sequential) for r in ns["replicas"])
    assert [x.shape[0] for x in ns["inputs"]] == [4, 4, 2]          # torch's chunks of 10 over 3 ids
    assert [o.shape for o in ns["outputs"]] == [(4, 3), (4, 3), (2, 3)]
    assert ns["result"].device == torch.device("cpu")
    torch.testing.assert_close(ns["result"], module(input))
    # Each replica computes what the module does on its chunk.
    for replica, chunk in zip(ns["replicas"], ns["inputs"]):
        torch.testing.assert_close(replica(chunk), module(chunk))


def test_article_snippet_on_meta(shell):
    ok(shell, SEED)
    ok(shell, article_cell("meta", "[0, 1]"))
    ns = shell.user_ns
    assert [x.device.type for x in ns["inputs"]] == ["meta", "meta"]
    assert [x.shape[0] for x in ns["inputs"]] == [5, 5]
    assert ns["result"].shape == (10, 3) and ns["result"].device.type == "meta"


def test_bare_ondevice_on_a_machine_without_gpus(shell, monkeypatch):
    import gpumagic.ondevice.run as run
    monkeypatch.setattr(run, "_gpus", list)   # no GPUs
    ok(shell, SEED)
    ok(shell, article_cell("", "[0, 1]").replace("%%ondevice \n", "%%ondevice\n"))
    torch.testing.assert_close(shell.user_ns["result"], shell.user_ns["module"](shell.user_ns["input"]))


# -- 2. gradients: backward through the replicas is the single-device backward ----------------------

@pytest.mark.parametrize("ids", ["[0, 1]", "[0, 1, 2, 3]", "range(3)"])
def test_gradients_equal_the_single_device_backward(shell, ids):
    ok(shell, SEED + "import copy\ntarget = torch.randn(10, 3, dtype=torch.float64)\n"
                     "reference = copy.deepcopy(module)\nx_ref = input.clone().requires_grad_()\n")
    ns = shell.user_ns
    ok(shell, f"""%%ondevice cpu
module.zero_grad()
x = input.clone().cuda().requires_grad_()
device_ids = list({ids})
replicas = nn.parallel.replicate(module, device_ids)
outputs = nn.parallel.parallel_apply(replicas, nn.parallel.scatter(x, device_ids))
loss = nn.functional.mse_loss(nn.parallel.gather(outputs, 0), target)
loss.backward()
""")
    reference, x_ref = ns["reference"], ns["x_ref"]
    want = nn.functional.mse_loss(reference(x_ref), ns["target"])
    want.backward()
    torch.testing.assert_close(ns["loss"], want)
    for (name, got), (_, expected) in zip(ns["module"].named_parameters(), reference.named_parameters()):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, expected.grad)
    torch.testing.assert_close(ns["x"].grad, x_ref.grad)      # back through scatter to the input
    # The replicas' parameters are not leaves: what they get goes into the module's own .grad.
    assert all(p.grad_fn is not None for r in ns["replicas"] for p in (r[0].weight, r[2].bias))


def test_batchnorm_replicas_share_buffers_as_on_gpus(shell):
    """The first replica updates the module's running statistics (broadcast gives device 0 the
    buffers themselves); the others update copies, as on the other GPUs."""
    ok(shell, "import torch, torch.nn as nn, copy\ntorch.manual_seed(1)\nbn = nn.BatchNorm1d(4)\n"
              "data = torch.randn(8, 4) * 3 + 1\nfirst_only = copy.deepcopy(bn)\n")
    ok(shell, "%%ondevice cpu\nreps = nn.parallel.replicate(bn, [0, 1])\n"
              "outs = nn.parallel.parallel_apply(reps, nn.parallel.scatter(data, [0, 1]))\n"
              "y = nn.parallel.gather(outs, 0)\n")
    ns = shell.user_ns
    ns["first_only"](ns["data"][:4])
    torch.testing.assert_close(ns["bn"].running_mean, ns["first_only"].running_mean)
    torch.testing.assert_close(ns["bn"].running_var, ns["first_only"].running_var)
    assert ns["reps"][0].running_mean is ns["bn"].running_mean
    assert ns["reps"][1].running_mean is not ns["bn"].running_mean
    # Each chunk normalised with its own batch statistics, as on two GPUs.
    halves = [nn.functional.batch_norm(h, None, None, training=True) for h in ns["data"].chunk(2)]
    torch.testing.assert_close(ns["y"], torch.cat(halves) * ns["bn"].weight + ns["bn"].bias)


# -- 3. scatter: torch's chunks, through the containers torch's scatter goes through --------------

@pytest.mark.parametrize("batch,ids,sizes", [(10, 3, [4, 4, 2]), (5, 4, [2, 2, 1]), (3, 4, [1, 1, 1]),
                                             (8, 1, [8]), (6, 2, [3, 3])])
def test_chunk_counts_follow_torch_chunk(shell, batch, ids, sizes):
    ok(shell, f"import torch, torch.nn as nn\nbatch = torch.arange({batch * 2}.).reshape({batch}, 2)\n")
    ok(shell, f"%%ondevice cpu\nparts = nn.parallel.scatter(batch, list(range({ids})))\n")
    parts = shell.user_ns["parts"]
    assert isinstance(parts, tuple) and [p.shape[0] for p in parts] == sizes
    torch.testing.assert_close(torch.cat(parts), shell.user_ns["batch"])


class _ChunkScatter:
    """torch's ``Scatter`` as it splits (``comm.scatter``: ``chunk``), to run torch's own scatter_map on the CPU."""

    @staticmethod
    def apply(target_gpus, chunk_sizes, dim, tensor):
        return tensor.chunk(len(target_gpus), dim)


class _CatGather:
    @staticmethod
    def apply(target_device, dim, *tensors):
        return torch.cat(tensors, dim)


def test_nested_inputs_scatter_as_torch_scatters_them(shell, monkeypatch):
    ok(shell, "import torch, torch.nn as nn, collections\nPair = collections.namedtuple('Pair', 'left right')\n"
              "x, y, z = torch.randn(6, 2), torch.randn(6), torch.randn(6, 3, 2)\n"
              "nested = (x, [y, {'z': z, 'n': 7}], Pair(x, 'tag'), 'label', None)\n")
    ok(shell, "%%ondevice cpu\nparts = nn.parallel.scatter(nested, [0, 1, 2])\n"
              "by_dim1 = nn.parallel.scatter({'z': z}, [0, 1], dim=1)\n")
    ns = shell.user_ns
    x, y, z = ns["x"], ns["y"], ns["z"]
    parts = ns["parts"]
    assert isinstance(parts, list) and len(parts) == 3
    for i, part in enumerate(parts):
        assert isinstance(part, tuple)
        torch.testing.assert_close(part[0], x[2 * i:2 * i + 2])
        assert isinstance(part[1], list) and isinstance(part[1][1], dict)
        torch.testing.assert_close(part[1][0], y[2 * i:2 * i + 2])
        torch.testing.assert_close(part[1][1]["z"], z[2 * i:2 * i + 2])
        assert part[1][1]["n"] == 7
        assert type(part[2]).__name__ == "Pair" and part[2].right == "tag"
        assert part[3] == "label" and part[4] is None
    assert [d["z"].shape for d in ns["by_dim1"]] == [(6, 2, 2), (6, 1, 2)]
    # The same nest as torch's own scatter_map makes, with torch's Scatter split as comm.scatter splits.
    monkeypatch.setattr(scatter_gather, "Scatter", _ChunkScatter)
    same_structure(parts, scatter_gather.scatter(ns["nested"], [0, 1, 2]))
    same_structure(ns["by_dim1"], scatter_gather.scatter({"z": z}, [0, 1], dim=1))


# -- 4. parallel_apply with keyword arguments; gather through containers --------------------------

KWARGS_SEED = """\
import torch, torch.nn as nn
torch.manual_seed(2)
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
    def forward(self, x, scale=1.0, shift=None):
        out = self.lin(x) * scale
        return {'out': out if shift is None else out + shift, 'pair': (out.sum(1), [x.mean(1)])}
net = Scaled()
x = torch.randn(6, 4)
shift = torch.randn(6, 2)
"""


def test_parallel_apply_with_kwargs_and_gathered_containers(shell):
    ok(shell, KWARGS_SEED)
    ok(shell, """%%ondevice cpu
from torch.nn.parallel.scatter_gather import scatter_kwargs
reps = nn.parallel.replicate(net.cuda(), [0, 1])
ins, kws = scatter_kwargs((x,), {'scale': 2.0, 'shift': shift}, [0, 1])
outs = nn.parallel.parallel_apply(reps, ins, kws)
got = nn.parallel.gather(outs, 'cuda:0')
plain = nn.parallel.gather(nn.parallel.parallel_apply(reps, [x[:3], x[3:]], [{'scale': 3.0}] * 2), 0)
""")
    ns = shell.user_ns
    net, x, shift = ns["net"], ns["x"], ns["shift"]
    assert len(ns["ins"]) == len(ns["kws"]) == 2 and ns["kws"][0]["scale"] == 2.0
    want = net(x, scale=2.0, shift=shift)
    assert isinstance(ns["got"], dict) and isinstance(ns["got"]["pair"], tuple)
    assert isinstance(ns["got"]["pair"][1], list)
    torch.testing.assert_close(ns["got"]["out"], want["out"])
    torch.testing.assert_close(ns["got"]["pair"][0], want["pair"][0])
    torch.testing.assert_close(ns["got"]["pair"][1][0], want["pair"][1][0])
    torch.testing.assert_close(ns["plain"]["out"], net(x, scale=3.0)["out"])


def test_gather_dims_scalars_and_torch_structure(shell, monkeypatch):
    ok(shell, "import torch, torch.nn as nn, collections\na, b = torch.randn(2, 3), torch.randn(2, 4)\n"
              "P = collections.namedtuple('P', 'l r')\n")
    with pytest.warns(UserWarning, match="all input tensors were scalars"):   # torch's warning, as on GPUs
        ok(shell, """%%ondevice cpu
wide = nn.parallel.gather([a, b], 0, dim=1)
losses = nn.parallel.gather([a.sum(), b.sum()], 0)
named = nn.parallel.gather([P(a, None), P(a * 2, None)], 0)
""")
    ns = shell.user_ns
    torch.testing.assert_close(ns["wide"], torch.cat([ns["a"], ns["b"]], 1))
    torch.testing.assert_close(ns["losses"], torch.stack([ns["a"].sum(), ns["b"].sum()]))
    assert ns["named"].r is None and ns["named"].l.shape == (4, 3)
    monkeypatch.setattr(scatter_gather, "Gather", _CatGather)
    same_structure(ns["wide"], scatter_gather.gather([ns["a"], ns["b"]], 0, dim=1))


def test_too_few_rows_for_the_ids_fails_as_torch_does(shell):
    """A batch of 3 over 4 ids gives 3 chunks (torch's chunk); 4 replicas then do not match, as on GPUs."""
    ok(shell, SEED + "small = input[:3]\n")
    result, out, _ = run_cell(shell, "%%ondevice cpu\nreps = nn.parallel.replicate(module, [0, 1, 2, 3])\n"
                                     "nn.parallel.parallel_apply(reps, nn.parallel.scatter(small, [0, 1, 2, 3]))\n")
    assert isinstance(result.error_in_exec, AssertionError)
    assert "number of modules 4 is not equal to the number of inputs 3" in str(result.error_in_exec)
    assert "Broadcast" not in ANSI.sub("", out)


# -- 5. data_parallel and nn.DataParallel ------------------------------------------------------------

def test_data_parallel_function(shell):
    ok(shell, SEED + KWARGS_SEED)
    ok(shell, """%%ondevice cpu
from torch.nn.parallel import data_parallel
two = nn.parallel.data_parallel(module, input, device_ids=[0, 1], output_device=0)
every = data_parallel(module, input)
small = nn.parallel.data_parallel(module, input[:1], [0, 1, 2])
keyed = nn.parallel.data_parallel(net, (x,), [0, 1], module_kwargs={'scale': 2.0, 'shift': shift})
""")
    ns = shell.user_ns
    want = ns["module"](ns["input"])
    torch.testing.assert_close(ns["two"], want)
    torch.testing.assert_close(ns["every"], want)
    torch.testing.assert_close(ns["small"], want[:1])
    torch.testing.assert_close(ns["keyed"]["out"], ns["net"](ns["x"], scale=2.0, shift=ns["shift"])["out"])


def test_data_parallel_module_on_a_gpu_machine_leaves_cuda_alone(shell, monkeypatch, no_cuda_init):
    """With GPUs present, torch's DataParallel would ask CUDA about them (and move the module there);
    in a cpu cell it is what torch makes without a GPU: the module, run on the whole batch."""
    dp_mod = sys.modules["torch.nn.parallel.data_parallel"]   # the attribute of that name is the function
    monkeypatch.setattr(dp_mod, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(dp_mod, "_get_all_device_indices", lambda: [0, 1])
    ok(shell, SEED)
    ok(shell, "%%ondevice cpu\nmodel = nn.DataParallel(module, device_ids=[0, 1])\nout = model(input)\n")
    ns = shell.user_ns
    model = ns["model"]
    assert isinstance(model, nn.DataParallel) and model.module is ns["module"] and model.device_ids == []
    assert next(model.parameters()).device.type == "cpu"
    assert all(k.startswith("module.") for k in model.state_dict())
    torch.testing.assert_close(ns["out"], ns["module"](ns["input"]))
    result, _, _ = run_cell(shell, "%%ondevice cpu\nnn.DataParallel(module, devices=[0])\n")
    assert isinstance(result.error_in_exec, TypeError)                # torch's signature still holds


# -- 6. later cells, the rewrite, and CUDA targets ----------------------------------------------------

def test_function_made_in_the_cell_keeps_working_in_a_plain_cell(shell):
    ok(shell, SEED)
    ok(shell, """%%ondevice cpu
def dp_forward(m, x, ids):
    reps = nn.parallel.replicate(m, ids)
    return nn.parallel.gather(nn.parallel.parallel_apply(reps, nn.parallel.scatter(x, ids)), 0)
""")
    ok(shell, "later = dp_forward(module, input, [0, 1])\n")
    torch.testing.assert_close(shell.user_ns["later"], shell.user_ns["module"](shell.user_ns["input"]))


@pytest.mark.parametrize("src,method", [
    ("nn.parallel.replicate(m, ids)", "dp_replicate"),
    ("torch.nn.parallel.scatter(x, ids, dim=1)", "dp_scatter"),
    ("nn.parallel.parallel_apply(reps, ins, kws)", "dp_parallel_apply"),
    ("nn.parallel.gather(outs, 0)", "dp_gather"),
    ("nn.parallel.data_parallel(m, x, [0, 1])", "dp_data_parallel"),
    ("nn.DataParallel(m, device_ids=[0, 1])", "dp_module"),
    ("import torch.nn.parallel as P\nP.gather(outs, 0)", "dp_gather"),
    ("from torch.nn.parallel.scatter_gather import scatter_kwargs as sk\nsk(i, k, ids)", "dp_scatter_kwargs"),
    ("from torch.nn.parallel import replicate\nreplicate(m, ids)", "dp_replicate"),
    ("from torch.nn import parallel\nparallel.scatter(x, ids)", "dp_scatter"),
])
def test_rewrite_sends_the_calls_to_the_helper(src, method):
    tree, rewriter = rewrite_placement(ast.parse(textwrap.dedent(src)), {"torch": torch, "nn": nn})
    code = ast.unparse(tree)
    assert f"{HELPER}.{method}(" in code, code


def test_names_imported_in_an_earlier_cell_are_rewritten_too():
    from torch.nn.parallel import gather as g
    tree, _ = rewrite_placement(ast.parse("g(outs, 0)"), {"g": g})
    assert f"{HELPER}.dp_gather(g, outs, 0)" in ast.unparse(tree)


def test_user_functions_with_the_same_names_are_called_as_written():
    here = Placement("cpu")
    assert here.dp_replicate(lambda m, ids: ("mine", m, ids), "m", [0, 1]) == ("mine", "m", [0, 1])
    assert here.dp_gather(lambda outs, dev, dim=0: (outs, dev, dim), [1], 0, dim=1) == ([1], 0, 1)


@pytest.mark.parametrize("target", ["cuda:0", None])
def test_a_cuda_target_or_none_calls_torch_unchanged(target, no_cuda_init):
    """No GPU needed: the helper hands the call to torch as written (which then fails here as torch does)."""
    helper = Placement(target)
    seen = []

    def recorder(*args, **kwargs):
        seen.append((args, kwargs))
        return "torch's"

    for method in ("dp_replicate", "dp_scatter", "dp_scatter_kwargs", "dp_parallel_apply", "dp_gather",
                   "dp_data_parallel", "dp_module"):
        assert getattr(helper, method)(recorder, 1, 2, dim=3) == "torch's"
    assert seen == [((1, 2), {"dim": 3})] * 7
    module = nn.Linear(2, 2)
    with pytest.raises(AssertionError, match="Broadcast function not implemented for CPU tensors"):
        helper.dp_replicate(torch.nn.parallel.replicate, module, [0, 1])


def test_module_elsewhere_fails_as_on_gpus(shell):
    """replicate needs the module on the cell's device, as torch needs it on device_ids[0]."""
    ok(shell, SEED)
    result, _, _ = run_cell(shell, "%%ondevice meta\nreps = nn.parallel.replicate(module, [0, 1])\n")
    assert isinstance(result.error_in_exec, RuntimeError)
    assert "must be on meta" in str(result.error_in_exec)


# -- 7. on a real GPU: torch's own calls ------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_target_goes_to_torch_unchanged_gpu(shell, monkeypatch):
    import torch.nn.parallel as parallel
    calls: list[str] = []
    for name in ("replicate", "scatter", "parallel_apply", "gather"):
        real = getattr(parallel, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(parallel, name, spy)
    ok(shell, SEED)
    ok(shell, article_cell("cuda:0", "list(range(torch.cuda.device_count()))"))
    ns = shell.user_ns
    assert calls == ["replicate", "scatter", "parallel_apply", "gather"]
    count = torch.cuda.device_count()
    assert [r[0].weight.device for r in ns["replicas"]] == [torch.device("cuda", i) for i in range(count)]
    assert ns["result"].device == torch.device("cuda:0")
    torch.testing.assert_close(ns["result"], ns["module"](ns["input"]))
    ok(shell, "%%ondevice cuda:0\nmodel = nn.DataParallel(module)\n")
    assert shell.user_ns["model"].device_ids == list(range(count))
