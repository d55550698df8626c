"""The gauges' history: the values kept and their window, the SVG line drawn from them, the updates the
monitor sends for it (at most one per tick), and who holds each GPU named on its gauge."""
from __future__ import annotations

import os
import re
import time

import pytest

from gpumagic.devices import jupyter_servers, visible_gpus
from gpumagic.procs import marks
from gpumagic.widgets import monitor
from gpumagic.widgets.history import History
from gpumagic.widgets.sparkline import sparkline
from tests.conftest import wait_for
from tests.fake_nvml import four_gpu_machine, installed
from tests.sharing_helpers import Started, live_worker

GiB = 2**30


@pytest.fixture
def machine(monkeypatch):
    yield from installed(four_gpu_machine(), monkeypatch)
    monitor.stop()


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- the values and their window

def test_each_step_keeps_the_peak_memory_and_the_mean_utilisation():
    h = History(window=60, buckets=12)   # 5 s steps
    assert h.step == 5.0 and h.series() == ([None] * 12, [None] * 12)
    assert h.add(100.0, memory=0.2, utilization=0.5) is True
    assert h.add(101.0, memory=0.4) is True            # the peak rose a level
    assert h.add(102.0, memory=0.3, utilization=0.1) is True   # the mean fell to 0.3
    assert h.add(103.0, memory=0.39) is False           # nothing changes as drawn
    memory, busy = h.series(now=104.0)
    assert memory == [None] * 11 + [0.4] and busy == [None] * 11 + [pytest.approx(0.3)]
    assert h.add(106.0, memory=0.1, utilization=0.9) is True   # a new step
    memory, busy = h.series(now=106.0)
    assert memory[-2:] == [0.4, 0.1] and busy[-2:] == [pytest.approx(0.3), 0.9]
    assert h.peak() == 0.4 and len(h) == 2


def test_the_window_keeps_the_last_minutes_only_and_a_pause_is_a_gap():
    h = History(window=60, buckets=12)
    for t in range(0, 120, 5):                           # 24 steps of samples
        h.add(float(t), memory=t / 200)
    assert len(h) == 12                                  # only the window's worth is kept
    memory, _ = h.series(now=115.0)
    assert memory == [t / 200 for t in range(60, 120, 5)]
    h.add(140.0, memory=0.9)                             # 20 s without samples: four empty steps
    memory, _ = h.series(now=140.0)
    assert memory[-6:] == [0.575, None, None, None, None, 0.9]
    memory, _ = h.series(now=500.0)                      # all of it older than the window
    assert memory == [None] * 12
    assert h.add(10.0, memory=0.5) is False and h.series(now=140.0)[0][-1] == 0.9   # a sample from the past
    with pytest.raises(ValueError, match="need window > 0"):
        History(window=0)


def test_the_line_is_drawn_at_whole_pixels_with_gaps():
    svg = sparkline([0.0, 1.0, None, 0.5], [None, 0.2, 0.2, None], width=31, height=12)
    assert svg.startswith("<svg class='gpumagic-history' width='31' height='12'")
    assert "<polyline class='gpumagic-history-memory' points='0,11 10,1'" in svg
    assert "<circle class='gpumagic-history-memory' cx='30' cy='6' r='1'" in svg   # a lone value: a dot
    assert "<polyline class='gpumagic-history-utilization' points='10,9 20,9'" in svg
    # Less than a pixel apart: the same text, so a gauge sends nothing for it.
    assert sparkline([0.5, 0.52], [None, None], height=12) == sparkline([0.5, 0.5], [None, None], height=12)
    assert sparkline([0.5, 0.6], [None, None], height=12) != sparkline([0.5, 0.5], [None, None], height=12)
    assert "<title>a &amp; b</title>" in sparkline([0.1], [0.1], title="a & b")


# --------------------------------------------------------------------------- the monitor feeds it

