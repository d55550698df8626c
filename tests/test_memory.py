"""Memory snapshots, --vars and --free as plain functions and through %gpumem (terminal)."""
from __future__ import annotations

import os

import psutil
import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from gpumagic.devices import memory, nvml
from tests.conftest import run_cell
from tests.fake_nvml import FakeNvml, four_gpu_machine

GiB = 2**30
MiB = 2**20
NO_SUCH_PID = 4_194_400  # above Linux's largest pid_max, so no process has it


@pytest.fixture
def machine(monkeypatch):
    """Four fake GPUs; cuda:1 runs this process (3 GiB) and another live one."""
    fake = four_gpu_machine()
    fake.gpus[1]["processes"] = [(os.getpid(), 3 * GiB), (os.getppid(), GiB)]
    fake.gpus[2]["processes"] = [(os.getppid(), 2 * GiB)]
    fake.gpus[3]["processes"] = [(NO_SUCH_PID, GiB)]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    nvml.use(fake)
    yield fake
    nvml.use(None)


@pytest.fixture
def no_cuda_init(monkeypatch):
    """Fail the test if anything asks torch to initialise CUDA."""
    calls = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda *a, **k: calls.append(a))
    yield calls
    assert calls == []
    assert not torch.cuda.is_initialized()


# --------------------------------------------------------------------------- snapshots

def test_cpu_snapshot_matches_psutil():
    row = memory.snapshot("cpu", gpus=[])["cpu"]
    vm = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    assert row.total == vm.total
    assert abs(row.used - (vm.total - vm.available)) < 256 * MiB
    assert abs(row.process - rss) < 64 * MiB
    assert row.free == row.total - row.used
    assert row.allocated is None and row.reserved is None


def test_gpu_snapshot_reads_nvml_and_this_kernels_share(machine, no_cuda_init):
    snap = memory.snapshot()
    assert [r.device for r in snap.rows][:5] == ["cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    one = snap["cuda:1"]
    assert (one.used, one.total) == (5 * GiB, 141 * GiB)
    assert one.process == 3 * GiB and one.process_note is None
    # Listed processes are all other live ones: this kernel holds nothing there.
    assert snap["cuda:2"].process == 0
    assert snap["cuda:0"].process == 0
    # A pid that exists nowhere here: NVML speaks another pid namespace.
    assert snap["cuda:3"].process is None and snap["cuda:3"].process_note == "pid namespace"
    assert all(r.allocated is None for r in snap.rows)  # CUDA not initialised
    text = snap.text()
    assert "3.0 GiB" in text and "n/a (pid namespace)" in text
    assert "never initialises" in text


def test_compute_and_graphics_lists_do_not_double_count(machine):
    fake = machine
    fake.nvmlDeviceGetGraphicsRunningProcesses = lambda h: fake.nvmlDeviceGetComputeRunningProcesses(h)
    h = fake.gpus[1]
    assert memory.gpu_process_memory(h) == (3 * GiB, None)
    assert memory.gpu_process_memory(h, pid=os.getppid()) == (GiB, None)


def test_unreported_process_memory_is_na(machine):
    machine.gpus[0]["processes"] = [(os.getpid(), None)]
    assert memory.gpu_process_memory(machine.gpus[0]) == (None, "not reported")

    def unsupported(h):
        raise machine.NVMLError("not supported")
    machine.nvmlDeviceGetComputeRunningProcesses = unsupported
    assert memory.gpu_process_memory(machine.gpus[0]) == (None, "not reported")


def test_one_device_snapshot_and_no_nvml(machine):
    snap = memory.snapshot("cuda:0")
    assert [r.device for r in snap.rows] == ["cuda:0"]
    assert snap["cuda:0"].used == GiB
    nvml.use(FakeNvml([]))
    snap = memory.snapshot()
    assert [r.device for r in snap.rows] == ["cpu"]
    assert any("no GPU visible" in n for n in snap.notes)


# --------------------------------------------------------------------------- --vars

def test_tensor_sizes_are_exact():
    ns = {"x": torch.zeros(1000, 3, dtype=torch.float64), "small": torch.ones(7, dtype=torch.int16),
          "n": 3, "s": "text"}
    rep = memory.variable_memory(ns)
    assert rep["x", "cpu"].nbytes == 24_000
    assert rep["small"].nbytes == 14
    assert [r.name for r in rep.rows] == ["x", "small"]
    assert rep.totals == {"cpu": 24_014}


def test_views_and_aliases_count_their_storage_once():
    base = torch.zeros(1000)
    ns = {"base": base, "window": base[10:20], "grid": base.view(10, 100), "alias": base}
    rep = memory.variable_memory(ns)
    # A view keeps its whole storage alive.
    assert {r.name: r.nbytes for r in rep.rows} == {"base": 4000, "window": 4000, "grid": 4000, "alias": 4000}
    assert all(r.shared == 4000 for r in rep.rows)
    assert rep.totals == {"cpu": 4000}


def test_module_params_buffers_and_grads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.BatchNorm1d(20), torch.nn.Linear(20, 5))
    model(torch.randn(4, 10)).sum().backward()
    rep = memory.variable_memory({"model": model})
    row = rep["model"]
    params = (10 * 20 + 20 + 20 + 20 + 20 * 5 + 5) * 4   # weights, biases, BatchNorm affine
    buffers = (20 + 20) * 4 + 8                          # running mean/var, num_batches_tracked
    assert row.parts == {"params": params, "buffers": buffers, "grads": params}
    assert row.nbytes == 2 * params + buffers
    assert row.type == "Sequential"


