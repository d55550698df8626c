"""What workers write below Python, and what they display, as a user sees it: a real Jupyter kernel
(ipykernel through nbclient).

ipykernel copies whatever reaches its file descriptors 1 and 2 into the running cell, and workers
used to inherit them: a C library's message or a subprocess's output came from every rank,
unprefixed. Now it follows the rank's prints: rank 0's only, or every rank's with ``[rank N]``.
A worker is not IPython, so ``display()`` printed a repr there (a live loss plot became
``Figure(640x480)``); now the cell shows what a plain cell shows.
"""
from __future__ import annotations

import pytest

from tests.notebook_helpers import run_notebook, stream_text

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

# The live loss plot of many notebooks: cleared and drawn again each epoch.
PLOT = """\
for epoch in range(3):
    for (x,) in loader:
        model(x).sum().backward()
        losses.append(float(model(x).sum()))
    clear_output(wait=True)
    plt.plot(losses)
    plt.title(f"epoch {epoch}")
    plt.show()
    print("epoch", epoch)
display(HTML("<b>done</b>"))
handle = display("first", display_id=True)
handle.update("second")
"""

CELLS = [
    "%load_ext gpumagic",
    "import os, torch\nmodel = torch.nn.Linear(2, 1)\n"
    "loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)",
    "%%dataparallel --devices cpu --nprocs 2\n" + WRITE,
    "%%dataparallel --devices cpu --nprocs 2 --all-output\n" + WRITE,
    "%%sharedtrain --nprocs 2\n" + WRITE,
    "%matplotlib inline\nimport matplotlib.pyplot as plt\nfrom IPython.display import HTML, clear_output, display\n"
    "losses = []",
    "%%dataparallel --devices cpu --nprocs 2\n" + PLOT,
    "%%sharedtrain --nprocs 2\nmodel(torch.ones(1, 2))\ndisplay(HTML(f'<i>worker {rank}</i>'))\n",
    "%dataparallel stop",
]


@pytest.fixture(scope="module")
def notebook():
    return run_notebook(CELLS, timeout=300)


def _streams(notebook, n: int) -> tuple[str, str]:
    return stream_text(notebook.cells[n - 1], "stdout"), stream_text(notebook.cells[n - 1], "stderr")


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


def test_a_live_plot_and_rich_displays_show_as_in_a_plain_cell(notebook):
    outputs = notebook.cells[6].outputs
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1 and images[0].data["text/plain"] == "<Figure size 640x480 with 1 Axes>"  # cleared twice
    out, _ = _streams(notebook, 7)
    assert out == "epoch 2\n" and "Figure(" not in out                # one rank's, after the last clear
    html = [o.data["text/html"] for o in outputs if o.output_type == "display_data" and "text/html" in o.data]
    assert html == ["<b>done</b>"]
    updated = [o.data["text/plain"] for o in outputs if o.output_type == "display_data" and "text/html" not in
               o.data and "image/png" not in o.data]
    assert updated == ["'second'"]                                      # the handle updated the display in place


def test_every_sharedtrain_workers_displays_reach_the_cell(notebook):
    html = sorted(o.data["text/html"] for o in notebook.cells[7].outputs
                  if o.output_type == "display_data" and o.data.get("text/html", "").startswith("<i>"))
    assert html == ["<i>worker 0</i>", "<i>worker 1</i>"]           # (beside the magic's own summary)
