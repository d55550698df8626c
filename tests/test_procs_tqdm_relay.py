"""tqdm's bars drawn in a worker as a notebook's HTML bars: the rendering, throttling and closing, in
this process with a stand-in for the worker's link to the kernel (what it would send is recorded).

The cells that show them in a real notebook: test_launch_notebook_progress.py.
"""
from __future__ import annotations

import io
import os
from types import SimpleNamespace

import pytest

tqdm_std = pytest.importorskip("tqdm.std")

from gpumagic.procs import display_relay, tqdm_relay  # noqa: E402
from gpumagic.procs.tqdm_relay import notebook_bars, relay_bars, render  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


@pytest.fixture
def worker(monkeypatch):
    """A task whose output reaches the cell (rank 0), tqdm's class patched as in a worker (and given
    back after), a clock the test moves; ``worker.sent``: the display messages."""
    for name in ("display", "clear", "close"):
        monkeypatch.setattr(tqdm_std.tqdm, name, vars(tqdm_std.tqdm)[name])
    sent: list = []
    ctx = SimpleNamespace(in_task=True, forward=True, rank=0, _send=sent.append)
    monkeypatch.setattr(display_relay, "_ctx", ctx)
    clock = Clock()
    monkeypatch.setattr(tqdm_relay, "time", clock)
    relay_bars()
    return SimpleNamespace(ctx=ctx, sent=sent, clock=clock)


def _shown(sent) -> list[tuple[str, bool, str]]:
    """(display id, whether an update, html) for each display message; each says whether its bar is open
    (carrying its stopped look, red, for the kernel to draw if the task ends first) or closed."""
    assert all(m[0] == "display" and list(m[2]) == ["gpumagic_bar"] for m in sent), sent
    for m in sent:
        bar = m[2]["gpumagic_bar"]
        assert bar == {"closed": True} or "accent-color:#d9534f" in bar["stopped"]["text/html"], bar
    return [(m[3]["display_id"], m[4], m[1]["text/html"]) for m in sent]


def test_a_loop_is_one_display_made_once_then_updated_to_its_final_count(worker):
    out = io.StringIO()
    with notebook_bars(True):
        for _ in tqdm_std.tqdm(range(8), desc="train", file=out, mininterval=0):
            pass   # (no time passes: every draw after the first is held back, but the final count)
    shown = _shown(worker.sent)
    assert len({i for i, _, _ in shown}) == 1
    assert [update for _, update, _ in shown] == [False, True, True]    # made, 8/8, closed (green)
    first, done, closed = (html for _, _, html in shown)
    assert "value='0' max='8'" in first and "0/8" in first and "train: " in first
    assert "value='8' max='8'" in done and "8/8" in done and "<progress" in done
    assert closed.count("8/8") == 1 and "accent-color:#5cb85c" in closed and "accent-color" not in done
    assert out.getvalue() == ""                                          # nothing as text


def test_draws_come_at_most_once_per_mininterval_and_the_last_one_at_the_end(worker):
    """Lightning sets ``bar.n`` and calls ``refresh()`` every batch, past tqdm's own throttle."""
    with notebook_bars(True):
        bar = tqdm_std.tqdm(total=10, file=io.StringIO(), mininterval=0.5)
        for n in range(1, 5):
            bar.n = n
            bar.refresh()
            worker.clock.now += 0.1
        assert len(worker.sent) == 1 and "0/10" in _shown(worker.sent)[0][2]   # 1..4 within 0.5 s: held back
        worker.clock.now += 0.2
        bar.n = 5
        bar.refresh()
        assert len(worker.sent) == 2 and "5/10" in _shown(worker.sent)[-1][2]
        bar.n = 6
        bar.refresh()
        assert len(worker.sent) == 2
    assert len(worker.sent) == 3 and "6/10" in _shown(worker.sent)[-1][2]   # the held one, as the task ends
    bar.n = 7
    bar.refresh()                                                        # after the task: nowhere to go
    assert len(worker.sent) == 3


