"""``%gpumem --reclaim``: real orphans are ended by pid and what NVML frees is reported; a live worker,
a kernel and another user's process are never signalled."""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytest

from gpumagic.devices import process_names
from gpumagic.memory.reclaim import reclaim
from tests.fake_nvml import LiveNvml, four_gpu_machine, installed
from tests.sharing_helpers import (
    alive,
    detached,
    live_worker,
    multiprocessing_orphan,
    orphan_worker,
    other_users_process,
)

GiB = 2**30


@pytest.fixture
def machine(monkeypatch):
    fake = LiveNvml(four_gpu_machine().gpus)
    yield from installed(fake, monkeypatch)



def test_reclaim_ends_the_orphans_only_and_reports_what_nvml_freed(machine, started, tmp_path):
    signals = tmp_path / "worker-signals.txt"
    worker = live_worker(started, tmp_path, rank=1, record_signals=signals)
    orphan, _ = orphan_worker(started, tmp_path, rank=0)
    spawned = multiprocessing_orphan(started, tmp_path)
    other, _ = other_users_process(started)
    cf = tmp_path / "kernel-5e1f0000.json"
    cf.write_text("{}")
    kernel = detached(started, [sys.executable, "-c", "import time; time.sleep(600)", "-f", str(cf)])
    machine.gpus[0]["processes"] = [(os.getpid(), 3 * GiB), (worker, GiB), (orphan, 5 * GiB), (other, 2 * GiB),
                                    (kernel, 4 * GiB)]
    machine.gpus[1]["processes"] = [(spawned, GiB)]
    before = {i: machine.nvmlDeviceGetMemoryInfo(machine.gpus[i]).used for i in (0, 1)}

    began = time.monotonic()
    report = reclaim()
    took = time.monotonic() - began

    assert took < 5.0
    assert {e.pid: e.outcome for e in report.ended} == {orphan: "ended by SIGTERM", spawned: "ended by SIGTERM"}
    assert {e.pid: e.held for e in report.ended} == {orphan: 5 * GiB, spawned: GiB}
    assert not alive(orphan) and not alive(spawned)
    # Nothing else was touched: the live worker got no SIGTERM, and every other process runs on.
    assert alive(worker) and alive(kernel) and alive(other)
    assert not signals.exists()
    assert report.before["cuda:0"] == before[0] and report.before["cuda:1"] == before[1]
    assert report.after["cuda:0"] == before[0] - 5 * GiB and report.after["cuda:1"] == before[1] - GiB
    assert report.freed == 6 * GiB
    assert report.text().startswith("Ended 2 of 2 orphan(s) in ")
    assert "the GPUs' used memory fell by 6.0 GiB" in report.text()
    assert report.as_dict()["freed"] == 6 * GiB and len(report.as_dict()["ended"]) == 2


def test_an_orphan_that_ignores_sigterm_is_killed_after_the_grace(machine, started, tmp_path):
    orphan, _ = orphan_worker(started, tmp_path, rank=2, ignore_term=True)
    machine.gpus[3]["processes"] = [(orphan, 7 * GiB)]
    began = time.monotonic()
    report = reclaim(grace=0.3)
    assert 0.3 <= time.monotonic() - began < 3.0
    assert [(e.pid, e.outcome) for e in report.ended] == [(orphan, "ended by SIGKILL")]
    assert not alive(orphan) and report.freed == 7 * GiB


def test_a_pid_that_is_another_process_by_the_time_it_would_be_signalled_is_left_alone(machine, started, tmp_path,
                                                                                          monkeypatch):
    orphan, _ = orphan_worker(started, tmp_path, rank=0)
    machine.gpus[0]["processes"] = [(orphan, GiB)]
    real = process_names.read_facts

    def named_earlier(pid):   # the process named had another start time: its pid was reused since
        facts = real(pid)
        return dataclasses.replace(facts, started=facts.started - 100) if facts and pid == orphan else facts
    monkeypatch.setattr(process_names, "read_facts", named_earlier)
    report = reclaim()
    assert [(e.pid, e.outcome) for e in report.ended] == [(orphan, "left alone: its pid now belongs to another "
                                                                   "process")]
    assert alive(orphan) and report.freed == 0


def test_with_no_orphan_nothing_is_signalled(machine, started, tmp_path):
    worker = live_worker(started, tmp_path, rank=0)
    machine.gpus[0]["processes"] = [(worker, GiB)]
    report = reclaim()
    assert report.ended == [] and alive(worker)
    assert report.text() == "No orphan holds GPU memory: nothing to end."
