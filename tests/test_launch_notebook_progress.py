"""tqdm's bars from ``%%dataparallel`` ranks and ``%%sharedtrain`` workers, as a plain notebook cell shows them.

In a plain notebook cell an accelerate loop's ``tqdm.auto`` bar and Lightning's ``TQDMProgressBar`` are
tqdm's notebook bars. A rank is no notebook: they were text bars, relayed line by line, and Lightning's
nested validation bar moved the cursor up (``\\x1b[A``), stray characters in a cell. Now, in a notebook
kernel, a bar on a rank whose output is shown is an HTML display made once and updated in place;
terminal IPython keeps the text bars. A real Jupyter kernel (ipykernel through nbclient).
"""
from __future__ import annotations

import re

import pytest

from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell
from tests.notebook_helpers import run_notebook, stream_text

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

# 16 batches of 4: 8 a rank in launch mode (the frameworks share the batches), 16 of 2 in a
# hand-written loop (the ranks share each batch).
SETUP = """\
import torch, torch.nn.functional as F
import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
torch.manual_seed(0)
X = torch.randn(64, 8)
Y = X @ torch.randn(8, 1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=4)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)

class Regressor(L.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

lit = Regressor(model)
"""

ACCELERATE = """\
from tqdm.auto import tqdm
from accelerate import Accelerator
accelerator = Accelerator()
m, o, dl = accelerator.prepare(model, opt, loader)
for x, y in tqdm(dl, desc="accelerate", disable=not accelerator.is_local_main_process):
    o.zero_grad()
    accelerator.backward(F.mse_loss(m(x), y))
    o.step()
"""

# Training, then validation under it (a second bar, drawn one line lower as text), and a sanity check first.
LIGHTNING = """\
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_model_summary=False, callbacks=[TQDMProgressBar()])
trainer.fit(lit, loader, loader)
"""

HAND = """\
from tqdm import tqdm
for x, y in tqdm(loader, desc="hand"):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
"""

SHARED = """\
from tqdm.auto import tqdm
for step in tqdm(range(4), desc="shared"):
    F.mse_loss(model(X[step::4]), Y[step::4]).backward()
"""

DP = "%%dataparallel --devices cpu --nprocs 2\n"
CELLS = ["%load_ext gpumagic", SETUP, DP + ACCELERATE, DP + LIGHTNING, DP + HAND,
         DP.replace("2\n", "2 --all-output\n") + HAND, "%%sharedtrain --nprocs 2\n" + SHARED, "%dataparallel stop"]


@pytest.fixture(scope="module")
def notebook():
    return run_notebook(CELLS, timeout=600, record=True)


def _bars(messages, index) -> dict[str, list[tuple[str, str]]]:
    """Each display of tqdm bars in cell ``index``: its messages in order, (kind, html)."""
    bars: dict[str, list] = {}
    for kind, content in messages[index]:
        html = content.get("data", {}).get("text/html")
        if kind in ("display_data", "update_display_data") and html is not None and (
                "<progress" in html or not html):
            bars.setdefault(content["transient"]["display_id"], []).append((kind, html))
    return bars


def _checked(notebook, index):
    nb, messages = notebook
    cell = nb.cells[index]
    assert not [o for o in cell.outputs if o.output_type == "error"], cell.outputs
    text = stream_text(cell)
    assert "\x1b[" not in text and "it/s]" not in text, text       # no text bars, no cursor moves
    bars = _bars(messages, index)
    for shown in bars.values():   # each made once, then updated in place
        assert [kind for kind, _ in shown][:1] == ["display_data"]
        assert "display_data" not in [kind for kind, _ in shown[1:]]
    return cell, bars


def _count(html: str) -> str:
    return re.search(r"(\d+/\d+) \[", html).group(1)


def test_an_accelerate_loop_shows_one_notebook_bar_at_its_final_count(notebook):
    cell, bars = _checked(notebook, 2)
    assert len(bars) == 1                                          # rank 0's (rank 1's is disabled)
    (shown,) = bars.values()
    final = shown[-1][1]
    assert "accelerate: 100%" in final and _count(final) == "8/8" and "value='8' max='8'" in final
    # the cell holds that display, as its last update left it
    html = [o.data["text/html"] for o in cell.outputs if o.output_type == "display_data" and "text/html" in o.data]
    assert html == [final]


def test_lightning_training_and_validation_bars_are_displays_of_their_own(notebook):
    cell, bars = _checked(notebook, 3)
    finals = [shown[-1][1] for shown in bars.values()]
    training = [html for html in finals if "Epoch 0" in html]
    assert len(training) == 1 and _count(training[0]) == "8/8" and "accent-color:#5cb85c" in training[0]
    # the sanity check's and validation's bars (leave=False) showed while they ran, emptied when done
    others = [shown for shown in bars.values() if "Epoch 0" not in shown[-1][1]]
    assert len(others) == 2 and all(shown[-1][1] == "" for shown in others)
    assert any("Validation" in html for shown in others for _, html in shown)
    assert "`Trainer.fit` stopped: `max_epochs=1` reached" in stream_text(cell)   # its log line, as text


@pytest.mark.parametrize("index, labels", [(4, [""]), (5, ["[rank 0] ", "[rank 1] "])],
                         ids=["rank-0", "all-output"])
def test_a_hand_written_loop_shows_the_shown_ranks_bars(notebook, index, labels):
    _, bars = _checked(notebook, index)
    finals = sorted(shown[-1][1] for shown in bars.values())
    assert [re.search(r"<span>(.*?)hand: 100%", html).group(1) for html in finals] == labels
    assert all(_count(html) == "16/16" for html in finals)           # (each rank half of each batch)


def test_every_sharedtrain_workers_bar_is_a_display_saying_its_rank(notebook):
    _, bars = _checked(notebook, 6)
    finals = sorted(shown[-1][1] for shown in bars.values())
    assert [re.search(r"<span>(\[rank \d\]) shared: 100%", html).group(1) for html in finals] == \
        ["[rank 0]", "[rank 1]"]
    assert all(_count(html) == "4/4" for html in finals)


@pytest.mark.parametrize("cell", ["accelerate", "lightning"])
def test_terminal_ipython_keeps_text_bars(shell, cell):
    result, text, _ = run_cell(shell, SETUP)
    assert result.success, text
    _, cap = dp_cell(shell, "--devices cpu --nprocs 2", ACCELERATE if cell == "accelerate" else LIGHTNING)
    out = cap.stdout + cap.stderr
    assert "8/8" in out and "it/s]" in out                           # tqdm's text bar, to the last step
    assert not [o for o in cap.outputs if "text/html" in o.data]
