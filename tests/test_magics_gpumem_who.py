"""``%gpumem --who`` and ``%gpumem --reclaim`` through a real InteractiveShell: text, HTML, --json, bad input."""
from __future__ import annotations

import os
import sys

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from tests.conftest import run_cell
from tests.fake_nvml import LiveNvml, four_gpu_machine, installed
from tests.sharing_helpers import alive, live_worker, orphan_worker

GiB = 2**30


@pytest.fixture
def machine(monkeypatch):
    yield from installed(LiveNvml(four_gpu_machine().gpus), monkeypatch)



@pytest.fixture
def notebook(shell, monkeypatch):
    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    return shell


def test_who_prints_each_gpu_and_its_processes_in_a_terminal(shell, machine, started, tmp_path, no_cuda_init):
    worker = live_worker(started, tmp_path, rank=1)
    machine.gpus[1]["processes"] = [(os.getpid(), 3 * GiB), (worker, GiB)]
    result, out, cap = run_cell(shell, "%gpumem --who")
    assert result.success and cap.outputs == []
    lines = out.splitlines()
    assert "cuda:1 NVIDIA H200: 9.0 GiB / 141.0 GiB used, 4.0 GiB by the 2 process(es) below" in lines
    assert any(line.split() == [str(os.getpid()), "3.0", "GiB", "this", "kernel"] for line in lines)
    assert any(line.split()[:3] == [str(worker), "1.0", "GiB"] and line.endswith("rank 1 of this kernel")
               for line in lines)
    assert lines.count("  (no process)") == 3


def test_who_json_and_one_device(shell, machine, started, tmp_path):
    machine.gpus[2]["processes"] = [(os.getpid(), 2 * GiB)]
    data = shell.run_line_magic("gpumem", "cuda:2 --who --json")
    assert list(data["devices"]) == ["cuda:2"]
    row = data["devices"]["cuda:2"]
    assert row["listed"] == 2 * GiB and row["used"] == 3 * GiB and row["total"] == 141 * GiB
    assert [(p["pid"], p["used"], p["kind"]) for p in row["processes"]] == [(os.getpid(), 2 * GiB, "this kernel")]
    assert data["by_kind"] == {"this kernel": 2 * GiB}


def test_who_and_reclaim_are_html_in_a_notebook(notebook, machine, started, tmp_path):
    orphan, _ = orphan_worker(started, tmp_path)
    machine.gpus[0]["processes"] = [(orphan, 5 * GiB)]
    with capture_output(display=True) as cap:
        notebook.run_line_magic("gpumem", "--who")
    html = cap.outputs[0].data["text/html"]
    assert "<table>" in html and f"<td style='text-align:left'>{orphan}</td>" in html
    assert "orphan: rank 0 of kernel pid" in html
    with capture_output(display=True) as cap:
        notebook.run_line_magic("gpumem", "--reclaim")
    html = cap.outputs[0].data["text/html"]
    assert html.startswith("<div>Ended 1 of 1 orphan(s) in ") and "fell by 5.0 GiB" in html
    assert not alive(orphan)


def test_reclaim_json_reports_the_orphan_ended_and_the_bytes(shell, machine, started, tmp_path):
    worker = live_worker(started, tmp_path, rank=0)
    orphan, _ = orphan_worker(started, tmp_path, rank=1)
    machine.gpus[0]["processes"] = [(orphan, 5 * GiB), (worker, GiB)]
    data = shell.run_line_magic("gpumem", "--reclaim --json")
    assert [(e["pid"], e["held"], e["outcome"]) for e in data["ended"]] == [(orphan, 5 * GiB, "ended by SIGTERM")]
    assert data["freed"] == 5 * GiB and alive(worker) and not alive(orphan)


@pytest.mark.parametrize("line, message", [
    ("--who --vars", "--vars and --who cannot be combined; pick one; valid choices: --watch, --stop, --vars, "
                     "--free, --rescue, --cells, --park, --unpark, --who, --reclaim"),
    ("--who --reclaim", "--who and --reclaim cannot be combined; pick one"),
    ("--reclaim --watch", "--watch and --reclaim cannot be combined; pick one"),
    ("cpu --who", "--who is about GPU processes; cpu has none; valid choices: every GPU (no device), cuda:0, "
                  "cuda:1, cuda:2, cuda:3"),
    ("cpu --reclaim", "--reclaim is about GPU processes; cpu has none"),
    ("--who --interval 1", "--interval only applies to --watch"),
    ("cuda:7 --who", "cuda:7"),
])
def test_bad_input_names_the_valid_choices(shell, machine, line, message):
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("gpumem", line)
    assert type(info.value) is UsageError and message in str(info.value)


def test_who_without_nvml_says_why(shell, monkeypatch, started):
    from gpumagic.devices import nvml

    class NoNvml:
        class NVMLError(Exception):
            pass

        def nvmlInit(self):
            raise self.NVMLError("NVML Shared Library Not Found")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml.use(NoNvml())
    try:
        data = shell.run_line_magic("gpumem", "--who --json")
    finally:
        nvml.use(None)
    assert data["devices"] == {} and data["notes"] == ["no GPU visible: NVML is not available: NVML Shared Library "
                                                       "Not Found."]
    assert sys.modules.get("torch") is None or not sys.modules["torch"].cuda.is_initialized()
