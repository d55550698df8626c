"""One memory gauge: colours by fullness, values shown, only changes sent, text fallback."""
from __future__ import annotations

from ipywidgets.widgets.widget import _instances

from gpumagic.widgets.gauge import MemoryGauge, bar_style_for
from tests.conftest import run_cell

GiB = 2**30




def open_gauges():
    return [w for w in list(_instances.values()) if isinstance(w, MemoryGauge)]


def test_bar_style_by_fullness():
    assert [bar_style_for(f) for f in (0.0, 0.69, 0.70, 0.89, 0.90, 1.0, None)] == [
        "success", "success", "warning", "warning", "danger", "danger", ""]


def test_gauge_shows_values_and_sends_only_changes(messages):
    g = MemoryGauge("cuda:0", "NVIDIA H200")
    try:
        assert g.show(40 * GiB, 100 * GiB, "kernel 2.0 GiB") is True
        assert g.bar.value == 0.4 and g.bar.bar_style == "success"
        assert g.text.value == "40.0 GiB / 100.0 GiB (40%) · kernel 2.0 GiB"
        bar_msgs, text_msgs = messages[g.bar.model_id], messages[g.text.model_id]
        assert bar_msgs == 1  # value and colour in one message
        # Same figures, or a change too small to display: nothing is sent.
        assert g.show(40 * GiB, 100 * GiB, "kernel 2.0 GiB") is False
        assert g.show(40 * GiB + 1000, 100 * GiB, "kernel 2.0 GiB") is False
        assert messages[g.bar.model_id] == bar_msgs and messages[g.text.model_id] == text_msgs
        assert g.show(95 * GiB, 100 * GiB) is True
        assert g.bar.bar_style == "danger" and g.bar.value == 0.95
        assert messages[g.bar.model_id] == bar_msgs + 1 and messages[g.text.model_id] == text_msgs + 1
        assert g.sends == 2
        assert g.text_line(10) == "cuda:0 [##########] 95.0 GiB / 100.0 GiB (95%)"
        assert g.show(None, None) is True and g.text.value == "n/a" and g.bar.bar_style == ""
    finally:
        g.close()
    assert g not in open_gauges() and g.bar.comm is None and g.text.comm is None


def test_gauge_text_fallback_in_terminal(shell):
    g = MemoryGauge("cpu", "CPU")
    try:
        g.show(3 * GiB, 12 * GiB)
        shell.user_ns["g"] = g
        result, out, cap = run_cell(shell, "g")
        assert "cpu [#####...............] 3.0 GiB / 12.0 GiB (25%)" in out
    finally:
        g.close()


def test_closing_a_gauge_closes_every_widget_it_made():
    # Each part's layout and style is a widget with a comm of its own (ipywidgets' close leaves them open).
    before = set(_instances)
    g = MemoryGauge("cuda:0", "NVIDIA H200")
    made = set(_instances) - before
    assert {g.layout.model_id, g.bar.style.model_id, g.label.style.model_id, g.text.layout.model_id} <= made
    g.close()
    assert set(_instances) - before == set()
    g.close()  # closing twice is harmless
