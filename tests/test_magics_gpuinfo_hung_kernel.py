"""A wedged driver in a real Jupyter kernel (ipykernel through nbclient): %gpuinfo and %gpumem --watch
finish their cells with what needs no NVML and a note, instead of leaving the notebook busy for good."""
from __future__ import annotations

import pytest

from tests.notebook_helpers import run_notebook, stream_text

WIDGET = "application/vnd.jupyter.widget-view+json"

CELLS = [
    "%load_ext gpumagic",
    # NVML's device count blocks, as a wedged driver's calls do, until `release` is set.
    "import threading, time, torch\n"
    "from gpumagic.devices import nvml\n"
    "from tests.fake_nvml import four_gpu_machine\n"
    "nvml.READ_TIMEOUT = 1.0\n"
    "fake = four_gpu_machine()\n"
    "release = threading.Event()\n"
    "count = fake.nvmlDeviceGetCount\n"
    "fake.nvmlDeviceGetCount = lambda: release.wait(60) and count()\n"
    "nvml.use(fake)",
    "started = time.monotonic()\n%gpuinfo\nprint(f'{time.monotonic() - started:.1f} s')",
    "started = time.monotonic()\n%gpuinfo\nprint(f'{time.monotonic() - started:.1f} s')",
    "%gpumem --watch",
    "print(sorted(t.name for t in threading.enumerate() if t.name.startswith('gpumagic')))",
    "release.set()\n"
    "while nvml.stuck_note() is not None:\n    time.sleep(0.01)",
    "%gpuinfo",
    "%gpumem --stop",
]


@pytest.fixture(scope="module")
def notebook():
    # 30 s a cell: a hung %gpuinfo fails the test with a cell timeout instead of passing.
    return run_notebook(CELLS, timeout=30, allow_errors=False)


def _stdout(nb, n):
    return stream_text(nb.cells[n], "stdout")


def _displays(nb, n):
    return [o.data for o in nb.cells[n].outputs if o.output_type == "display_data"]


def test_gpuinfo_finishes_with_the_cpu_a_note_and_a_picker(notebook):
    table, picker = _displays(notebook, 2)
    assert "note: the GPU driver did not answer in 1 s (an NVML call has not returned" in table["text/plain"]
    assert "<i>note: the GPU driver did not answer in 1 s" in table["text/html"]
    assert table["text/plain"].splitlines()[0].split() == ["cpu"]
    assert WIDGET in picker and "choices: cpu, meta" in picker["text/plain"]
    assert 1.0 <= float(_stdout(notebook, 2).split()[0]) < 3.0


def test_a_second_gpuinfo_is_refused_at_once_and_the_watch_shows_the_cpu(notebook):
    table, _ = _displays(notebook, 3)
    assert "did not answer in 1 s and still has not: %gpuinfo's NVML reading, started" in table["text/plain"]
    assert float(_stdout(notebook, 3).split()[0]) < 1.0
    (gauges,) = _displays(notebook, 4)
    assert gauges["text/plain"].startswith("cpu [") and "cuda" not in gauges["text/plain"]
    assert _stdout(notebook, 4).startswith("note: the GPU driver did not answer in 1 s and still has not")
    # One reader stuck in the driver, the gauges' thread: nothing piled up.
    assert _stdout(notebook, 5) == "['gpumagic-memory-monitor', 'gpumagic-nvml-reader']\n"


def test_gpuinfo_shows_the_gpus_once_the_driver_answers(notebook):
    table, picker = _displays(notebook, 7)
    assert table["text/plain"].splitlines()[0].split() == ["cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert "did not answer" not in table["text/plain"]
