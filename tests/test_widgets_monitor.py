"""The one monitor thread feeding the memory gauges: values, rate limits, lifecycle, closing."""
from __future__ import annotations

import os
import threading
import time
from collections import Counter

import pytest
import torch
from IPython.utils.capture import capture_output
from ipywidgets.widgets.widget import _instances

from gpumagic import devices, session
from gpumagic.devices import nvml
from gpumagic.widgets import monitor
from gpumagic.widgets.gauge import MemoryGauge
from tests.conftest import run_cell, wait_for
from tests.fake_nvml import four_gpu_machine

GiB = 2**30


@pytest.fixture
def machine(monkeypatch):
    fake = four_gpu_machine()
    fake.gpus[0]["processes"] = [(os.getpid(), 2 * GiB)]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    nvml.use(fake)
    yield fake
    monitor.stop()
    nvml.use(None)


@pytest.fixture
def notebook(shell, monkeypatch):
    """The shell as a Jupyter kernel would be: widgets are displayed."""
    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    yield shell
    monitor.stop()




def monitor_threads():
    return [t for t in threading.enumerate() if t.name == monitor.THREAD_NAME and t.is_alive()]


def open_gauges():
    return [w for w in list(_instances.values()) if isinstance(w, MemoryGauge)]



def test_one_thread_feeds_a_gauge_per_device(notebook, machine, messages):
    with capture_output(display=True) as cap:
        notebook.run_line_magic("gpumem", "--watch --interval 0.05")
    mon = monitor.current()
    assert list(mon.gauges) == ["cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert len(cap.outputs) == 1 and "application/vnd.jupyter.widget-view+json" in cap.outputs[0].data
    assert cap.outputs[0].data["application/vnd.jupyter.widget-view+json"]["model_id"] == mon.box.model_id
    assert len(monitor_threads()) == 1
    g0 = mon.gauges["cuda:0"]
    assert (g0.used, g0.total) == (GiB, 141 * GiB)
    assert "kernel 2.0 GiB" in g0.caption
    # The gauge follows NVML.
    machine.gpus[0]["used"] = 100 * GiB
    assert wait_for(lambda: g0.used == 100 * GiB)
    assert g0.bar.bar_style == "warning" and g0.bar.value == round(100 / 141, 3)
    # Unchanged figures send nothing however many times they are read.
    sends, ticks = mon.gauges["cuda:2"].sends, mon.ticks
    assert wait_for(lambda: mon.ticks >= ticks + 5)
    assert mon.gauges["cuda:2"].sends == sends == 1
    assert messages.get(mon.gauges["cuda:2"].bar.model_id) == 1


def test_default_rate_is_at_most_four_updates_a_second(notebook, machine):
    with capture_output(display=True):
        notebook.run_line_magic("gpumem", "cuda:1 --watch")
    mon = monitor.current()
    assert mon.interval == 0.25 and list(mon.gauges) == ["cuda:1"]
    g = mon.gauges["cuda:1"]
    stop = threading.Event()

    def churn():  # memory changing far faster than anyone could read
        n = 0
        while not stop.is_set():
            n += 1
            machine.gpus[1]["used"] = (n % 50 + 1) * GiB
            time.sleep(0.001)
    t0 = time.monotonic()
    sends0 = g.sends
    churner = threading.Thread(target=churn)
    churner.start()
    time.sleep(1.2)
    stop.set()
    churner.join()
    elapsed = time.monotonic() - t0
    sent = g.sends - sends0
    assert sent <= elapsed / 0.25 + 1
    assert sent >= 2  # and it did keep up


def test_rewatch_replaces_thread_and_gauges_stop_closes_them(notebook, machine):
    with capture_output(display=True):
        notebook.run_line_magic("gpumem", "--watch --interval 0.05")
    first = monitor.current()
    first_widgets = [first.box, *first.gauges.values(), *[c for g in first.gauges.values() for c in g.children]]
    first_ids = [w.model_id for w in first_widgets]
    first_thread = first.thread
    with capture_output(display=True):
        notebook.run_line_magic("gpumem", "--watch --interval 0.1")
    second = monitor.current()
    assert second is not first and not first_thread.is_alive()
    assert monitor_threads() == [second.thread]
    assert all(w.comm is None for w in first_widgets)
    assert not set(first_ids) & set(_instances)
    assert open_gauges() == list(second.gauges.values())

    with capture_output() as cap:
        notebook.run_line_magic("gpumem", "--stop")
    assert "Stopped the memory gauges." in cap.stdout
    assert monitor_threads() == [] and monitor.current() is None
    assert open_gauges() == [] and second.box.comm is None
    with capture_output() as cap:
        notebook.run_line_magic("gpumem", "--stop")  # stopping twice is harmless
    assert "No memory gauges were running." in cap.stdout


def test_repeated_watch_then_stop_leaves_no_widget_open(notebook, machine):
    # Repro of /tmp/pass_article/repro_widget_leak.py: 8 Layout/style comms stayed open per --watch.
    before = Counter(type(w).__name__ for w in list(_instances.values()))
    with capture_output(display=True):
        for _ in range(10):
            notebook.run_line_magic("gpumem", "--watch")
        notebook.run_line_magic("gpumem", "--stop")
    after = Counter(type(w).__name__ for w in list(_instances.values()))
    assert after - before == Counter()


def test_unload_ext_stops_the_thread_and_closes_gauges(notebook, machine):
    with capture_output(display=True):
        notebook.run_line_magic("gpumem", "--watch --interval 0.05")
    mon = monitor.current()
    assert len(monitor_threads()) == 1
    notebook.run_line_magic("unload_ext", "gpumagic")
    try:
        assert monitor_threads() == [] and monitor.current() is None
        assert open_gauges() == [] and mon.box.comm is None
        assert "gpumem" not in notebook.magics_manager.magics["line"]
    finally:
        notebook.run_line_magic("load_ext", "gpumagic")
    assert "gpumem" in notebook.magics_manager.magics["line"]


def test_lifecycle_calls_are_idempotent(machine):
    mon = monitor.start(["cpu"], interval=0.05)
    thread = mon.thread
    assert mon.start() is mon and mon.thread is thread  # already running
    mon.restart(interval=0.02)
    assert mon.interval == 0.02 and not thread.is_alive() and mon.running
    assert monitor_threads() == [mon.thread]
    assert monitor.stop() is True and monitor.stop() is False
    mon.stop()  # a stopped monitor may be stopped again
    assert not mon.running and mon.closed and monitor_threads() == []
    assert monitor.restart() is None
    with pytest.raises(ValueError):
        monitor.Monitor(["cpu"], interval=0)


def test_a_failing_reading_does_not_kill_the_thread(machine, monkeypatch):
    mon = monitor.start(["cpu"], interval=0.02)
    from gpumagic.devices import memory
    real = memory.device_memory
    monkeypatch.setattr(memory, "device_memory", lambda *a, **k: 1 / 0)
    assert wait_for(lambda: mon.errors)
    assert mon.running and mon.gauges["cpu"].used is None and "reading failed" in mon.gauges["cpu"].caption
    monkeypatch.setattr(memory, "device_memory", real)
    assert wait_for(lambda: mon.gauges["cpu"].used is not None)
    monitor.stop()


def test_monitoring_never_initialises_cuda(notebook, machine, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda *a, **k: calls.append(a))
    notebook.user_ns["x"] = torch.ones(10)
    with capture_output(display=True):
        notebook.run_line_magic("gpumem", "")
        notebook.run_line_magic("gpumem", "--vars")
        notebook.run_line_magic("gpumem", "--watch --interval 0.05")
    mon = monitor.current()
    assert wait_for(lambda: mon.ticks >= 5)
    monitor.stop()
    assert calls == [] and not torch.cuda.is_initialized()
    assert not devices.torch_cuda_initialized()


def test_terminal_watch_prints_text_and_starts_nothing(shell, machine):
    result, out, cap = run_cell(shell, "%gpumem --watch")
    assert result.success
    assert "Live gauges need a notebook" in out and "cuda:3" in out and "141.0 GiB" in out
    assert cap.outputs == [] and "Box(" not in out and "widget" not in out.lower().replace("widgets)", "")
    assert monitor_threads() == [] and monitor.current() is None and open_gauges() == []


def test_notebook_tables_are_html(notebook, machine):
    notebook.user_ns["x"] = torch.ones(256)
    for line in ("", "--vars", "--free"):
        with capture_output(display=True) as cap:
            notebook.run_line_magic("gpumem", line)
        assert len(cap.outputs) == 1 and "<table>" in cap.outputs[0].data["text/html"]
    assert monitor_threads() == []
    assert session._closers.get("gpumem-monitor") is None


def test_a_long_interval_stops_at_once_and_one_past_what_a_wait_takes_is_refused(machine):
    # stop() used to join for 4 x the interval: past threading.TIMEOUT_MAX that raised OverflowError.
    mon = monitor.start(["cpu"], interval=3e9)
    started = time.monotonic()
    assert monitor.stop() is True
    assert time.monotonic() - started < 2 and not mon.running and monitor_threads() == []
    # The thread's first Event.wait(1e10) raised OverflowError: it died and the gauges froze.
    for interval in (1e10, float("inf"), 0, -1):
        with pytest.raises(ValueError, match="interval must be positive seconds up to 9223372036"):
            monitor.Monitor(["cpu"], interval=interval)
    assert monitor_threads() == []


def _hang_memory_reads(machine):
    """Make the fake NVML's memory read block, as a wedged driver's does; returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real = machine.nvmlDeviceGetMemoryInfo

    def hanging(handle):
        entered.set()
        release.wait(60)   # (bounded, so that a failing test leaves no thread for good)
        return real(handle)
    machine.nvmlDeviceGetMemoryInfo = hanging
    return entered, release


def _in_thread(fn, timeout=10.0):
    """Run ``fn`` in a thread; returns (finished, seconds, result): a hang fails the test instead of the run."""
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(timeout)
    return not worker.is_alive(), time.monotonic() - started, out[0] if out else None


def test_stop_is_bounded_when_a_reading_hangs(notebook, machine, monkeypatch, caplog):
    # %gpumem --stop waited for ever on the tick lock that a hung NVML read held.
    with capture_output(display=True):
        notebook.run_line_magic("gpumem", "cuda:0 --watch --interval 0.05")
    mon = monitor.current()
    gauge, thread = mon.gauges["cuda:0"], mon.thread
    assert gauge.used == GiB
    entered, release = _hang_memory_reads(machine)
    monkeypatch.setattr(monitor, "STOP_TIMEOUT", 0.3, raising=False)
    try:
        assert entered.wait(5)   # the thread is inside the read now

        def stop_magic():
            with capture_output() as cap:
                notebook.run_line_magic("gpumem", "--stop")
            return cap.stdout
        finished, seconds, out = _in_thread(stop_magic)
        assert finished and 0.3 <= seconds < 2.0
        assert "Stopped the memory gauges." in out
        assert monitor.current() is None and mon.closed and not mon.running
        assert gauge.comm is None and mon.box.comm is None and open_gauges() == []
        warnings = [r.getMessage() for r in caplog.records
                    if r.name == "gpumagic.widgets.monitor" and r.levelname == "WARNING"]
        assert len(warnings) == 1
        assert warnings[0].startswith("gpumagic's memory monitor did not stop within 0.3 s: a reading of cuda:0 "
                                      "has not returned")
        assert thread.daemon and thread.is_alive()   # left behind, stuck in the read
        # The read returns at last, with new figures: the thread ends and the closed gauge stays as it was.
        sends = gauge.sends
        machine.gpus[0]["used"] = 50 * GiB
    finally:
        release.set()
    assert wait_for(lambda: not thread.is_alive())
    assert gauge.sends == sends and gauge.used == GiB
    assert monitor_threads() == []


def test_unload_ext_is_bounded_when_a_reading_hangs(notebook, machine, monkeypatch, caplog):
    with capture_output(display=True):
        notebook.run_line_magic("gpumem", "--watch --interval 0.05")
    mon = monitor.current()
    entered, release = _hang_memory_reads(machine)
    monkeypatch.setattr(monitor, "STOP_TIMEOUT", 0.3, raising=False)
    try:
        assert entered.wait(5)
        finished, seconds, _ = _in_thread(lambda: notebook.run_line_magic("unload_ext", "gpumagic"))
        assert finished and seconds < 2.0
        assert "gpumem" not in notebook.magics_manager.magics["line"]
        assert monitor.current() is None and mon.closed and open_gauges() == []
        assert any("did not stop within 0.3 s" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        notebook.run_line_magic("load_ext", "gpumagic")
    assert wait_for(lambda: monitor_threads() == [])


def test_restart_with_a_hung_reading_closes_the_gauges_and_says_so(machine, monkeypatch):
    from gpumagic.devices import visible_gpus
    mon = monitor.start(visible_gpus()[:1], interval=0.05)
    entered, release = _hang_memory_reads(machine)
    monkeypatch.setattr(monitor, "STOP_TIMEOUT", 0.2, raising=False)
    try:
        assert entered.wait(5)
        with pytest.raises(RuntimeError, match="stuck in a reading"):
            monitor.restart(0.1)
        assert monitor.current() is None and mon.closed and open_gauges() == []
    finally:
        release.set()
    assert wait_for(lambda: monitor_threads() == [])


def test_a_hung_reading_that_fails_after_stop_leaves_the_closed_gauges_alone(notebook, machine, monkeypatch):
    with capture_output(display=True):
        notebook.run_line_magic("gpumem", "cuda:0 --watch --interval 0.05")
    mon = monitor.current()
    gauge, thread = mon.gauges["cuda:0"], mon.thread
    entered, release = threading.Event(), threading.Event()

    def hangs_then_fails(*args, **kwargs):
        entered.set()
        release.wait(60)
        raise RuntimeError("the GPU is lost")
    monkeypatch.setattr(monitor.memory, "device_memory", hangs_then_fails)
    monkeypatch.setattr(monitor, "STOP_TIMEOUT", 0.3, raising=False)
    try:
        assert entered.wait(5)
        assert _in_thread(lambda: mon.stop())[0]
        shown = (gauge.sends, gauge.used, gauge.text.value)
    finally:
        release.set()          # the reading fails now, as a wedged driver's often does at last
    assert wait_for(lambda: not thread.is_alive())
    assert (gauge.sends, gauge.used, gauge.text.value) == shown   # no "n/a: reading failed" on a closed gauge