def test_tied_weights_count_once():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)
            self.out = torch.nn.Linear(8, 50, bias=False)
            self.out.weight = self.emb.weight
    rep = memory.variable_memory({"lm": Tied()})
    assert rep["lm"].parts == {"params": 50 * 8 * 4}


def test_adam_state_is_the_optimizers_memory():
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    rep = memory.variable_memory({"model": model, "opt": opt})
    param_bytes = (16 * 4 + 4) * 4
    # exp_avg and exp_avg_sq per parameter, plus a float32 step counter each.
    assert rep["opt"].parts == {"state": 2 * param_bytes + 2 * 4}
    assert rep["model"].nbytes == 2 * param_bytes  # params and grads
    assert rep.totals["cpu"] == 4 * param_bytes + 8
    assert [r.name for r in rep.rows] == ["opt", "model"]


def test_nested_containers_bounded_and_cycle_safe():
    t1, t2, t3 = torch.ones(100), torch.ones(200, dtype=torch.float64), torch.ones(3, 3)
    loop = [t1]
    loop.append(loop)
    deep = torch.ones(5000)
    too_deep = [[[[[[deep]]]]]]
    ns = {"data": {"train": [t1, (t2, {"deep": t3})], "n": 3}, "loop": loop, "too_deep": too_deep,
          "plain": [1, 2, "x"]}
    rep = memory.variable_memory(ns, max_depth=4)
    assert rep["data"].nbytes == 400 + 1600 + 36
    assert rep["loop"].nbytes == 400
    assert "too_deep" not in {r.name for r in rep.rows}
    assert memory.variable_memory(ns, max_depth=8)["too_deep"].nbytes == 20_000
    assert rep.totals == {"cpu": 400 + 1600 + 36}  # t1 held by two variables, counted once


def test_meta_sparse_hidden_and_sorting():
    dense = torch.eye(50)
    ns = {"meta": torch.empty(10**6, device="meta"),
          "sparse": dense.to_sparse(),           # 50 values (float32) and 2x50 int64 indices
          "big": torch.ones(10_000), "mid": torch.ones(1000), "_private": torch.ones(10**5),
          "Out": {1: torch.ones(10**5)}}
    rep = memory.variable_memory(ns, hidden={"Out"})
    assert [r.name for r in rep.rows] == ["big", "mid", "sparse"]
    assert rep["sparse"].nbytes == 50 * 4 + 2 * 50 * 8
    sizes = [r.nbytes for r in rep.rows]
    assert sizes == sorted(sizes, reverse=True)


