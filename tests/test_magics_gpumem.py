"""%gpumem through a real InteractiveShell (terminal): tables, --vars, --free, bad input."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from tests.conftest import run_cell
from tests.fake_nvml import busy_four_gpu_machine, installed

pytestmark = pytest.mark.usefixtures("no_last_error")


@pytest.fixture
def machine(monkeypatch):
    yield from installed(busy_four_gpu_machine(), monkeypatch)


def test_gpumem_prints_a_table(shell, machine, no_cuda_init):
    result, out, cap = run_cell(shell, "%gpumem")
    assert result.success
    for device in ("cpu", "cuda:0", "cuda:3"):
        assert device in out
    assert "141.0 GiB" in out and cap.outputs == []
    result, out, _ = run_cell(shell, "%gpumem 1")
    assert "cuda:1" in out and "cuda:0" not in out and "3.0 GiB" in out
    busy = shell.run_line_magic("gpumem", "cuda:1 --json")
    assert list(busy["devices"]) == ["cuda:1"] and busy["devices"]["cuda:1"]["process"] == 3 * 2**30
    assert busy["notes"] == ["torch allocator figures appear once this kernel uses CUDA (reading memory here "
                             "never initialises it)."]


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
    # 1e-9 would have the monitor thread burn the kernel's CPU; 1e10 overflowed its wait and killed it
    for interval in ("0", "nan", "1e-9", "-1", "inf", "1e10"):
        with pytest.raises(UsageError, match=r"--interval must be a number of seconds from 0.05 to 3600, not "
                                             r".*; valid choices: 0.05, 0.25 \(default\), .*3600$"):
            shell.run_line_magic("gpumem", f"--watch --interval {interval}")
    with pytest.raises(UsageError, match="--interval: must be a number of seconds from 0.05 to 3600, not 'soon'"):
        shell.run_line_magic("gpumem", "--watch --interval soon")
    with pytest.raises(UsageError, match="only applies to --watch"):
        shell.run_line_magic("gpumem", "--interval 1")
    with pytest.raises(UsageError, match="--vars and --free cannot be combined.*--watch, --stop"):
        shell.run_line_magic("gpumem", "--vars --free")


def test_help_lists_every_option(shell):
    with capture_output() as cap:
        shell.run_line_magic("pinfo", "%gpumem")
    for option in ("--watch", "--interval S", "--stop", "--vars", "--free", "--json", "device"):
        assert option in cap.stdout


def test_json_returns_the_reports_data_and_shows_nothing(shell, no_cuda_init):
    # As `%gpuinfo --json`: the plain magic shows its report once and returns None (returning the report too
    # would show it twice at the end of a cell); --json returns the data and shows nothing.
    run_cell(shell, "import torch\nweights = torch.zeros(256, 1024)")
    result, out, cap = run_cell(shell, "shown = %gpumem --vars")
    assert result.success and "weights" in out and shell.user_ns["shown"] is None
    result, out, cap = run_cell(shell, "held = %gpumem --vars --json")
    assert result.success and out == "" and cap.outputs == []
    held = shell.user_ns["held"]
    assert held["variables"][0]["name"] == "weights" and held["variables"][0]["bytes"] == 1024 * 1024
    assert held["totals"] == {"cpu": 1024 * 1024}
    freed = shell.run_line_magic("gpumem", "--free --json")
    assert isinstance(freed["collected"], int) and "cpu" in freed["devices"]
    assert set(freed["devices"]["cpu"]) == {"measured", "before", "after", "freed"}
    table = shell.run_line_magic("gpumem", "cpu --json")
    assert list(table["devices"]) == ["cpu"] and table["devices"]["cpu"]["total"] > 0 and table["notes"] == []
    for action in ("--watch", "--stop"):
        with pytest.raises(UsageError, match=f"--json returns a report's data; {action} has none"):
            shell.run_line_magic("gpumem", f"{action} --json")


def test_json_keeps_the_notes_and_the_history_note_names_only_what_it_alone_holds(shell, no_cuda_init):
    run_cell(shell, "import torch\nweights = torch.zeros(256, 1024)")
    run_cell(shell, "weights")                          # Out[...] holds what `weights` holds: nothing to free
    for magic in ("--vars", "--free"):
        _, out, _ = run_cell(shell, f"%gpumem {magic}")
        assert "output history" not in out
    run_cell(shell, "torch.ones(1024)")                 # Out[...] alone holds this one
    held = shell.run_line_magic("gpumem", "--vars --json")
    assert held["notes"] == ["the output history (Out[...]) still holds tensors: 4.0 KiB on cpu that no "
                             "variable holds; `%gpumem --free --history` lets them go."]
    assert held["variables"][0]["truncated"] is False


def test_an_empty_visible_devices_is_named_as_what_hides_the_gpus(shell, machine, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _, out, _ = run_cell(shell, "%gpumem")
    assert "no GPU visible: CUDA_VISIBLE_DEVICES=''." in out and "cuda:0" not in out
    # --json keeps the notes, as for --vars and --free (the table's data used to drop them)
    table = shell.run_line_magic("gpumem", "--json")
    assert list(table["devices"]) == ["cpu"] and table["notes"] == ["no GPU visible: CUDA_VISIBLE_DEVICES=''."]
