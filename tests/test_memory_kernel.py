"""Memory back without a restart in a real Jupyter kernel (ipykernel through nbclient), as a notebook runs it:
the out-of-memory report displayed under the traceback, --free right after the error, --rescue --drop, and
the ledger's lines. Bytes are the kernel's own resident memory, measured in the kernel."""
from __future__ import annotations

import json

import pytest

from tests.notebook_helpers import run_notebook, stream_text

MIB = 1 << 20

STEP = ("def step(n):\n"
        "    acts = [torch.ones(n // 4) for _ in range(3)]\n"
        "    h = model(torch.randn(8, 256))\n"
        "    huge = torch.empty(2**45, dtype=torch.uint8)\n"
        f"step({96 * MIB})")
MEASURE = "import gc; gc.collect()\nprint(json.dumps({'held': rss() - base}))"

CELLS = [
    "%load_ext gpumagic",                                                               # In[1]
    "import json, psutil, torch\nrss = lambda: psutil.Process().memory_info().rss\n"
    "model = torch.nn.Linear(256, 256)\nbase = rss()",                                   # In[2]
    STEP,                                                                               # In[3]
    "%gpumem --free",                                                                   # In[4]
    MEASURE,                                                                            # In[5]
    STEP,                                                                               # In[6]
    "%gpumem --rescue --drop",                                                          # In[7]
    MEASURE,                                                                            # In[8]
    "%gpumem --cells\nlosses = []",                                                     # In[9]
    "x = torch.randn(16384, 256)\nlosses.append(model(x).relu().sum())",                # In[10]
    "x = torch.randn(16384, 256)\nlosses.append(model(x).relu().sum())",                # In[11]
    "print(torch.cuda.is_initialized())",                                               # In[12]
]


@pytest.fixture(scope="module")
def notebook():
    return run_notebook(CELLS, allow_errors=True)


def held_after(cell) -> int:
    return json.loads(stream_text(cell))["held"]


def test_the_report_shows_once_under_the_traceback(notebook):
    outputs = notebook.cells[2].outputs
    kinds = [o.output_type for o in outputs]
    assert kinds.index("error") < kinds.index("display_data"), kinds
    assert kinds.count("display_data") == 1
    report = next(o for o in outputs if o.output_type == "display_data")
    text, page = report.data["text/plain"], report.data["text/html"]
    assert text.startswith("Out of memory on cpu: asked for 32.0 TiB")
    assert "Cell In[3], line 4, in step: acts 288.0 MiB" in text
    assert "Cell In[3], line 4, in step" in page and "<pre" in page
    assert "`%gpumem --rescue --drop` (or `%gpumem --free`) lets go of the 288." in text


def test_free_in_the_next_cell_gives_back_the_errors_memory(notebook):
    out = "".join(o.data.get("text/plain", "") for o in notebook.cells[3].outputs if "data" in o)
    assert "let go of the last error (RuntimeError: " in out and "last_execution_result.error_in_exec" in out
    assert held_after(notebook.cells[4]) < 32 * MIB, "the kernel holds more than its variables after --free"


def test_rescue_drop_gives_back_the_errors_memory(notebook):
    out = "".join(o.data.get("text/plain", "") for o in notebook.cells[6].outputs if "data" in o)
    assert "let go of the last error" in out and "(freed 288." in out
    assert held_after(notebook.cells[7]) < 32 * MIB


def test_the_ledger_flags_the_leaking_rerun_without_cuda(notebook):
    assert "The memory ledger is on" in stream_text(notebook.cells[8])
    assert "leak?" not in stream_text(notebook.cells[9])
    second = stream_text(notebook.cells[10])
    assert "[gpumem In[11]] cpu: " in second and "grew: losses +" in second
    assert "[gpumem In[11]] leak? this cell kept more on cpu on each of its last 2 runs" in second
    assert stream_text(notebook.cells[11]).startswith("False")
