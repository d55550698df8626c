"""%gpumem --vars through a real InteractiveShell: what a notebook's callables and shell handles hold."""
from __future__ import annotations

import gc
import sys
import threading
import weakref

import pytest
from IPython.utils.capture import capture_output

from gpumagic.widgets import monitor
from tests.conftest import run_cell

pytestmark = pytest.mark.usefixtures("no_last_error")


@pytest.fixture
def notebook(shell, monkeypatch):
    """The shell as a Jupyter kernel would be: widgets are displayed."""
    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    yield shell
    monitor.stop()


def test_a_partial_and_a_lambda_over_tensors_are_listed(shell, no_cuda_init):
    result, _, _ = run_cell(shell, "import functools, torch\n"
                                   "def train(x, model=None):\n    return model(x)\n"
                                   "model = torch.nn.Linear(256, 256)\n"
                                   "step = functools.partial(train, model=model)\n"
                                   "target = torch.zeros(4096)\n"
                                   "loss = (lambda t: lambda out: (out - t).sum())(target)\n"
                                   "del target")
    assert result.success
    held = shell.run_line_magic("gpumem", "--vars --json")
    params = 256 * 256 * 4 + 256 * 4
    assert {v["name"]: v["bytes"] for v in held["variables"]} == {"model": params, "step": params, "loss": 16384}
    step = next(v for v in held["variables"] if v["name"] == "step")
    assert step["shared_with"] == ["model"] and step["parts"] == {"params": params}
    assert held["totals"] == {"cpu": params + 16384}


def test_the_shell_is_not_a_variable_that_holds_everything(shell, no_cuda_init):
    # `ip = get_ipython()` reaches every variable through the shell's namespace and output history;
    # listing them all again under `ip` (and under any bound method of the shell) said nothing.
    run_cell(shell, "import torch\nbig = torch.zeros(1 << 18)\nip = get_ipython()\nrun = ip.run_cell\n"
                    "names = globals()")
    run_cell(shell, "torch.ones(1024)")          # Out[...] alone holds this one
    held = shell.run_line_magic("gpumem", "--vars --json")
    assert [(v["name"], v["bytes"]) for v in held["variables"]] == [("big", 1 << 20)]
    assert held["notes"] == ["the output history (Out[...]) still holds tensors: 4.0 KiB on cpu that no "
                             "variable holds; `%gpumem --free --history` lets them go."]
    _, out, _ = run_cell(shell, "%gpumem --vars")
    assert "InteractiveShell" not in out and "\nrun " not in out


def test_no_report_keeps_a_deleted_model_alive(notebook):
    run_cell(notebook, "import functools, torch\nmodel = torch.nn.Linear(512, 512)\n"
                       "opt = torch.optim.Adam(model.parameters())\nstep = functools.partial(print, model)")
    gone = weakref.ref(notebook.user_ns["model"])
    for line in ("--watch --interval 0.05", "--vars", "--vars --json", "--free", "", "--json"):
        result, _, _ = run_cell(notebook, f"%gpumem {line}")
        assert result.success, line
    run_cell(notebook, "del model, opt, step")
    gc.collect()
    assert gone() is None
    assert monitor.current() is not None and monitor.current().running


def test_twenty_watch_and_stop_leave_no_thread(notebook):
    before = {t.ident for t in threading.enumerate()}
    with capture_output(display=True):
        for _ in range(20):
            notebook.run_line_magic("gpumem", "--watch --interval 0.05")
            notebook.run_line_magic("gpumem", "--stop")
    assert {t.ident for t in threading.enumerate() if t.is_alive()} - before == set()
    assert monitor.current() is None


def test_variable_memory_of_globals_in_a_notebook_leaves_the_shell_out(shell):
    # exit, quit and get_ipython reach the shell, and through it every variable and Out[...].
    result, _, _ = run_cell(shell, "import torch\nfrom gpumagic.memory import variable_memory\n"
                                   "big = torch.zeros(1 << 16)\n"
                                   "names = sorted(r.name for r in variable_memory(globals()).rows)")
    assert result.success and shell.user_ns["names"] == ["big"]


def test_the_last_errors_frames_are_named_as_what_holds_their_tensors(shell, no_cuda_init):
    # A cell that failed inside a function (an out-of-memory error mid-forward) leaves its frames, and
    # their activations, alive in sys.last_traceback: memory no variable accounted for.
    result, _, _ = run_cell(shell, "import torch\ndef forward():\n    act = torch.zeros(1 << 18)\n"
                                   "    raise RuntimeError('out of memory')\nforward()")
    assert not result.success
    held = shell.run_line_magic("gpumem", "--vars --json")
    assert held["variables"] == [] and held["notes"] == [
        "the last error's traceback (its frames' locals) still holds tensors: 1.0 MiB on cpu that no variable "
        "holds; `%gpumem --free` lets them go."]
    act = weakref.ref(sys.last_value.__traceback__.tb_next.tb_next.tb_frame.f_locals["act"])
    assert act() is not None
    freed = shell.run_line_magic("gpumem", "--free --json")   # what the note says
    assert act() is None, "the note's advice did not free the tensor"
    assert freed["last_error"]["frames_cleared"] >= 1 and "sys.last_value" in freed["last_error"]["let_go"]
    assert shell.run_line_magic("gpumem", "--vars --json")["notes"] == []


def test_an_error_whose_len_raises_is_still_read(shell):
    result, _, _ = run_cell(shell, "import torch\nclass Odd(Exception):\n    def __len__(self):\n"
                                   "        raise TypeError('no length')\n"
                                   "def forward():\n    act = torch.zeros(1024)\n    raise Odd()\nforward()")
    assert not result.success
    held = shell.run_line_magic("gpumem", "--vars --json")
    assert held["notes"][0].startswith("the last error's traceback (its frames' locals) "
                                       "still holds tensors: 4.0 KiB on cpu")


def test_a_notebook_class_holds_its_class_attributes(shell):
    # A cache kept on the class (shared by every instance) was memory no row showed.
    result, _, _ = run_cell(shell, "import torch\nclass Embedder:\n    cache = {}\n"
                                   "    def __init__(self):\n        self.w = torch.zeros(16)\n"
                                   "Embedder.cache['a'] = torch.zeros(256)\nembedder = Embedder()\n"
                                   "Linear = torch.nn.Linear                 # a library's class: not read")
    assert result.success
    held = shell.run_line_magic("gpumem", "--vars --json")
    assert [(v["name"], v["bytes"]) for v in held["variables"]] == [("Embedder", 1024), ("embedder", 64)]


def test_a_failed_cells_own_frame_is_not_named_for_what_the_notebook_holds(shell):
    # The traceback of an error raised at a cell's top level holds the cell's frame, whose locals are
    # the notebook's namespace: what Out or a variable holds is not held by the error, and clearing
    # sys.last_traceback would free none of it.
    assert not run_cell(shell, "import torch\n1/0")[0].success
    run_cell(shell, "torch.ones(400, 400)")            # held by Out alone
    notes = shell.run_line_magic("gpumem", "--vars --json")["notes"]
    assert [n.split(" still holds")[0] for n in notes] == ["the output history (Out[...])"], notes
    run_cell(shell, "%gpumem --free --history")     # what the note says
    assert shell.run_line_magic("gpumem", "--vars --json")["notes"] == []
