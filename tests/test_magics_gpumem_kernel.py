"""%gpuinfo and %gpumem in a real Jupyter kernel (ipykernel through nbclient), as a notebook runs them."""
from __future__ import annotations

import json

import pytest

from tests.notebook_helpers import run_notebook, stream_text

WIDGET = "application/vnd.jupyter.widget-view+json"

CELLS = [
    "%load_ext gpumagic",
    "import functools, json, torch\n"
    "def train(x, model=None):\n    return model(x)\n"
    "model = torch.nn.Linear(256, 256)\n"
    "step = functools.partial(train, model=model)\n"
    "ip = get_ipython()\nrun = ip.run_cell",
    "held = %gpumem --vars --json\nprint(json.dumps(held))",
    "%gpumem --vars",
    "%gpumem --watch --interval 0.05",
    "import time; time.sleep(0.3)",
    "%gpumem --watch",
    "%gpumem --stop",
    "%gpumem --stop",
    "%gpumem --watch --interval 0",
    "import gc, threading, weakref\nref = weakref.ref(model)\ndel model, step\ngc.collect()\n"
    "print(ref() is None, torch.cuda.is_initialized(),\n"
    "      [t.name for t in threading.enumerate() if t.name.startswith('gpumagic')])",
    "facts = %gpuinfo --json\nprint(json.dumps(facts, allow_nan=False))",
    "%gpuinfo tpu",
    "%gpuinfo",
    "from gpumagic.widgets.picker import _open\nlist(_open)[-1].widget.value = 'meta'   # a pick in the dropdown",
    "%%ondevice\nz = torch.zeros(2)\nprint(z.device)",
]
PARAMS = 256 * 256 * 4 + 256 * 4


@pytest.fixture(scope="module")
def notebook():
    return run_notebook(CELLS, timeout=120, allow_errors=True)


def _stdout(nb, n):
    return stream_text(nb.cells[n], "stdout")


def _stderr(nb, n):
    return stream_text(nb.cells[n], "stderr")


def _displays(nb, n):
    return [o.data for o in nb.cells[n].outputs if o.output_type == "display_data"]


def test_vars_lists_a_partial_and_not_the_shell(notebook):
    held = json.loads(_stdout(notebook, 2))
    assert [(v["name"], v["bytes"], v["shared_with"]) for v in held["variables"]] == \
        [("model", PARAMS, ["step"]), ("step", PARAMS, ["model"])]
    assert held["totals"] == {"cpu": PARAMS}
    (shown,) = _displays(notebook, 3)
    assert "<table>" in shown["text/html"] and "with step" in shown["text/plain"]
    assert "InteractiveShell" not in shown["text/plain"] and "ZMQInteractiveShell" not in shown["text/plain"]


def test_watch_twice_stop_twice_and_a_bad_interval(notebook):
    first, second = _displays(notebook, 4), _displays(notebook, 6)
    assert len(first) == len(second) == 1 and WIDGET in first[0] and WIDGET in second[0]
    assert first[0]["text/plain"].startswith("cpu [")      # the gauges' text form
    assert first[0][WIDGET]["model_id"] != second[0][WIDGET]["model_id"]
    assert _stdout(notebook, 7) == "Stopped the memory gauges.\n"
    assert _stdout(notebook, 8) == "No memory gauges were running.\n"
    assert "UsageError: --interval must be a number of seconds from 0.05 to 3600, not 0.0" in _stderr(notebook, 9)


def test_nothing_is_kept_alive_and_no_thread_is_left(notebook):
    # the model deleted is gone (no report kept it), CUDA never initialised, the monitor thread ended
    assert _stdout(notebook, 10) == "True False []\n"


def test_gpuinfo_json_bad_device_and_the_picked_device(notebook):
    facts = json.loads(_stdout(notebook, 11))
    assert set(facts) == {"system", "devices", "notes"}
    assert facts["devices"][0]["device"] == "cpu" and facts["devices"][0]["memory_total"] > 0
    assert facts["system"]["cuda_initialized"] is False
    assert "unknown device 'tpu'; valid choices: cpu" in _stderr(notebook, 12)
    table, picker = _displays(notebook, 13)
    assert "<table>" in table["text/html"] and WIDGET in picker
    assert picker["text/plain"].startswith("device: ")
    assert "(later gpumagic cells run there; choices: cpu" in picker["text/plain"]
    assert _stdout(notebook, 15) == "meta\n"
