"""A wedged driver (an NVML call that never returns) does not hang %gpuinfo or %gpumem: their NVML
reading runs in a daemon thread waited for at most nvml.READ_TIMEOUT seconds, and while it is stuck
no other reading starts."""
from __future__ import annotations

import threading
import time

import pytest
import torch  # noqa: F401 - imported before the timings: a first import takes seconds, NVML or not
from IPython.utils.capture import capture_output

from gpumagic.devices import nvml
from gpumagic.widgets import monitor
from tests.conftest import wait_for
from tests.fake_nvml import four_gpu_machine, installed

BOUND = 0.5   # seconds: nvml.READ_TIMEOUT for these tests
GiB = 2**30


class Hang:
    """Make one of the fake NVML's calls block on an Event, as a wedged driver's does."""

    def __init__(self, fake, name):
        self.fake, self.name, self.real = fake, name, getattr(fake, name)
        self.entered = 0
        self.inside = 0                     # calls blocked right now: hung threads
        self.release = threading.Event()
        setattr(fake, name, self._hanging)

    def _hanging(self, *args):
        self.entered += 1
        self.inside += 1
        try:
            self.release.wait(60)           # bounded, so that a failing test leaves no thread for good
        finally:
            self.inside -= 1
        return self.real(*args)


@pytest.fixture
def machine(monkeypatch):
    monkeypatch.setattr(nvml, "READ_TIMEOUT", BOUND, raising=False)
    yield from installed(four_gpu_machine(), monkeypatch)


@pytest.fixture
def hangs(machine):
    """``hangs("nvmlDeviceGetCount")`` wedges that call; released, and waited out, after the test."""
    made: list[Hang] = []

    def make(name):
        made.append(Hang(machine, name))
        return made[-1]
    yield make
    for hang in made:
        hang.release.set()
    assert wait_for(lambda: nvml.stuck_note() is None and readers() == [])
    monitor.stop()


@pytest.fixture
def notebook(shell, monkeypatch):
    from gpumagic.widgets.picker import close_all_pickers
    monkeypatch.setattr(shell, "kernel", object(), raising=False)   # widgets are displayed, as in Jupyter
    yield shell
    monitor.stop()
    close_all_pickers()   # a later test's picker is the only open one


def readers():
    return [t for t in threading.enumerate() if t.name == nvml.READER_NAME and t.is_alive()]



def timed(shell, line, magic="gpuinfo"):
    """Run the magic in a helper thread (a hang fails the test, not the run); (seconds, stdout, result, displays)."""
    out: list = []

    def run():
        with capture_output(display=True) as cap:
            result = shell.run_line_magic(magic, line)
        out.append((cap.stdout, result, cap.outputs))
    worker = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(15)
    assert not worker.is_alive(), f"%{magic} {line} hung"
    return (time.monotonic() - started, *out[0])


def test_gpuinfo_returns_within_the_bound_with_the_cpu_and_a_note(shell, hangs):
    hang = hangs("nvmlDeviceGetCount")
    seconds, out, _, _ = timed(shell, "")
    assert BOUND <= seconds < BOUND + 1.5
    assert hang.entered == 1 and hang.inside == 1 and len(readers()) == 1   # left behind, stuck
    assert "note: the GPU driver did not answer in 0.5 s (an NVML call has not returned: a wedged driver?); " \
           "GPU figures are not shown." in out
    header = out.splitlines()[0].split()
    assert header == ["cpu"]                          # what needs no NVML: the CPU's column
    assert "kernel resident" in out and "cuda:0" not in out
    assert "gpumagic cells run on cpu; gpumagic.set_current_device(DEVICE) changes it (cpu, meta)." in out


