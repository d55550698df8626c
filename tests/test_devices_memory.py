"""Memory snapshots per device, as plain functions, against a stand-in NVML."""
from __future__ import annotations

import os

import psutil
import pytest

from gpumagic.devices import memory, nvml
from tests.fake_nvml import FakeNvml, GiB, busy_four_gpu_machine, installed

MiB = 2**20


@pytest.fixture
def machine(monkeypatch):
    yield from installed(busy_four_gpu_machine(), monkeypatch)


def test_cpu_snapshot_matches_psutil():
    row = memory.snapshot("cpu", gpus=[])["cpu"]
    vm = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    assert row.total == vm.total
    assert abs(row.used - (vm.total - vm.available)) < 256 * MiB
    assert abs(row.process - rss) < 64 * MiB
    assert row.free == row.total - row.used
    assert row.allocated is None and row.reserved is None


def test_gpu_snapshot_reads_nvml_and_this_kernels_share(machine, no_cuda_init):
    snap = memory.snapshot()
    assert [r.device for r in snap.rows][:5] == ["cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    one = snap["cuda:1"]
    assert (one.used, one.total) == (5 * GiB, 141 * GiB)
    assert one.process == 3 * GiB and one.process_note is None
    # Listed processes are all other live ones: this kernel holds nothing there.
    assert snap["cuda:2"].process == 0
    assert snap["cuda:0"].process == 0
    # A pid that exists nowhere here: NVML speaks another pid namespace.
    assert snap["cuda:3"].process is None and snap["cuda:3"].process_note == "pid namespace"
    assert all(r.allocated is None for r in snap.rows)  # CUDA not initialised
    text = snap.text()
    assert "3.0 GiB" in text and "n/a (pid namespace)" in text
    assert "never initialises" in text


def test_compute_and_graphics_lists_do_not_double_count(machine):
    fake = machine
    fake.nvmlDeviceGetGraphicsRunningProcesses = lambda h: fake.nvmlDeviceGetComputeRunningProcesses(h)
    h = fake.gpus[1]
    assert memory.gpu_process_memory(h) == (3 * GiB, None)
    assert memory.gpu_process_memory(h, pid=os.getppid()) == (GiB, None)


def test_unreported_process_memory_is_na(machine):
    machine.gpus[0]["processes"] = [(os.getpid(), None)]
    assert memory.gpu_process_memory(machine.gpus[0]) == (None, "not reported")

    def unsupported(h):
        raise machine.NVMLError("not supported")
    machine.nvmlDeviceGetComputeRunningProcesses = unsupported
    assert memory.gpu_process_memory(machine.gpus[0]) == (None, "not reported")


def test_one_device_snapshot_and_no_nvml(machine):
    snap = memory.snapshot("cuda:0")
    assert [r.device for r in snap.rows] == ["cuda:0"]
    assert snap["cuda:0"].used == GiB
    nvml.use(FakeNvml([]))
    snap = memory.snapshot()
    assert [r.device for r in snap.rows] == ["cpu"]
    assert any("no GPU visible" in n for n in snap.notes)
