"""%gpuinfo through a real InteractiveShell, the device picker, and extension loading."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from IPython.utils.capture import capture_output

import gpumagic
from gpumagic import session
from gpumagic.devices import nvml
from tests.conftest import ROOT, run_cell
from tests.fake_nvml import four_gpu_machine


@pytest.fixture
def fake_machine(monkeypatch):
    import torch
    if torch.version.cuda is None and torch.version.hip is None:  # a torch that can use the fake GPUs
        monkeypatch.setattr(torch.version, "cuda", "12.8")
    nvml.use(four_gpu_machine())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,1,3")
    yield
    nvml.use(None)


@pytest.fixture
def notebook(shell, monkeypatch):
    """The shell as a Jupyter kernel would be: widgets are displayed."""
    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    yield shell


def test_text_table_on_this_machine(shell):
    result, out, _ = run_cell(shell, "%gpuinfo")
    assert result.success
    assert "cpu" in out and "memory total" in out and "torch " in out
    assert "CUDA initialised in this kernel: no" in out


def test_json_returns_plain_data(shell):
    import psutil
    report = shell.run_line_magic("gpuinfo", "--json")
    cpu = report["devices"][0]
    assert cpu["device"] == "cpu"
    assert cpu["memory_total"] == psutil.virtual_memory().total
    assert cpu["cores_logical"] == psutil.cpu_count()
    assert report["system"]["torch_version"] == __import__("torch").__version__


def test_table_numbers_gpus_as_torch_does(shell, fake_machine):
    report = shell.run_line_magic("gpuinfo", "--json")
    gpus = report["devices"][1:]
    assert [(g["device"], g["uuid"]) for g in gpus] == [
        ("cuda:0", "GPU-cccc3333"), ("cuda:1", "GPU-aaaa1111"), ("cuda:2", "GPU-bbbb2222"), ("cuda:3", "GPU-dddd4444")]
    assert report["system"]["driver_version"] == "580.159.04"
    assert report["system"]["cuda_driver_version"] == "13.0"
    # Peers follow torch's numbering too: NVML 0 <-> NVML 1 is cuda:1 <-> cuda:2.
    assert gpus[1]["nvlink_peers"] == {"cuda:2": 2}
    _, out, _ = run_cell(shell, "%gpuinfo")
    assert "GPU-cccc3333" in out and "gen 5 x16" in out and "n/a" in out
    assert "cuda:2 (2 links)" in out


def test_one_device_and_bad_devices(shell, fake_machine):
    report = shell.run_line_magic("gpuinfo", "cuda:2 --json")
    assert [d["device"] for d in report["devices"]] == ["cuda:2"]
    for bad, words in [("cuda:4", "out of range"), ("tpu", "unknown device")]:
        result, out, _ = run_cell(shell, f"%gpuinfo {bad}")
        assert not result.success
        assert words in out and "cpu, cuda:0, cuda:1, cuda:2, cuda:3, meta" in out


def test_bad_flag_names_the_valid_flags(shell):
    result, out, _ = run_cell(shell, "%gpuinfo --everything")
    assert not result.success
    assert "unrecognized arguments: --everything" in out and "[--all] [--json] [device]" in out


def test_help_lists_every_option(shell):
    # `%gpuinfo?` shows this docstring, which magic_arguments extends with the options.
    doc = shell.find_line_magic("gpuinfo").__doc__
    for option in ("--all", "--json", "device", "Examples"):
        assert option in doc


def test_all_without_pycuda_says_how_to_get_it(shell):
    import importlib.util
    if importlib.util.find_spec("pycuda") is not None:
        pytest.skip("pycuda is installed here")
    _, out, _ = run_cell(shell, "%gpuinfo --all")
    assert "pip install 'gpumagic[pycuda]'" in out


def test_notebook_shows_a_picker_and_picking_sets_the_device(notebook, fake_machine):
    with capture_output(display=True) as cap:
        notebook.run_line_magic("gpuinfo", "")
    kinds = [set(o.data) for o in cap.outputs]
    assert any("text/html" in k for k in kinds)
    assert any("application/vnd.jupyter.widget-view+json" in k for k in kinds)

    from gpumagic.widgets.picker import DevicePicker, _open
    picker = next(iter(_open))
    labels = [label for label, _ in picker.widget.options]
    assert [v for _, v in picker.widget.options] == ["cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3", "meta"]
    assert labels[1].startswith("cuda:0: NVIDIA H200, ") and labels[1].endswith("GiB free")
    assert picker.value == "cuda:0"
    picker.value = "cuda:3"                    # what choosing in the dropdown does
    assert str(gpumagic.current_device()) == "cuda:3"
    gpumagic.set_current_device("cpu")         # and code moves every open picker
    assert picker.value == "cpu"
    second = DevicePicker()
    assert second.value == "cpu"


def test_one_utilisation_row_for_every_device(shell, fake_machine):
    # Two rows both labelled "utilisation" (one for the GPUs, one for the CPU) read as a contradiction.
    _, out, _ = run_cell(shell, "%gpuinfo")
    rows = [line for line in out.splitlines() if line.startswith("utilisation")]
    assert len(rows) == 1 and rows[0].startswith("utilisation (time busy)")
    cells = rows[0].removeprefix("utilisation (time busy)").split()
    assert cells[0].isdigit() and cells[1:] == ["%", "37", "%", "37", "%", "37", "%", "n/a"]  # cpu, cuda:0..3
    assert sum(line.startswith("memory utilisation (time busy)") for line in out.splitlines()) == 1
    report = shell.run_line_magic("gpuinfo", "--json")   # the data keep their own keys
    assert "utilization_cpu" in report["devices"][0] and "utilization_gpu" in report["devices"][1]


def test_closing_a_picker_closes_its_layout_and_style(notebook, fake_machine):
    from ipywidgets.widgets.widget import _instances

    from gpumagic.widgets.picker import DevicePicker
    before = set(_instances)
    picker = DevicePicker()
    assert len(set(_instances) - before) == 3   # the Dropdown, its Layout and its DescriptionStyle
    picker.close()
    assert set(_instances) - before == set()


def test_an_earlier_picker_keeps_working_after_another_gpuinfo(notebook, fake_machine):
    # An older picker may still be shown in an earlier cell's output: the kernel cannot know it is
    # gone, so it stays open (closed by %unload_ext) and keeps following the session.
    from gpumagic.widgets.picker import _open, close_all_pickers
    close_all_pickers()
    try:
        with capture_output(display=True):
            notebook.run_line_magic("gpuinfo", "")
            notebook.run_line_magic("gpuinfo", "")
        first, second = list(_open)
        assert first.widget.comm is not None and second.widget.comm is not None
        gpumagic.set_current_device("cuda:2")
        assert first.value == second.value == "cuda:2"
    finally:
        close_all_pickers()


def test_terminal_shows_no_widget(shell, fake_machine):
    with capture_output(display=True) as cap:
        shell.run_line_magic("gpuinfo", "")
    assert not cap.outputs
    assert "cuda:3" in cap.stdout and "Dropdown" not in cap.stdout


def test_unload_closes_pickers_and_removes_magics(notebook, fake_machine):
    from gpumagic.widgets.picker import _open
    with capture_output(display=True):
        notebook.run_line_magic("gpuinfo", "")
    widgets = [p.widget for p in _open]
    assert widgets
    notebook.run_line_magic("unload_ext", "gpumagic")
    try:
        assert "gpuinfo" not in notebook.magics_manager.magics["line"]
        assert not list(_open)
        assert all(w.comm is None for w in widgets)
    finally:
        notebook.run_line_magic("load_ext", "gpumagic")
    assert "gpuinfo" in notebook.magics_manager.magics["line"]


def test_loading_twice_is_harmless(shell):
    gpumagic.load_ipython_extension(shell)
    gpumagic.load_ipython_extension(shell)
    result, out, _ = run_cell(shell, "%gpuinfo cpu")
    assert result.success and out.count("memory total") == 1


def test_import_is_light():
    code = ("import sys, gpumagic, gpumagic.magics.info; "
            "heavy = [m for m in ('torch', 'pynvml', 'ipywidgets') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_gpuinfo_never_initialises_cuda(shell, fake_machine):
    import torch
    shell.run_line_magic("gpuinfo", "--json")
    with capture_output():
        shell.run_line_magic("gpuinfo", "")
    assert not torch.cuda.is_initialized()
    assert session.picked_device() is None


def test_odd_visible_devices_are_quoted_and_escaped(notebook, fake_machine, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")           # hides every GPU; the note must show it
    report = notebook.run_line_magic("gpuinfo", "--json")
    assert [d["device"] for d in report["devices"]] == ["cpu"]
    assert report["notes"] == ["NVML sees no GPU visible to this process (CUDA_VISIBLE_DEVICES='')"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "<b>7</b>")   # out of range, and markup in a note
    with capture_output(display=True) as cap:
        notebook.run_line_magic("gpuinfo", "")
    html = next(o.data["text/html"] for o in cap.outputs if "text/html" in o.data)
    assert "<b>7</b>" not in html and "CUDA_VISIBLE_DEVICES=&#x27;&lt;b&gt;7&lt;/b&gt;&#x27;" in html
    notebook.run_line_magic("unload_ext", "gpumagic")        # close the picker
    notebook.run_line_magic("load_ext", "gpumagic")


def test_a_picker_shows_a_picked_device_that_is_gone(notebook, fake_machine, monkeypatch):
    from gpumagic.widgets.picker import DevicePicker
    gpumagic.set_current_device("cuda:3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")        # cuda:3 no longer exists
    picker = DevicePicker()
    try:
        # Cells still go to cuda:3 (and fail there): the picker must not show another device.
        assert picker.value == "cuda:3" == session.picked_device()
        assert picker.widget.options[-1] == ("cuda:3: not visible now", "cuda:3")
        picker.value = "cuda:1"
        assert session.picked_device() == "cuda:1"
    finally:
        picker.close()


FRESH_KERNEL_CPU = """
import json, subprocess, sys, time
spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])   # one core busy throughout
try:
    import psutil, torch   # a notebook's first cell
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    time.sleep(0.3)
    shell.run_line_magic("load_ext", "gpumagic")   # %load_ext and %gpuinfo in one cell
    started = time.monotonic()
    first = shell.run_line_magic("gpuinfo", "cpu --json")["devices"][0]
    took = time.monotonic() - started
    again = shell.run_line_magic("gpuinfo", "cpu --json")["devices"][0]
    time.sleep(0.5)
    later = shell.run_line_magic("gpuinfo", "cpu --json")["devices"][0]
    from IPython.utils.capture import capture_output
    with capture_output() as cap:
        shell.run_line_magic("gpuinfo", "cpu")
