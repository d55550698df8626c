"""%gpumem through a real InteractiveShell (terminal): tables, --vars, --free, bad input."""
from __future__ import annotations

import os

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from gpumagic.devices import nvml
from tests.conftest import run_cell
from tests.fake_nvml import four_gpu_machine

GiB = 2**30
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
