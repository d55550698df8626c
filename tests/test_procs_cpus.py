"""How many workers this machine can take (gpumagic.procs.cpus): refused above it, warned above the cores."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from gpumagic.procs import cpus


def test_the_limit_follows_cores_and_memory(monkeypatch):
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 2)
    assert cpus.process_limit() <= 2 * cpus.PER_CORE
    import psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 3 * cpus.WORKER_MEMORY})())
    assert cpus.process_limit() == 3                               # memory for three workers only
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 0})())
    assert cpus.process_limit() == 1                               # always room for one


def test_counts_above_the_limit_are_refused_unless_asked_for(monkeypatch):
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 2)
    monkeypatch.setattr(cpus, "process_limit", lambda: 8)
    assert cpus.check_process_count(2) is None
    assert "Warning: 3 processes on 2 CPU core(s)" in cpus.check_process_count(3)
    with pytest.raises(UsageError) as err:
        cpus.check_process_count(100_000)
    assert "room for 8 worker processes" in str(err.value)
    assert "valid choices: --nprocs 8, --nprocs 100000 --oversubscribe" in str(err.value)
    assert "Warning: 9 processes" in cpus.check_process_count(9, oversubscribe=True)
