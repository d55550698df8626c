"""GPUs that NVML sees but a CPU-only torch cannot use: %gpuinfo shows them, cells are never offered them."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import gpumagic
from gpumagic import devices, session
from tests.conftest import run_cell
from tests.fake_nvml import four_gpu_machine, installed

GPUS = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


@pytest.fixture
def cpu_torch_machine(monkeypatch):
    """Four GPUs through NVML, and a torch built without CUDA or ROCm (pip's CPU wheels)."""
    import torch
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    yield from installed(four_gpu_machine(), monkeypatch)
    session.set_picked_device(None)


@pytest.fixture
def no_driver(monkeypatch):
    """Fail on any torch.cuda call that would reach the driver: the build check reads torch.version only."""
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("torch.cuda was asked")
    for name in ("is_available", "device_count", "_lazy_init", "init", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, refuse)


@pytest.fixture
def notebook(shell, monkeypatch):
    """The shell as a Jupyter kernel would be: widgets are displayed."""
    from gpumagic.widgets.picker import close_all_pickers
    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    yield shell
    close_all_pickers()


def test_gpus_are_listed_but_not_offered(cpu_torch_machine, no_driver):
    assert [g.device for g in devices.visible_gpus()] == GPUS          # they exist
    assert devices.available_devices() == ["cpu", "meta"]
    assert devices.default_device() == "cpu"
    assert str(gpumagic.current_device()) == "cpu"
    # A GPU that exists can still be named (%gpuinfo cuda:1 shows it), but the error for one that
    # does not lists only what a cell can use.
    assert devices.parse_device("1") == "cuda:1"
    with pytest.raises(UsageError) as info:
        devices.parse_device("cuda:9")
    assert str(info.value) == ("device 'cuda:9' is out of range (4 GPU(s) visible, none usable by this "
                               "CPU-only torch); valid choices: cpu, meta")
    for spec in ("cuda:1", "gpu"):
        with pytest.raises(UsageError, match=r"is not usable by this torch \(.*, CUDA not built\); "
                                             r"valid choices: cpu, meta$"):
            gpumagic.set_current_device(spec)
    assert session.picked_device() is None
    assert gpumagic.set_current_device("meta") == "meta"


def test_a_rocm_build_uses_the_gpus(cpu_torch_machine, monkeypatch):
    import torch
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert devices.available_devices() == ["cpu", *GPUS, "meta"]
    assert devices.default_device() == "cuda:0"


def test_gpuinfo_shows_the_gpus_and_says_once_why_cells_cannot_use_them(shell, cpu_torch_machine, no_driver):
    result, out, _ = run_cell(shell, "%gpuinfo")
    assert result.success
    header = out.splitlines()[0].split()
    assert header == ["cpu", *GPUS]
    assert "GPU-aaaa1111" in out and "141.0 GiB" in out
    said = [line for line in out.splitlines() if "CPU-only build" in line]
    assert len(said) == 1
    assert said[0].startswith("note: this torch (") and "cells cannot run on the GPUs shown" in said[0]
    assert "pip install torch --index-url https://pypi.org/simple" in said[0]
    assert [d["device"] for d in shell.run_line_magic("gpuinfo", "cuda:1 --json")["devices"]] == ["cuda:1"]
    # %gpuinfo can show every GPU, so its error names them all.
    with pytest.raises(UsageError, match=r"out of range .*; valid choices: cpu, cuda:0, cuda:1, cuda:2, cuda:3, meta$"):
        shell.run_line_magic("gpuinfo", "cuda:9")


def test_picker_offers_only_what_cells_can_use(notebook, cpu_torch_machine):
    from gpumagic.widgets.picker import _open
    with capture_output(display=True):
        notebook.run_line_magic("gpuinfo", "")
    (picker,) = list(_open)
    assert [value for _, value in picker.widget.options] == ["cpu", "meta"]
    assert picker.value == "cpu"


def test_bare_ondevice_runs_on_the_cpu_and_errors_list_usable_devices(shell, cpu_torch_machine):
    result, out, _ = run_cell(shell, "%%ondevice\nimport torch\nwhere = torch.ones(2).device.type\n")
    assert result.success, out
    assert shell.user_ns["where"] == "cpu"
    result, out, _ = run_cell(shell, "%%ondevice cuda:9\nz = 1\n")
    assert isinstance(result.error_in_exec, UsageError)
    assert str(result.error_in_exec).endswith("valid choices: cpu, meta")
    assert "z" not in shell.user_ns


def test_sharedtrain_device_refuses_a_gpu_this_torch_cannot_use(shell, cpu_torch_machine):
    # Before anything starts: the model stays where it was, not half moved by a torch without CUDA.
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(2, 2)\n")
    result, out, _ = run_cell(shell, "%%sharedtrain -n 1 --device cuda:0\nmodel(torch.ones(1, 2))\n")
    assert isinstance(result.error_in_exec, UsageError), out
    assert str(result.error_in_exec) == ("--device cuda:0 is not usable by this torch "
                                         f"({__import__('torch').__version__}, CUDA not built); valid choices: cpu")
    assert shell.user_ns["model"].weight.device.type == "cpu"
    assert not shell.user_ns["model"].weight.is_shared()