def test_device_filter_and_no_torch_objects():
    rep = memory.variable_memory({"x": torch.ones(10)}, device="cuda:0")
    assert rep.rows == [] and rep.totals == {}
    assert "No variable holds tensor memory" in rep.text()


# --------------------------------------------------------------------------- --free

def test_free_collects_cycles_and_reports_cpu_memory():
    def make_garbage():
        cycle = [torch.ones(64 * MiB // 4)]  # 64 MiB, pages touched
        cycle.append(cycle)
    make_garbage()
    rep = memory.free_memory()
    assert rep.collected >= 1
    cpu = rep["cpu"]
    assert cpu.freed == cpu.before - cpu.after
    assert cpu.freed > 48 * MiB
    assert "freed" in rep.text() and "not initialised CUDA" in rep.text()


# --------------------------------------------------------------------------- the magic (terminal)

def test_gpumem_prints_a_table(shell, machine, no_cuda_init):
    result, out, cap = run_cell(shell, "%gpumem")
    assert result.success
    for device in ("cpu", "cuda:0", "cuda:3"):
        assert device in out
    assert "141.0 GiB" in out and cap.outputs == []
    result, out, _ = run_cell(shell, "%gpumem 1")
    assert "cuda:1" in out and "cuda:0" not in out and "3.0 GiB" in out


def test_gpumem_vars_and_free_through_the_shell(shell, no_cuda_init):
    result, out, _ = run_cell(shell, "import torch\nweights = torch.zeros(256, 1024)\nview = weights[:10]")
    assert result.success
    result, out, _ = run_cell(shell, "%gpumem --vars")
    assert result.success
    lines = [line.split() for line in out.splitlines()]
    rows = {cells[0]: cells for cells in lines if cells and cells[0] in ("weights", "view", "torch")}
    assert set(rows) == {"weights", "view"}
    assert rows["weights"][2:5] == ["cpu", "1.0", "MiB"]
    assert "_i" not in out and "Out" not in out
    result, out, _ = run_cell(shell, "%gpumem --free")
    assert result.success and "kernel resident" in out and "output history" not in out
    run_cell(shell, "weights[:256]")  # the value lands in Out[...]
    run_cell(shell, "del weights, view")
    result, out, _ = run_cell(shell, "%gpumem --free")
    assert "output history (Out[...]) still holds tensors: 1.0 MiB on cpu" in out


def test_bad_input_names_the_choices(shell, machine):
    with pytest.raises(UsageError, match=r"cuda:7.*valid choices: cpu, cuda:0, cuda:1, cuda:2, cuda:3$"):
        shell.run_line_magic("gpumem", "cuda:7")
    with pytest.raises(UsageError, match="unknown device 'tpu'; valid choices: cpu, cuda:0"):
        shell.run_line_magic("gpumem", "tpu")
    with pytest.raises(UsageError, match="holds no memory"):
        shell.run_line_magic("gpumem", "meta")
    with pytest.raises(UsageError, match=r"unrecognized arguments: --bogus; usage: %gpumem .*--watch"):
        shell.run_line_magic("gpumem", "--bogus")
    with pytest.raises(UsageError, match="positive number of seconds"):
        shell.run_line_magic("gpumem", "--watch --interval 0")
    with pytest.raises(UsageError, match="positive number of seconds"):
        shell.run_line_magic("gpumem", "--watch --interval nan")
    with pytest.raises(UsageError, match="invalid float value"):
        shell.run_line_magic("gpumem", "--watch --interval soon")
    with pytest.raises(UsageError, match="only applies to --watch"):
        shell.run_line_magic("gpumem", "--interval 1")
    with pytest.raises(UsageError, match="--vars and --free cannot be combined.*--watch, --stop"):
        shell.run_line_magic("gpumem", "--vars --free")


def test_help_lists_every_option(shell):
    with capture_output() as cap:
        shell.run_line_magic("pinfo", "%gpumem")
    for option in ("--watch", "--interval S", "--stop", "--vars", "--free", "device"):
        assert option in cap.stdout
