"""The %gpuinfo picker as cells see it: its choice is where a later %%ondevice runs; its text form."""
from __future__ import annotations

import pytest
from IPython.utils.capture import capture_output

from gpumagic import session
from gpumagic.widgets.picker import _open, close_all_pickers
from tests.conftest import run_cell


@pytest.fixture
def notebook(shell, monkeypatch):
    """The shell as a Jupyter kernel would be: widgets are displayed."""
    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    close_all_pickers()
    yield shell
    close_all_pickers()


def session_default() -> str:
    from gpumagic import devices
    return devices.default_device()        # cuda:0 where torch can use a GPU, else cpu


def _picker(notebook):
    with capture_output(display=True) as cap:
        notebook.run_line_magic("gpuinfo", "")
    (picker,) = list(_open)
    return picker, cap


def test_the_picked_device_is_where_a_later_ondevice_cell_runs(notebook):
    picker, _ = _picker(notebook)
    assert picker.value == session_default()
    picker.widget.value = "meta"                # what choosing in the dropdown does
    assert session.picked_device() == "meta"
    result, out, _ = run_cell(notebook, "%%ondevice\nimport torch\nx = torch.zeros(3)\n"
                                        "y = torch.ones(2).cuda()\nprint(x.device, y.device)")
    assert result.success and out.strip() == "meta meta"
    picker.widget.value = "cpu"
    result, out, _ = run_cell(notebook, "%%ondevice\nz = torch.ones(2).cuda()\nprint(z.device, z.sum().item())")
    assert result.success and out.strip() == "cpu 2.0"


def test_a_frontend_without_widgets_reads_the_device_in_the_pickers_text(notebook):
    # The text/plain beside the widget is what jupyter console, an exported notebook or a viewer
    # without the widget state shows; it said "Dropdown(_dom_classes=('gpumagic-device-picker',), ...".
    picker, cap = _picker(notebook)
    text = next(o.data["text/plain"] for o in cap.outputs
                if "application/vnd.jupyter.widget-view+json" in o.data)
    choices = ", ".join(v for _, v in picker.widget.options)
    assert choices.startswith("cpu") and choices.endswith("meta")
    assert text == repr(picker.widget) and len(text) <= 110   # whole: ipywidgets cuts a longer one
    if len(picker.widget.options) <= 6:
        assert text == f"device: {session_default()} (later gpumagic cells run there; choices: {choices})"
    picker.widget.value = "meta"
    assert repr(picker.widget) == f"device: meta (later gpumagic cells run there; choices: {choices})"


def test_the_terminal_and_json_say_where_cells_run(shell):
    # No picker in a terminal: the device cells run on, and how to change it, were said nowhere.
    from gpumagic import devices
    _, out, _ = run_cell(shell, "%gpuinfo")
    here, choices = devices.default_device(), devices.available_devices()
    assert here in ("cpu", "cuda:0") and "cpu" in choices and "meta" in choices
    assert out.rstrip().endswith(f"gpumagic cells run on {here}; gpumagic.set_current_device(DEVICE) changes it "
                                 f"({', '.join(choices)}).")
    session.set_picked_device("meta")
    assert shell.run_line_magic("gpuinfo", "--json")["system"]["current_device"] == "meta"
    assert shell.run_line_magic("gpuinfo", "cpu --json")["system"]["current_device"] == "meta"


def test_picking_a_device_that_is_gone_shows_the_device_cells_use(notebook, monkeypatch, caplog):
    import torch

    from gpumagic import set_current_device
    from gpumagic.devices import nvml
    from gpumagic.widgets.picker import DevicePicker
    from tests.fake_nvml import four_gpu_machine
    if torch.version.cuda is None and torch.version.hip is None:  # a torch that can use the fake GPUs
        monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml.use(four_gpu_machine())
    try:
        set_current_device("cuda:3")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")     # cuda:3 is gone
        picker = DevicePicker()
        assert picker.widget.options[-1] == ("cuda:3: not visible now", "cuda:3")
        picker.value = "cuda:1"
        assert session.picked_device() == "cuda:1"
        picker.value = "cuda:3"        # picking the stale entry used to leave it shown while cells ran on cuda:1
        assert picker.value == session.picked_device() == "cuda:1"
        assert "could not pick cuda:3: device 'cuda:3' is out of range" in caplog.text
    finally:
        close_all_pickers()
        nvml.use(None)


def test_a_failed_pick_shows_the_default_without_pinning_it(notebook, monkeypatch, caplog):
    # An open picker still offering a GPU that a torch without CUDA now cannot use: the dropdown goes
    # back to the default, and the session keeps following the default instead of a pick never made.
    import torch

    from gpumagic.devices import nvml
    from gpumagic.widgets.picker import DevicePicker
    from tests.fake_nvml import four_gpu_machine
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml.use(four_gpu_machine())
    session.set_picked_device(None)
    try:
        picker = DevicePicker()
        assert "cuda:1" in [v for _, v in picker.widget.options]
        monkeypatch.setattr(torch.version, "cuda", None)
        monkeypatch.setattr(torch.version, "hip", None)
        picker.value = "cuda:1"
        assert picker.value == "cpu" and session.picked_device() is None
        assert "could not pick cuda:1" in caplog.text
    finally:
        close_all_pickers()
        nvml.use(None)
        session.set_picked_device(None)
