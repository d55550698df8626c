"""The Hugging Face Trainer's progress in a launch-mode cell, as a plain cell shows it.

In a Jupyter notebook a plain cell's ``Trainer.train()`` shows transformers' HTML progress table (one
display, updated in place). A rank is no notebook, so under ``%%dataparallel`` it drew text bars,
whose nested evaluation bars moved the cursor up (``\\x1b[A``, stray text in a cell). Now rank 0
of a notebook kernel's launch cell shows the table, its updates relayed to the same output; terminal
IPython keeps the text bars. A real Jupyter kernel (ipykernel through nbclient) for the notebook.
"""
from __future__ import annotations

import re

import pytest

from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell
from tests.notebook_helpers import run_notebook, stream_text

pytest.importorskip("transformers")

# 64 samples, 8 a rank, 2 ranks: 4 steps an epoch, 8 in all; a loss and an evaluation every 4 steps.
SETUP = """\
import sys, tempfile, torch, transformers
config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=37, num_labels=2)
torch.manual_seed(0)
bert = transformers.BertForSequenceClassification(config)
texts = [{"input_ids": torch.randint(0, 64, (12,)), "labels": torch.tensor(i % 2)} for i in range(64)]
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8,
                                      per_device_eval_batch_size=4, num_train_epochs=2, report_to=[],
                                      save_strategy="no", logging_steps=4, eval_strategy="steps", eval_steps=4,
                                      seed=0)
"""

TRAIN = """\
imported_before = "transformers.trainer" in sys.modules
trainer = transformers.Trainer(model=bert, args=args, train_dataset=texts, eval_dataset=texts[:16])
trainer.train()
steps = trainer.state.global_step
"""

DP = "%%dataparallel --devices cpu --nprocs 2\n"
CELLS = ["%load_ext gpumagic", SETUP, DP + TRAIN, "first = imported_before", DP + TRAIN,
         "print(first, imported_before, steps)", "%dataparallel stop"]


@pytest.fixture(scope="module")
def notebook():
    return run_notebook(CELLS, timeout=600, record=True)


def _table(html: str) -> list[str]:
    return re.findall(r"<th>(.*?)</th>", html)


@pytest.mark.parametrize("index", [2, 4], ids=["imported-in-the-cell", "imported-by-an-earlier-cell"])
def test_rank_0_shows_transformers_notebook_table_updated_in_place(notebook, index):
    nb, messages = notebook
    cell = nb.cells[index]
    assert not [o for o in cell.outputs if o.output_type == "error"], cell.outputs
    # (a cell that runs past 2 s also shows %%dataparallel's own per-rank table: not the Trainer's)
    shown = [(kind, c) for kind, c in messages[index] if kind in ("display_data", "update_display_data")
             and "%%dataparallel: " not in c["data"].get("text/html", "")]
    ids = {c.get("transient", {}).get("display_id") for _, c in shown}
    # one display (the table), made once and then updated: a second rank's would be a second id
    assert len(ids) == 1 and None not in ids, ids
    assert [kind for kind, _ in shown].count("display_data") == 1 and shown[0][0] == "display_data"
    assert len(shown) > 2
    # the cell holds that one output, as its last update left it: the table with the final step count
    displays = [o for o in cell.outputs if o.output_type == "display_data"
                and "%%dataparallel: " not in o.data.get("text/html", "")]
    assert len(displays) == 1
    final = displays[0].data["text/html"]
    assert final == shown[-1][1]["data"]["text/html"]
    assert _table(final)[:3] == ["Step", "Training Loss", "Validation Loss"]
    assert "<progress value='8' max='8'" in final and "[8/8" in final
    rows = re.findall(r"<tr>\s*<td>(\d+)</td>", final)
    assert rows == ["4", "8"], final                        # a loss and an evaluation every 4 steps
    text = stream_text(cell)
    assert "\x1b[A" not in text and "it/s]" not in text     # no text bars, no cursor moves


def test_the_first_cell_imported_the_trainer_the_second_found_it(notebook):
    nb, _ = notebook
    out = stream_text(nb.cells[5])
    assert out.split() == ["False", "True", "8"]            # (rank 0's)


def test_terminal_ipython_keeps_text_bars(shell):
    result, text, _ = run_cell(shell, SETUP)
    assert result.success, text
    _, cap = dp_cell(shell, "--devices cpu --nprocs 2", TRAIN)
    out = cap.stdout + cap.stderr
    assert "8/8" in out and "it/s]" in out                   # tqdm's text bar, to the last step
    assert not [o for o in cap.outputs if "text/html" in o.data]
    assert shell.user_ns["steps"] == 8


def test_launched_chooses_the_notebook_table_on_rank_0_only_and_gives_it_back():
    import transformers.trainer as trainer
    from transformers.utils.notebook import NotebookProgressCallback

    from gpumagic.dataparallel.strategies.launch_rank import launched
    own = trainer.DEFAULT_PROGRESS_CALLBACK
    assert own is not NotebookProgressCallback             # (this process is no notebook)
    with launched(rank=0, world_size=2, master_port=29561, run_id="gm-p", on_cpu=True, notebook=True):
        assert trainer.DEFAULT_PROGRESS_CALLBACK is NotebookProgressCallback
    assert trainer.DEFAULT_PROGRESS_CALLBACK is own
    for rank, notebook in ((1, True), (0, False)):
        with launched(rank=rank, world_size=2, master_port=29561, run_id="gm-p", on_cpu=True, notebook=notebook):
            assert trainer.DEFAULT_PROGRESS_CALLBACK is own
