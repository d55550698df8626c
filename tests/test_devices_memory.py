"""Memory snapshots per device, as plain functions, against a stand-in NVML."""
from __future__ import annotations

import os
from types import SimpleNamespace

import psutil
import pytest

from gpumagic.devices import discovery, memory, nvml
from tests.fake_nvml import FakeNvml, GiB, busy_four_gpu_machine, installed

MiB = 2**20


def pretend_cuda_initialised_with_failing_allocator(monkeypatch) -> list:
    """Make torch look as if this process initialised CUDA on the stand-in NVML's GPUs, with a caching
    allocator whose every query raises; returns the calls to ``torch.cuda._lazy_init`` (none may come)."""
    import torch
    gpus = discovery.visible_gpus()
    props = [SimpleNamespace(uuid=g.uuid.removeprefix("GPU-"), name=g.name, multi_processor_count=132) for g in gpus]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    lazy_inits: list = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda *a, **k: lazy_inits.append(a))

    def broken(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, broken)
    return lazy_inits


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


def test_a_failing_allocator_query_gives_none(machine, monkeypatch):
    lazy_inits = pretend_cuda_initialised_with_failing_allocator(monkeypatch)
    snap = memory.snapshot()
    gpu_rows = [r for r in snap.rows if r.device.startswith("cuda:")]
    assert len(gpu_rows) == 4 and snap["cuda:1"].used == 5 * GiB
    assert all((r.allocated, r.reserved, r.peak) == (None, None, None) for r in gpu_rows)
    assert memory.torch_allocator(0) == (None, None, None)
    assert lazy_inits == []


def test_allocator_figures_only_once_cuda_is_initialised(monkeypatch):
    import torch
    asked: list = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: asked.append(i) or 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert memory.torch_allocator(0) == (None, None, None) and asked == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 2)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i: 3)
    assert memory.torch_allocator(0) == (1, 2, 3) and asked == [0]


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