def test_nested_bars_are_two_displays_and_a_finished_leave_false_bar_is_emptied(worker):
    out = io.StringIO()
    with notebook_bars(True):
        outer = tqdm_std.tqdm(total=2, desc="epoch", file=out)
        for _ in range(2):
            for _ in tqdm_std.tqdm(range(3), desc="val", leave=False, position=1, file=out, mininterval=0):
                pass
            outer.update()
        tqdm_std.tqdm.write("a line of its own", file=out)
        outer.close()
    shown = _shown(worker.sent)
    ids = list(dict.fromkeys(i for i, _, _ in shown))
    assert len(ids) == 3                                                 # the outer bar, two inner ones
    last = {i: html for i, _, html in shown}
    assert "epoch: " in last[ids[0]] and "2/2" in last[ids[0]]
    assert last[ids[1]] == last[ids[2]] == ""                            # done, and not to be left
    assert [html for i, _, html in shown if i == ids[1]][-2].count("3/3") == 1
    assert out.getvalue() == "a line of its own\n"                       # no bar text, no cursor moves


def test_a_bar_stopped_early_stays_red_even_if_not_to_be_left(worker):
    with notebook_bars(True):
        for i in tqdm_std.tqdm(range(8), leave=False, file=io.StringIO()):
            if i == 2:
                break
    html = _shown(worker.sent)[-1][2]
    assert "accent-color:#d9534f" in html and "2/8" in html


def test_every_ranks_bar_says_its_rank_where_every_rank_is_shown(worker):
    worker.ctx.rank = 1
    with notebook_bars(True, labelled=True):
        tqdm_std.tqdm(range(2), desc="<b>", file=io.StringIO()).close()
    html = _shown(worker.sent)[0][2]
    assert "<span>[rank 1] &lt;b&gt;: " in html                         # (the description escaped)


@pytest.mark.parametrize("case", ["not-a-notebook", "output-not-shown"])
def test_elsewhere_bars_stay_text(worker, case):
    worker.ctx.forward = case != "output-not-shown"
    out = io.StringIO()
    with notebook_bars(case != "not-a-notebook"):
        for _ in tqdm_std.tqdm(range(8), desc="train", file=out, mininterval=0):
            pass
        inner = tqdm_std.tqdm(range(2), position=1, file=out)
        inner.close()
    assert worker.sent == []
    assert "\rtrain: 100%" in out.getvalue() and "8/8" in out.getvalue()
    assert "\x1b[A" in out.getvalue()                                    # tqdm's own nested drawing


def test_a_child_the_worker_forks_sends_nothing_and_draws_its_own_bars_as_text(worker, monkeypatch):
    """A DataLoader worker forked from a rank has no link of its own to the kernel."""
    out = io.StringIO()
    with notebook_bars(True):
        made_before = tqdm_std.tqdm(total=2, file=out)
        monkeypatch.setattr(tqdm_relay, "_pid", os.getpid() + 1)      # as in the forked child
        made_before.update(2)
        made_before.close()
        for _ in tqdm_std.tqdm(range(3), desc="child", file=out):
            pass
    assert len(worker.sent) == 1                                         # the first drawing, before the fork
    assert "child: 100%" in out.getvalue() and "2/2" not in out.getvalue()


def test_render_without_a_total_is_an_indeterminate_bar():
    bar = tqdm_std.tqdm(desc="stream", file=io.StringIO(), disable=False)
    bar.update(5)
    data = render(bar)
    bar.close()
    assert "<progress style=" in data["text/html"] and " 5/? " in data["text/html"]
    assert data["text/plain"].startswith("stream: ") and "\x1b" not in data["text/plain"]



def test_the_kernel_draws_stopped_the_bars_a_task_left_open(worker, shell, monkeypatch):
    """What the kernel does with a worker's bar messages (display_relay.show): the bar's own key stays out of
    the published metadata, and bars not closed when the task ends are drawn stopped, once."""
    import IPython.display
    published = []
    monkeypatch.setattr(IPython.display, "publish_display_data",
                        lambda data, metadata=None, **kw: published.append((data, metadata, kw)))
    out = io.StringIO()
    with notebook_bars(True):
        done = tqdm_std.tqdm(range(2), desc="done", file=out)
        list(done)
        stuck = tqdm_std.tqdm(total=10, desc="stuck", file=out)
        stuck.update(3)
        messages = list(worker.sent)   # (before the task's end closes it, as a killed rank never does)
    for message in messages:
        display_relay.show(message)
    assert all(metadata == {} for _, metadata, _ in published)
    assert len(display_relay._open_bars) == 1
    published.clear()
    display_relay.stop_open_bars()
    ((data, _, kw),) = published
    assert "stuck" in data["text/html"] and "accent-color:#d9534f" in data["text/html"]
    assert kw == {"transient": {"display_id": vars(stuck)[tqdm_relay._ATTR].display_id}, "update": True}
    display_relay.stop_open_bars()
    assert len(published) == 1 and display_relay._open_bars == {}
