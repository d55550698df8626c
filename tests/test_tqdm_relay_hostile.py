"""tqdm bars as notebook users write them, in ``%%dataparallel`` ranks and ``%%sharedtrain`` workers of a
real Jupyter kernel (ipykernel through nbclient), against what a plain notebook cell shows.

- ``from tqdm.notebook import tqdm`` in a rank: a plain cell draws ipywidgets; a rank's widgets have no
  kernel behind them (the cell would say "model not found"): they are the rank's HTML bars instead.
- a bar left open (a ``break`` out of a manual loop, an error) ends with the rank's cell: it shows its
  last count, as closing it would (red: stopped early), not the count of its first draw.
- a bar in a DataLoader worker of a rank stays text, on a line of its own: no cursor moves in the cell.
- nested bars, ``set_postfix``, ``tqdm.write`` and prints keep a plain cell's order; a fast loop sends a
  handful of messages; 200 bars are 200 displays; an interrupt leaves nothing for the next cell, and the
  bar it stopped drawn stopped (red).
"""
from __future__ import annotations

import asyncio
import re
import threading
import time

import nbformat
import pytest

from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell
from tests.notebook_helpers import ROOT, RecordingClient, stream_text

pytest.importorskip("ipywidgets")   # (without it tqdm.notebook cannot draw in a plain cell either)

DP = "%%dataparallel --devices cpu --nprocs 2\n"
WIDGET = "application/vnd.jupyter.widget-view+json"
GREEN, RED = "accent-color:#5cb85c", "accent-color:#d9534f"

SETUP = """\
import time, torch
torch.manual_seed(0)
X, Y = torch.randn(32, 4), torch.randn(32, 1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=4)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def step(x, y):
    opt.zero_grad(); loss = ((model(x) - y) ** 2).mean(); loss.backward(); opt.step()
    return loss.item()

def warm_up(worker_id):
    from tqdm.auto import tqdm
    for _ in tqdm(range(3), desc=f"loader worker {worker_id}"):
        time.sleep(0.01)

worker_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=4, num_workers=2,
                                            worker_init_fn=warm_up)
"""

NOTEBOOK_BARS = """\
from tqdm.notebook import tqdm, trange
for epoch in trange(2, desc="ep"):
    for x, y in tqdm(loader, leave=False, desc="batch"):
        step(x, y)
"""

LEFT_OPEN = """\
from tqdm.auto import tqdm
bar = tqdm(total=8, desc="open")
for x, y in loader:
    step(x, y)
    bar.update(1)
    if bar.n == 5:
        break
"""

OPEN_AT_ERROR = """\
from tqdm.auto import tqdm
bar = tqdm(total=8, desc="failing")
for i, (x, y) in enumerate(loader):
    step(x, y)
    bar.update(1)
    if i == 4:
        raise ValueError("bad batch")
"""

PLAIN = """\
for x, y in loader:
    step(x, y)
print("plain next")
"""

IN_LOADER_WORKERS = """\
from tqdm.auto import tqdm
for x, y in tqdm(worker_loader, desc="rank"):
    step(x, y)
"""

SHARED_NOTEBOOK_BARS = """\
from tqdm.notebook import tqdm
for k in tqdm(range(4), desc="shared"):
    ((model(X[k::4]) - Y[k::4]) ** 2).mean().backward()
"""

# Hogwild's first epoch over the notebook's loader: each worker reads half of it (4 of 8 batches)
SHARED_LOADER = """\
from tqdm.auto import tqdm
for x, y in tqdm(loader, desc="hogwild"):
    step(x, y)
"""

NESTED = """\
from tqdm.auto import trange, tqdm
print("before")
for epoch in trange(2, desc="epochs"):
    bar = tqdm(loader, leave=False, desc="batches")
    for x, y in bar:
        bar.set_postfix(loss=step(x, y))
    tqdm.write(f"epoch {epoch} done")
print("after")
del bar
"""

