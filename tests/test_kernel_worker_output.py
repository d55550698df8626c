"""What workers write below Python, as a user sees it: a real Jupyter kernel (ipykernel through nbclient).

ipykernel copies whatever reaches its file descriptors 1 and 2 into the running cell, and workers
used to inherit them: a C library's message or a subprocess's output came from every rank,
unprefixed. Now it follows the rank's prints: rank 0's only, or every rank's with ``[rank N]``.
"""
from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRITE = """\
import subprocess, torch.distributed as dist
r = dist.get_rank() if dist.is_initialized() else rank
os.write(1, f"fd out {r}\\n".encode())
os.write(2, f"fd err {r}\\n".encode())
subprocess.run(["echo", f"child {r}"])
print("py", r)
for (x,) in loader:
    model(x).sum().backward()
"""

CELLS = [
    "%load_ext gpumagic",
    "import os, torch\nmodel = torch.nn.Linear(2, 1)\n"
    "loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)",
    "%%dataparallel --devices cpu --nprocs 2\n" + WRITE,
    "%%dataparallel --devices cpu --nprocs 2 --all-output\n" + WRITE,
    "%%sharedtrain --nprocs 2\n" + WRITE,
    "%dataparallel stop",
]


@pytest.fixture(scope="module")
def notebook():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in CELLS])
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
    return nb


def _streams(notebook, n: int) -> tuple[str, str]:
    outputs = [o for o in notebook.cells[n - 1].outputs if o.output_type == "stream"]
    return ("".join(o.text for o in outputs if o.name == "stdout"),
            "".join(o.text for o in outputs if o.name == "stderr"))


def test_only_rank_0_writes_into_the_cell(notebook):
    out, err = _streams(notebook, 3)
    assert sorted(out.splitlines()) == ["child 0", "fd out 0", "py 0"], out
    assert "fd err 0\n" in err and "1" not in "".join(line for line in err.splitlines() if "fd err" in line)


@pytest.mark.parametrize("n", [4, 5], ids=["dataparallel-all-output", "sharedtrain"])
def test_every_ranks_lines_carry_its_prefix(notebook, n):
    out, err = _streams(notebook, n)
    for r in (0, 1):
        lines = sorted(line for line in out.splitlines() if line.startswith(f"[rank {r}] "))
        assert lines == [f"[rank {r}] child {r}", f"[rank {r}] fd out {r}", f"[rank {r}] py {r}"], out
        assert f"[rank {r}] fd err {r}\n" in err, err
    assert not [line for line in out.splitlines() if not line.startswith("[rank ")], out