def test_the_monitor_feeds_the_line_with_one_message_at_most_per_tick(machine, messages):
    mon = monitor.Monitor(visible_gpus()[:1], split_every=0)
    clock = mon.clock = Clock()
    gauge = mon.gauges["cuda:0"]
    sent = lambda: messages.get(gauge.history.model_id, 0)   # noqa: E731
    try:
        per_tick = []
        for _ in range(12):                       # 3 s within one 5 s step, nothing changing
            before = sent()
            mon.tick()
            per_tick.append(sent() - before)
            clock.now += 0.25
        assert per_tick == [1] + [0] * 11          # drawn once, then nothing to send
        memory, busy = mon.histories["cuda:0"].series(clock.now)
        assert memory[-1] == pytest.approx(1 / 141) and busy[-1] == pytest.approx(0.37)   # the fake's 37 %
        assert machine.calls > 0
        svg = gauge.history.value
        assert "gpumagic-history-memory" in svg and "gpumagic-history-utilization" in svg
        assert "cuda:0, last 5 min: memory (blue), peak 1%; utilisation (orange)" in svg

        machine.gpus[0]["used"] = 100 * GiB       # memory jumps: redrawn at that tick
        before = sent()
        mon.tick()
        assert sent() - before == 1 and "peak 71%" in gauge.history.value
        for _ in range(40):                       # 20 s of ticks at 0.5 s: four new steps, one message each
            before = sent()
            clock.now += 0.5
            mon.tick()
            assert sent() - before <= 1
        assert mon.gauges["cuda:0"].history_sends == sent() == 2 + 4
        assert len(mon.histories["cuda:0"]) == 5
        circles_or_lines = re.findall(r"gpumagic-history-memory' points='([^']*)'", gauge.history.value)
        assert len(circles_or_lines) == 1 and len(circles_or_lines[0].split()) == 5   # one point per step
    finally:
        mon.stop()


def test_utilisation_is_read_twice_a_step_not_at_every_tick(machine):
    mon = monitor.Monitor(visible_gpus()[:1], split_every=0)
    clock = mon.clock = Clock()
    reads = []
    real = machine.nvmlDeviceGetUtilizationRates
    machine.nvmlDeviceGetUtilizationRates = lambda h: reads.append(clock.now) or real(h)
    try:
        for _ in range(20):                       # 5 s of ticks at 0.25 s
            mon.tick()
            clock.now += 0.25
    finally:
        mon.stop()
    assert reads == [1000.0, 1002.5]   # every 2.5 s: two readings per 5 s step of the line


# --------------------------------------------------------------------------- who holds each GPU, slower

def test_the_gauge_names_who_else_holds_the_gpu_at_a_slower_rate(machine, tmp_path, monkeypatch, no_cuda_init):
    monkeypatch.setenv(marks.DIR_ENV, str(tmp_path / "marks"))
    jupyter_servers.forget()
    started = Started()
    try:
        worker = live_worker(started, tmp_path, rank=1)
        machine.gpus[0]["processes"] = [(os.getpid(), 2 * GiB), (worker, 3 * GiB)]
        mon = monitor.start(visible_gpus()[:2], interval=0.02, split_every=0.5)
        gauge = mon.gauges["cuda:0"]
        assert wait_for(lambda: mon.splits >= 1)
        assert gauge.split == "rank 1 of this kernel 3.0 GiB"
        assert gauge.text.value.endswith("<div class='gpumagic-split'>rank 1 of this kernel 3.0 GiB</div>")
        assert "kernel 2.0 GiB" in gauge.caption   # this kernel's own share stays in the figures
        assert mon.gauges["cuda:1"].split == ""
        ticks, splits, began = mon.ticks, mon.splits, time.monotonic()
        assert wait_for(lambda: mon.ticks >= ticks + 60)
        ticked, named = mon.ticks - ticks, mon.splits - splits
        assert named <= (time.monotonic() - began) / 0.5 + 1   # every 0.5 s...
        assert ticked >= 5 * named                             # ...not at every tick
        machine.gpus[0]["processes"] = [(os.getpid(), 2 * GiB)]
        assert wait_for(lambda: gauge.split == "")
    finally:
        monitor.stop()
        started.end_all()