FAST = """\
from tqdm.auto import tqdm
for x, y in loader:
    step(x, y)
t = time.perf_counter()
for i in range(100000):
    pass
bare = time.perf_counter() - t
t = time.perf_counter()
for i in tqdm(range(100000), desc="fast"):
    pass
print(f"times {bare:.4f} {time.perf_counter() - t:.4f}")
"""

MANY = """\
from tqdm.auto import tqdm
for x, y in loader:
    step(x, y)
for k in range(200):
    for i in tqdm(range(10), desc=f"bar {k}"):
        pass
print("many done")
"""

DISABLE_NONE = """\
from tqdm.auto import tqdm
for x, y in tqdm(loader, desc="auto", disable=None):
    step(x, y)
for x, y in tqdm(loader, desc="off", disable=True):
    step(x, y)
"""

SLOW = """\
from tqdm.auto import tqdm
for epoch in range(50):
    for x, y in tqdm(loader, desc=f"slow {epoch}"):
        step(x, y)
        time.sleep(0.02)
"""

CELLS = {"load": "%load_ext gpumagic", "setup": SETUP, "notebook": DP + NOTEBOOK_BARS, "open": DP + LEFT_OPEN,
         "error": DP + OPEN_AT_ERROR, "after_error": DP + PLAIN, "loader_workers": DP + IN_LOADER_WORKERS,
         "shared_spawn": "%%sharedtrain --nprocs 2 --start-method spawn\n" + SHARED_NOTEBOOK_BARS,
         "shared_loader": "%%sharedtrain --nprocs 2\n" + SHARED_LOADER,
         "nested": DP + NESTED, "fast": DP + FAST, "many": DP + MANY, "disable_none": DP + DISABLE_NONE,
         "slow": DP + SLOW, "after_interrupt": DP + PLAIN, "stop": "%dataparallel stop"}
INDEX = {name: i for i, name in enumerate(CELLS)}


