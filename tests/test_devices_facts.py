"""The facts %gpuinfo shows per GPU, against a stand-in NVML: unsupported fields, NVLink peers."""
from __future__ import annotations

import pytest

from gpumagic import devices
from gpumagic.devices import nvml
from gpumagic.devices.facts import device_report
from gpumagic.magics.info import render_report
from tests.fake_nvml import fabric_machine, four_gpu_machine, installed
from tests.test_devices_memory import pretend_cuda_initialised_with_failing_allocator


@pytest.fixture
def machine(monkeypatch):
    yield from installed(four_gpu_machine(), monkeypatch)


def test_facts_are_matched_by_uuid_and_unsupported_fields_are_none(machine):
    gpus = devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "3,1,0"})
    facts = [devices.gpu_facts(g, gpus) for g in gpus]
    # cuda:1 is NVML's device 1: 5 GiB used.
    assert facts[1]["uuid"] == "GPU-bbbb2222" and facts[1]["memory_used"] == 5 * 2**30
    assert facts[1]["memory_free"] == 136 * 2**30
    assert facts[1]["compute_capability"] == "9.0" and facts[1]["multiprocessors"] == 132
    assert facts[1]["power_w"] == 123.0 and facts[1]["pcie_generation"] == 5
    # NVLink peers are named by torch index where the peer is visible, else by bus id.
    assert facts[1]["nvlink_peers"] == {"cuda:2": 2}
    # cuda:0 (NVML 3) supports nothing beyond memory: n/a, no exception.
    assert facts[0]["temperature_c"] is None and facts[0]["utilization_gpu"] is None
    assert facts[0]["nvlink_peers"] is None and facts[0]["memory_total"] == 141 * 2**30


def test_fabric_links_and_multiprocessors_from_core_count():
    nvml.use(fabric_machine())
    try:
        gpus = devices.visible_gpus({})
        facts = devices.gpu_facts(gpus[0], gpus)
        assert facts["nvlink_peers"] == {"cuda:1": 3}
        assert facts["multiprocessors"] == 132  # 16896 cores / 128 per SM on compute capability 9.0
    finally:
        nvml.use(None)


def test_allocator_rows_only_once_cuda_is_initialised(machine, no_cuda_init):
    report = device_report()
    assert all("torch_allocated" not in d for d in report["devices"])
    assert "torch allocated" not in render_report(report).text


def test_a_failing_allocator_query_leaves_the_report_whole(machine, monkeypatch):
    # A query of torch's caching allocator that raises (a CUDA error left behind by a crashed kernel)
    # costs its three figures, not %gpuinfo.
    lazy_inits = pretend_cuda_initialised_with_failing_allocator(monkeypatch)
    report = device_report()
    gpus = [d for d in report["devices"] if d["device"].startswith("cuda:")]
    assert len(gpus) == 4 and report["system"]["cuda_initialized"]
    for facts in gpus:
        assert (facts["torch_allocated"], facts["torch_reserved"], facts["torch_peak"]) == (None, None, None)
        assert facts["memory_total"] == 141 * 2**30
    text = render_report(report).text
    assert "torch allocated" in text and "n/a" in text
    assert lazy_inits == []


def test_an_unprimed_cpu_reading_waits_for_a_window_then_is_reused(monkeypatch):
    # Without a window (no %load_ext before: device_report() from Python), the reading waits the 0.1 s a
    # meaningful one needs instead of reading 0 over no time; asked again at once, it is given again.
    import time

    from gpumagic.devices import facts
    monkeypatch.setattr(facts, "_cpu_base", None)
    monkeypatch.setattr(facts, "_cpu_last", None)
    started = time.monotonic()
    first = facts.cpu_facts()
    took = time.monotonic() - started
    assert 0.1 <= took < 0.5 and 0.1 <= first["utilization_cpu_seconds"] < 0.5
    assert 0.0 <= first["utilization_cpu"] <= 100.0
    started = time.monotonic()
    again = facts.cpu_facts()
    assert time.monotonic() - started < 0.1
    assert (again["utilization_cpu"], again["utilization_cpu_seconds"]) == \
        (first["utilization_cpu"], first["utilization_cpu_seconds"])


def test_cpu_busy_share_is_busy_time_over_all_time():
    from collections import namedtuple

    from gpumagic.devices import facts
    times = namedtuple("scputimes", "user nice system idle iowait irq softirq steal guest guest_nice")
    before = times(100.0, 0.0, 20.0, 300.0, 5.0, 0.0, 1.0, 0.0, 7.0, 0.0)
    after = times(130.0, 0.0, 30.0, 350.0, 10.0, 0.0, 1.0, 0.0, 9.0, 0.0)   # guest is inside user already
    (busy0, total0), (busy1, total1) = facts._busy_and_total(before), facts._busy_and_total(after)
    assert (busy1 - busy0, total1 - total0) == (40.0, 95.0)   # user+system busy; idle+iowait not