finally:
    spinner.kill()
keys = ("utilization_cpu", "utilization_cpu_seconds")
print(json.dumps({"cores": psutil.cpu_count(), "took": took, "text": cap.stdout,
                  **{name: [facts.get(k) for k in keys] for name, facts in
                     (("first", first), ("again", again), ("later", later))}}))
"""


def test_cpu_utilisation_is_measured_in_a_fresh_kernel():
    # psutil.cpu_percent(interval=None)'s first call in a process measured a window of microseconds since
    # psutil's import: the fresh kernel's first %gpuinfo showed 0 % (or 100 %) CPU whatever the load.
    out = subprocess.run([sys.executable, "-c", FRESH_KERNEL_CPU], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    one_core = 100 / seen["cores"]
    (busy, window), (busy_again, window_again), (busy_later, window_later) = seen["first"], seen["again"], seen["later"]
    assert busy >= 0.8 * one_core                          # the spinning core, at least
    assert window >= 0.1 and seen["took"] < 1.0           # a real window, without keeping the kernel waiting
    assert (busy_again, window_again) == (busy, window)    # asked again at once: the same reading
    assert 0.5 <= window_later < 1.0 and busy_later >= 0.8 * one_core
    row = next(line for line in seen["text"].splitlines() if line.startswith("utilisation (time busy)"))
    assert row.split()[-2:] == [f"{busy_later:.0f}", "%"]