@pytest.fixture(scope="module")
def notebook():
    """The cells run in order in one kernel; "slow" is interrupted once its bar has moved."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in CELLS.values()])
    client = RecordingClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                             resources={"metadata": {"path": ROOT}})   # (cell by cell: one is interrupted)
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            watcher = None
            if index == INDEX["slow"]:
                watcher = threading.Thread(target=_interrupt_when_moving, args=(client, index), daemon=True)
                watcher.start()
            client.execute_cell(cell, index)
            if watcher is not None:
                watcher.join()
    return nb, client.messages


def _interrupt_when_moving(client, index, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(
            kind == "update_display_data" for kind, _ in client.messages.get(index, [])):
        time.sleep(0.05)
    asyncio.run(client.km.interrupt_kernel())   # (the client's manager is asyncio's; this is another thread)


def _bars(messages) -> dict[str, list[tuple[str, str]]]:
    """Each tqdm bar display among ``messages``: its messages in order, (kind, html)."""
    bars: dict[str, list] = {}
    for kind, content in messages:
        html = content.get("data", {}).get("text/html")
        if kind in ("display_data", "update_display_data") and html is not None and ("<progress" in html or not html):
            bars.setdefault(content["transient"]["display_id"], []).append((kind, html))
    return bars


def _cell(notebook, name):
    """The cell, its bars (each made once, then updated in place) and all its messages."""
    nb, messages = notebook
    cell, mine = nb.cells[INDEX[name]], messages.get(INDEX[name], [])
    bars = _bars(mine)
    for shown in bars.values():
        assert [kind for kind, _ in shown].count("display_data") == 1 and shown[0][0] == "display_data"
    assert not [o for o in cell.outputs if WIDGET in o.get("data", {})], cell.outputs   # no widget without a kernel
    return cell, bars, mine


def _errors(cell) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for o in cell.outputs if o.output_type == "error"]


def _count(html: str) -> str:
    return re.search(r"(\d+/\d+) \[", html).group(1)


def test_tqdm_notebook_in_a_rank_draws_the_ranks_html_bars_not_widgets(notebook):
    """A plain cell's ``tqdm.notebook`` bars are widgets; a rank's would be widgets no kernel knows."""
    cell, bars, _ = _cell(notebook, "notebook")
    assert not _errors(cell), cell.outputs
    finals = [shown[-1][1] for shown in bars.values()]
    epochs = [html for html in finals if "ep: " in html]
    assert len(epochs) == 1 and _count(epochs[0]) == "2/2" and GREEN in epochs[0]
    batches = [shown for shown in bars.values() if "ep: " not in shown[-1][1]]
    assert len(batches) == 2 and all(shown[-1][1] == "" for shown in batches)    # leave=False: emptied
    assert any("batch: " in html for shown in batches for _, html in shown)


def test_a_sharedtrain_worker_started_fresh_draws_tqdm_notebook_as_html_bars(notebook):
    cell, bars, _ = _cell(notebook, "shared_spawn")
    assert not _errors(cell), cell.outputs
    finals = sorted(shown[-1][1] for shown in bars.values())
    assert [re.search(r"<span>(\[rank \d\]) shared: 100%", html).group(1) for html in finals] == \
        ["[rank 0]", "[rank 1]"]


def test_a_sharedtrain_workers_bar_over_its_share_of_the_loader_ends_full_and_green(notebook):
    """len(loader) before the first pass is the whole loader's (an evaluation pass reads it whole); once the
    pass is split, the bar's total is the worker's share, as tqdm would have taken it."""
    cell, bars, _ = _cell(notebook, "shared_loader")
    assert not _errors(cell), cell.outputs
    finals = [shown[-1][1] for shown in bars.values()]
    assert len(finals) == 2
    assert all(_count(html) == "4/4" and GREEN in html for html in finals), finals


@pytest.mark.parametrize("name, error", [("open", None), ("error", "ValueError: bad batch")])
def test_a_bar_left_open_shows_its_last_count_as_the_cell_ends(notebook, name, error):
    """tqdm redraws at most every 0.1 s: five fast updates drew nothing after the first. The rank's bar ends
    with the cell (its namespace goes), so its last count shows, red as a bar closed early is."""
    cell, bars, _ = _cell(notebook, name)
    assert [e for e in _errors(cell) if error is None or error not in e] == [] and bool(_errors(cell)) == bool(error)
    (shown,) = bars.values()
    assert _count(shown[0][1]) == "0/8"
    assert _count(shown[-1][1]) == "5/8" and RED in shown[-1][1]


@pytest.mark.parametrize("name", ["after_error", "after_interrupt"])
def test_the_cell_after_an_error_or_an_interrupt_gets_no_bar_messages(notebook, name):
    if name == "after_interrupt":
        slow, _, _ = _cell(notebook, "slow")
        assert any("Interrupted" in e for e in _errors(slow)), slow.outputs
    cell, bars, messages = _cell(notebook, name)
    assert not _errors(cell) and "plain next" in stream_text(cell), cell.outputs
    assert bars == {} and not [kind for kind, _ in messages if kind == "update_display_data"]


def test_the_bar_an_interrupt_stopped_is_drawn_stopped(notebook):
    """Interrupted mid-loop, the rank's bar kept its last draw, looking alive; tqdm.notebook draws a bar an
    exception ended red. The kernel's own key in a bar's metadata reaches no frontend."""
    cell, bars, messages = _cell(notebook, "slow")
    assert any("Interrupted" in e for e in _errors(cell)), cell.outputs
    finals = [shown[-1][1] for shown in bars.values()]
    assert finals and all(GREEN in html for html in finals[:-1]), finals   # the epochs done before it
    assert RED in finals[-1] and _count(finals[-1]) != "8/8", finals[-1]
    assert not [c for _, c in messages if "gpumagic_bar" in (c.get("metadata") or {})]


def test_bars_in_a_ranks_dataloader_workers_stay_text_without_cursor_moves(notebook):
    """A DataLoader worker has no link to the kernel of its own: its bars are text; the rank's bar, an HTML
    display, takes no text line there, so theirs draw on their own lines with no cursor-up codes."""
    cell, bars, _ = _cell(notebook, "loader_workers")
    assert not _errors(cell), cell.outputs
    text = stream_text(cell)
    assert "\x1b[" not in text, repr(text)
    for worker in (0, 1):
        assert f"loader worker {worker}: 100%" in text and "3/3" in text
    (shown,) = bars.values()
    assert "rank: 100%" in shown[-1][1] and _count(shown[-1][1]) == "8/8" and GREEN in shown[-1][1]


def test_nested_bars_writes_and_prints_keep_a_plain_cells_order(notebook):
    cell, bars, messages = _cell(notebook, "nested")
    assert not _errors(cell), cell.outputs
    events = []
    for kind, content in messages:
        if kind == "stream" and content["name"] == "stdout":
            events += [line for line in content["text"].splitlines() if line]
        elif kind == "display_data" and "<progress" in content["data"].get("text/html", ""):
            events.append("bar " + re.search(r"<span>(\w+):", content["data"]["text/html"]).group(1))
    assert events == ["before", "bar epochs", "bar batches", "epoch 0 done", "bar batches", "epoch 1 done", "after"]
    epochs = [shown for shown in bars.values() if "epochs" in shown[0][1]]
    assert len(epochs) == 1 and _count(epochs[0][-1][1]) == "2/2" and GREEN in epochs[0][-1][1]


def test_a_fast_loop_sends_a_handful_of_messages_and_costs_little(notebook):
    cell, bars, _ = _cell(notebook, "fast")
    (shown,) = bars.values()
    assert len(shown) <= 4 and _count(shown[-1][1]) == "100000/100000"
    bare, barred = map(float, re.search(r"times (\S+) (\S+)", stream_text(cell)).groups())
    assert barred < bare + 1.0, (bare, barred)      # (tqdm itself: some 0.05 s here)


def test_two_hundred_bars_are_two_hundred_displays_each_made_once(notebook):
    cell, bars, messages = _cell(notebook, "many")
    assert not _errors(cell) and "many done" in stream_text(cell)
    assert len(bars) == 200 and all(len(shown) <= 3 for shown in bars.values())
    assert all(_count(shown[-1][1]) == "10/10" and GREEN in shown[-1][1] for shown in bars.values())
    assert len(cell.outputs) <= 203          # the 200 bars, the text, %%dataparallel's line


def test_disable_none_shows_the_bar_as_tqdm_notebook_does(notebook):
    """tqdm's ``disable=None`` hides a bar off a terminal; tqdm.notebook, a plain cell's, shows it."""
    cell, bars, _ = _cell(notebook, "disable_none")
    assert not _errors(cell), cell.outputs
    (shown,) = bars.values()
    assert "auto: 100%" in shown[-1][1] and _count(shown[-1][1]) == "8/8"


def test_terminal_ipython_keeps_nested_bars_asstream_text(shell):
    result, text, _ = run_cell(shell, SETUP.split("def warm_up")[0])
    assert result.success, text
    _, cap = dp_cell(shell, "--devices cpu --nprocs 2", NESTED)
    out = cap.stdout + cap.stderr
    assert "epochs: 100%" in out and "2/2" in out and "epoch 1 done" in out
    assert not [o for o in cap.outputs if "text/html" in o.data]


def test_terminal_ipython_text_bar_over_a_workers_share_ends_full(shell):
    """A %%sharedtrain worker's first epoch reads half the loader: its text bar stopped at 4/8 (50%)."""
    result, text, _ = run_cell(shell, SETUP.split("def warm_up")[0])
    assert result.success, text
    result, out, _ = run_cell(shell, "%%sharedtrain --nprocs 2\n" + SHARED_LOADER)
    assert result.success, out
    last = {rank: (percent, count) for rank, percent, count in
            re.findall(r"\[rank (\d)\] hogwild: +(\d+)%\|[^|]*\| (\d+/\d+)", out)}
    assert last == {"0": ("100", "4/4"), "1": ("100", "4/4")}, out
