"""What a %%dataparallel cell binds comes back holding the notebook's own objects and classes, through a real
Jupyter kernel (nbclient), where IPython's ``Out`` is a name a user may take for a namedtuple."""
from __future__ import annotations

from tests.dataparallel_helpers import REGRESSION
from tests.notebook_helpers import run_notebook, stream_text

NOTEBOOK = REGRESSION + """
import collections, dataclasses
Out = collections.namedtuple("Out", "loss step")   # (the kernel's own Out, the output history, before)

@dataclasses.dataclass
class Stat:
    loss: float
    step: int

@torch.compile
def lossf(a, b):
    return ((a - b) ** 2).mean()

history = []
"""

CELL = """%%dataparallel --nprocs 2
for step, (x, y) in enumerate(loader):
    opt.zero_grad()
    loss = lossf(model(x), y)
    loss.backward()
    opt.step()
    history.append(Out(loss.item(), step))
holder = {"net": model, "opt": opt}
stats = [Stat(o.loss, o.step) for o in history]
"""

CHECK = """print(holder["net"] is model, holder["opt"] is opt, [type(o) is Out for o in history].count(True),
      [type(s) is Stat for s in stats].count(True), torch.equal(holder["net"][0].weight, model[0].weight))
"""


def test_objects_the_cell_binds_hold_the_notebooks_objects_through_a_kernel():
    nb = run_notebook(["%load_ext gpumagic", NOTEBOOK, CELL, CHECK, "%dataparallel stop"], timeout=300)
    note = stream_text(nb.cells[2], "stderr")
    assert "not brought back" not in note and "values:" in note, note
    assert "holder" in note.split("values:")[1] and "stats" in note.split("values:")[1], note
    # 4 steps of 8 samples each: 4 items, all of the notebook's classes, the trained model itself in holder
    assert stream_text(nb.cells[3]).split() == ["True", "True", "4", "4", "True"], stream_text(nb.cells[3])
