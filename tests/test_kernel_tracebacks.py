"""Worker tracebacks where users see them: a real Jupyter kernel (ipykernel through nbclient).

A kernel compiles cells under names like ``/tmp/ipykernel_<pid>/<hash>.py``, not IPython's
``<ipython-input-n-...>``: the tracebacks must still read ``Cell In[n], line k`` with the user's
source, name the exception and the rank, and show no gpumagic frames. The notebook runs once; each
test reads one cell's error output.
"""
from __future__ import annotations

import re

import pytest

from tests.conftest import run_cell
from tests.notebook_helpers import run_notebook

DP = "%%dataparallel --devices cpu --nprocs 2"

SETUP = """\
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)

def step(x):
    loss = model(x).sum()
    raise ValueError("step failed")

class Broken(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        raise KeyError(f"no item {i}")
broken = DataLoader(Broken(), batch_size=4, num_workers=2)"""
STEP = 'Cell In[2], line 9, in step\n    raise ValueError("step failed")'
GETITEM = 'Cell In[2], line 15, in __getitem__\n    raise KeyError(f"no item {i}")'

# Cell n of the notebook runs as In[n]: each source, then what its traceback must show.
CELLS = [
    "%load_ext gpumagic",
    SETUP,
    f"{DP}\nout = model(torch.ones(1, 4))\n1 / 0",
    f"{DP}\nfor x, y in loader:\n    step(x)",
    "%%sharedtrain --nprocs 2\nout = model(torch.ones(1, 4))\nif rank == 1:\n    1 / 0",
    "%%sharedtrain --nprocs 2\nfor x, y in loader:\n    step(x)",
    "%%sharedtrain --nprocs 2 --start-method spawn\nfor x, y in loader:\n    step(x)",
    "%%ondevice cpu\nx = 1\n1 / 0",
    f"{DP}\nx = 1\ny = (x +",
    f"{DP}\nfor x in broken:\n    model(x)",
    "%%sharedtrain --nprocs 2\nfor x in broken:\n    model(x)",
    "%dataparallel stop",
]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@pytest.fixture(scope="module")
def notebook():
    return run_notebook(CELLS, timeout=300, allow_errors=True)


def _error(notebook, n: int):
    """In[n]'s error output: (ename, evalue, traceback text without colours)."""
    cell = notebook.cells[n - 1]
    assert cell.execution_count == n
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert len(errors) == 1, cell.outputs
    return errors[0].ename, errors[0].evalue, _ANSI.sub("", "\n".join(errors[0].traceback))


def _clean(tb: str) -> None:
    assert "gpumagic/" not in tb and "ipykernel_" not in tb, tb


def test_setup_ran(notebook):
    assert not [o for c in notebook.cells[:2] for o in c.outputs if o.output_type == "error"]


@pytest.mark.parametrize("n, rank, exc, lines", [
    (3, 0, "ZeroDivisionError: division by zero", ["Cell In[3], line 3, in <module>\n    1 / 0"]),
    (4, 0, "ValueError: step failed", ["Cell In[4], line 3, in <module>\n    step(x)", STEP]),
    (5, 1, "ZeroDivisionError: division by zero", ["Cell In[5], line 4, in <module>\n    1 / 0"]),
    (6, 0, "ValueError: step failed", ["Cell In[6], line 3, in <module>\n    step(x)", STEP]),      # fork
    (7, 0, "ValueError: step failed", ["Cell In[7], line 3, in <module>\n    step(x)", STEP]),      # spawn
], ids=["dataparallel", "dataparallel-function", "sharedtrain-rank1", "sharedtrain-function",
        "sharedtrain-spawn-function"])
def test_worker_errors_point_at_the_cells(notebook, n, rank, exc, lines):
    ename, evalue, tb = _error(notebook, n)
    assert ename == "WorkerError" and evalue.startswith(f"rank {rank} (pid ")
    assert re.match(rf"WorkerError: rank {rank} \(pid \d+\) raised {exc.split(':')[0]}\n", tb), tb
    for line in lines:
        assert line in tb, tb
    assert tb.rstrip().endswith(exc), tb
    _clean(tb)


def test_ondevice_errors_point_at_the_cell(notebook):
    ename, _, tb = _error(notebook, 8)
    assert ename == "ZeroDivisionError" and "Cell In[8], line 3" in tb and "----> 3 1 / 0" in tb, tb
    _clean(tb)


def test_a_syntax_error_points_at_the_cell_line(notebook):
    ename, _, tb = _error(notebook, 9)
    assert ename == "SyntaxError" and "Cell In[9], line 3\n    y = (x +" in tb, tb
    # IPython lists the frames of a SyntaxError raised while running code (its own %%time does
    # too); of gpumagic's, only the magic's own line remains.
    assert "gpumagic/cell" not in tb and "gpumagic/dataparallel" not in tb and "ipykernel_" not in tb, tb


@pytest.mark.parametrize("n", [10, 11], ids=["dataparallel", "sharedtrain"])
def test_errors_in_dataloader_workers_point_at_the_dataset(notebook, n):
    ename, evalue, tb = _error(notebook, n)
    assert ename == "WorkerError" and "raised KeyError" in tb, tb
    assert f"Cell In[{n}], line 2, in <module>\n    for x in broken:" in tb, tb
    # torch re-raises the loader worker's exception with that worker's traceback in its message
    assert "Caught KeyError in DataLoader worker process" in tb and GETITEM in tb, tb
    assert GETITEM in evalue and "ipykernel_" not in evalue
    _clean(tb)


def test_notebook_functions_show_their_cell_in_a_plain_shell_too(shell):
    # Functions travel to spawned ranks by value; their frames keep the cell's name and source.
    run_cell(shell, SETUP)
    n_setup = shell.execution_count - 1
    result, out, _ = run_cell(shell, f"{DP}\nfor x, y in loader:\n    step(x)")
    tb = result.error_in_exec.remote_traceback
    assert f"Cell In[{result.execution_count}], line 3, in <module>\n    step(x)" in tb, tb
    assert STEP.replace("In[2]", f"In[{n_setup}]") in tb and "gpumagic/" not in tb, tb
    run_cell(shell, "%dataparallel stop")