def test_a_second_call_while_the_first_is_stuck_starts_no_thread(shell, hangs):
    hang = hangs("nvmlDeviceGetCount")
    timed(shell, "")
    stuck = readers()
    seconds, _, facts, _ = timed(shell, "--json")
    assert seconds < BOUND                             # refused at once: no second wait on the driver
    assert hang.entered == 1 and readers() == stuck    # the same one stuck thread, no new one
    (note,) = facts["notes"]
    assert note.startswith("the GPU driver did not answer in 0.5 s and still has not: "
                           "%gpuinfo's NVML reading, started ")
    assert [d["device"] for d in facts["devices"]] == ["cpu"] and facts["system"]["nvml"] == note
    assert facts["system"]["driver_version"] is None and facts["system"]["torch_version"]
    # A GPU named while the driver hangs cannot be checked: no column, the note says why.
    seconds, _, facts, _ = timed(shell, "cuda:1 --json")
    assert seconds < BOUND and facts["devices"] == [] and len(facts["notes"]) == 1
    assert facts["notes"][0].startswith("the GPU driver did not answer in 0.5 s and still has not")
    seconds, out, _, _ = timed(shell, "1")
    assert seconds < BOUND and out.startswith("driver n/a, CUDA (driver) n/a, torch ")   # no empty table
    assert "\nnote: the GPU driver did not answer in 0.5 s and still has not" in out
    # Once the driver answers, everything is back: the stuck reading ends and nothing is refused.
    hang.release.set()
    assert wait_for(lambda: readers() == [] and nvml.stuck_note() is None)
    facts = shell.run_line_magic("gpuinfo", "--json")
    assert [d["device"] for d in facts["devices"]] == ["cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert not any("did not answer" in n for n in facts["notes"])
    assert facts["system"]["driver_version"] == "580.159.04"


def test_the_notebook_picker_offers_what_needs_no_nvml(notebook, hangs):
    hangs("nvmlDeviceGetCount")
    seconds, out, _, displays = timed(notebook, "")
    assert seconds < BOUND + 1.5
    table, picker = displays
    assert "did not answer in 0.5 s" in table.data["text/plain"]
    assert picker.data["text/plain"] == "device: cpu (later gpumagic cells run there; choices: cpu, meta)"


def test_gpumem_watch_with_a_hung_listing_shows_the_cpu_gauge_and_a_note(notebook, hangs):
    hang = hangs("nvmlDeviceGetCount")
    seconds, out, _, displays = timed(notebook, "--watch --interval 0.05", magic="gpumem")
    assert BOUND <= seconds < BOUND + 1.5
    assert list(monitor.current().gauges) == ["cpu"] and len(displays) == 1
    assert out.startswith("note: the GPU driver did not answer in 0.5 s")
    seconds, _, table, _ = timed(notebook, "--json", magic="gpumem")   # the table: the CPU, and the note
    assert seconds < BOUND and list(table["devices"]) == ["cpu"]
    assert any("still has not: listing the GPUs, started" in note for note in table["notes"])
    assert hang.entered == 1 and len(readers()) == 1


def test_gpumem_watch_with_a_hung_first_reading_is_bounded_and_piles_up_nothing(notebook, hangs, machine):
    from gpumagic.devices import visible_gpus
    assert len(visible_gpus()) == 4                  # the listing answers (and is kept); memory reads hang
    hang = hangs("nvmlDeviceGetMemoryInfo")
    seconds, out, _, _ = timed(notebook, "--watch --interval 0.05", magic="gpumem")
    assert BOUND <= seconds < BOUND + 1.5
    mon = monitor.current()
    assert mon.stalled is not None and out == f"note: {mon.stalled}\n"
    assert mon.gauges["cpu"].used is not None        # read before the hung call
    assert mon.gauges["cuda:0"].caption == "n/a · the driver did not answer in 0.5 s"
    assert hang.inside == 1                          # the monitor's thread, inside the call
    # Again: nothing waits on the stuck reading (no 2 s join of a thread known to hang), no new reading
    # starts, and the gauges are those that need no NVML.
    seconds, out, _, _ = timed(notebook, "--watch --interval 0.05", magic="gpumem")
    assert seconds < BOUND
    assert list(monitor.current().gauges) == ["cpu"] and mon.closed
    assert "still has not: the memory gauges' first reading, started" in out
    assert hang.entered == 1 and hang.inside == 1 and readers() == []
    # The plain table and %gpuinfo are refused at once too.
    assert timed(notebook, "", magic="gpumem")[0] < BOUND
    assert timed(notebook, "--json")[0] < BOUND
    assert hang.entered == 1
    # The reading returns at last: the left-behind thread sees its gauges closed and ends.
    hang.release.set()
    assert wait_for(lambda: nvml.stuck_note() is None)
    assert wait_for(lambda: len([t for t in threading.enumerate() if t.name == monitor.THREAD_NAME]) == 1)


def test_gpumem_table_with_a_hung_memory_reading_shows_na_and_the_note(shell, hangs):
    from gpumagic.devices import visible_gpus
    visible_gpus()
    hangs("nvmlDeviceGetMemoryInfo")
    seconds, _, table, _ = timed(shell, "--json", magic="gpumem")
    assert BOUND <= seconds < BOUND + 1.5
    assert table["devices"]["cpu"]["total"] > 0
    assert table["devices"]["cuda:0"]["total"] is None and table["devices"]["cuda:0"]["process_note"] == "no answer"
    assert [n for n in table["notes"] if "driver" in n] == [nvml.timeout_note(BOUND)]


def _stuck_in_child(conn):
    conn.send(nvml.stuck_note())


def test_bounded_hands_back_results_and_errors_refuses_while_stuck_and_forks_clean(machine):
    import multiprocessing
    assert nvml.bounded(lambda a, b: a + b, 1, 2) == 3
    with pytest.raises(ZeroDivisionError):             # the reader's error, raised in the caller
        nvml.bounded(lambda: 1 / 0)
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(nvml.NvmlTimeout, match=r"^the GPU driver did not answer in 0\.5 s"):
        nvml.bounded(release.wait, 30, what="a test's reading")
    assert BOUND <= time.monotonic() - started < BOUND + 1
    try:
        started = time.monotonic()
        with pytest.raises(nvml.NvmlTimeout,
                           match=r"still has not: a test's reading, started \d+ s ago, has not returned"):
            nvml.bounded(lambda: 1)
        assert time.monotonic() - started < 0.1 and len(readers()) == 1
        # A forked worker has none of this process's threads: nothing is stuck there.
        parent, child = multiprocessing.get_context("fork").Pipe()
        proc = multiprocessing.get_context("fork").Process(target=_stuck_in_child, args=(child,))
        proc.start()
        assert parent.recv() is None
        proc.join(10)
    finally:
        release.set()
    assert wait_for(lambda: nvml.stuck_note() is None)
    assert nvml.bounded(lambda: "answered") == "answered"
