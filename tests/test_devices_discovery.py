"""Device discovery against a stand-in NVML (matched by UUID), and device-name parsing."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from gpumagic import devices, session
from gpumagic.devices import nvml
from tests.fake_nvml import FakeNvml, four_gpu_machine, gpu, installed


def cuda_torch(monkeypatch):
    """torch as a CUDA build reports itself, so the fake GPUs are usable (this torch may be CPU-only)."""
    import torch
    if torch.version.cuda is None and torch.version.hip is None:
        monkeypatch.setattr(torch.version, "cuda", "12.8")


@pytest.fixture
def machine(monkeypatch):
    cuda_torch(monkeypatch)
    yield from installed(four_gpu_machine(), monkeypatch)
    session.set_picked_device(None)


def uuids(env=None):
    return [g.uuid for g in devices.visible_gpus(env)]


def test_all_gpus_in_pci_order_without_environment(machine):
    assert uuids({}) == ["GPU-aaaa1111", "GPU-bbbb2222", "GPU-cccc3333", "GPU-dddd4444"]
    assert [g.device for g in devices.visible_gpus({})] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_reordered_integer_visible_devices(machine):
    assert uuids({"CUDA_VISIBLE_DEVICES": "2,0"}) == ["GPU-cccc3333", "GPU-aaaa1111"]
    gpus = devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "3,1"})
    assert [(g.device, g.pci_bus_id, g.nvml_index) for g in gpus] == [
        ("cuda:0", "0000:ab:00.0", 3), ("cuda:1", "0000:2a:00.0", 1)]


def test_uuid_valued_visible_devices_and_prefixes(machine):
    assert uuids({"CUDA_VISIBLE_DEVICES": "GPU-dddd4444,GPU-bbbb"}) == ["GPU-dddd4444", "GPU-bbbb2222"]
    # An unknown UUID ends the list, as in the CUDA driver.
    assert uuids({"CUDA_VISIBLE_DEVICES": "1,GPU-ffff,0"}) == ["GPU-bbbb2222"]


def test_invalid_and_duplicate_entries(machine):
    assert uuids({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert uuids({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert uuids({"CUDA_VISIBLE_DEVICES": "1,7,2"}) == ["GPU-bbbb2222"]
    assert uuids({"CUDA_VISIBLE_DEVICES": "1,1"}) == []


def test_device_order_fastest_first_vs_pci_bus_id():
    fake = FakeNvml([
        gpu("GPU-old", "00000000:18:00.0", name="Tesla V100", cc=(7, 0), sms=80),
        gpu("GPU-new", "00000000:2A:00.0", name="NVIDIA H200", cc=(9, 0), sms=132),
    ])
    nvml.use(fake)
    try:
        assert uuids({}) == ["GPU-new", "GPU-old"]
        assert uuids({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) == ["GPU-old", "GPU-new"]
        # Integers index into the order CUDA_DEVICE_ORDER chose.
        assert uuids({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}) == ["GPU-new"]
        assert uuids({"CUDA_VISIBLE_DEVICES": "1"}) == ["GPU-old"]
    finally:
        nvml.use(None)


def test_mig_devices_by_id():
    migs = [dict(uuid="MIG-1111-a", name="H200 1g.18gb", handle=None), dict(uuid="MIG-1111-b", name="H200 3g.71gb")]
    fake = FakeNvml([gpu("GPU-aaaa", "00000000:18:00.0", migs=migs), gpu("GPU-bbbb", "00000000:2A:00.0")])
    nvml.use(fake)
    try:
        gpus = devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "MIG-1111-b,GPU-bbbb"})
        assert [(g.uuid, g.name, g.mig) for g in gpus] == [
            ("MIG-1111-b", "H200 3g.71gb", True), ("GPU-bbbb", "NVIDIA H200", False)]
        facts = devices.gpu_facts(gpus[0], gpus)
        assert facts["mig"] is True and facts["device"] == "cuda:0"
    finally:
        nvml.use(None)


def test_parse_device_accepts_every_form(machine):
    assert devices.parse_device("cpu") == "cpu"
    assert devices.parse_device("CUDA:2") == "cuda:2"
    assert devices.parse_device("3") == "cuda:3"
    assert devices.parse_device("cuda") == "cuda:0"
    assert devices.parse_device("meta") == "meta"
    session.set_picked_device("cuda:1")
    assert devices.parse_device("cuda") == "cuda:1"


@pytest.mark.parametrize("spec, words", [
    ("cuda:4", "out of range"), ("tpu", "unknown device"), ("cuda:x", "malformed"), ("mps", "not available"),
])
def test_parse_device_errors_name_the_choices(machine, spec, words):
    with pytest.raises(UsageError) as info:
        devices.parse_device(spec)
    message = str(info.value)
    assert words in message
    assert "cpu, cuda:0, cuda:1, cuda:2, cuda:3, meta" in message


def test_no_gpu_machine():
    # This machine: no NVML library, no GPU.
    nvml.use(None)
    if nvml.available():
        pytest.skip("NVML is present here")
    assert devices.visible_gpus() == []
    assert devices.default_device() == "cpu"
    with pytest.raises(UsageError, match="needs a GPU.*valid choices: cpu, meta"):
        devices.parse_device("cuda")
    with pytest.raises(UsageError, match="device 'GPU' needs a GPU"):   # the name the user wrote
        devices.parse_device("GPU")


def test_current_device_follows_the_pick(machine):
    import gpumagic
    assert str(gpumagic.current_device()) == "cuda:0"
    assert gpumagic.set_current_device(2) == "cuda:2"
    assert str(gpumagic.current_device()) == "cuda:2"
    with pytest.raises(UsageError):
        gpumagic.set_current_device("cuda:9")
    assert str(gpumagic.current_device()) == "cuda:2"


def test_discovery_never_initialises_cuda(machine):
    import torch
    devices.visible_gpus()
    [devices.gpu_facts(g) for g in devices.visible_gpus()]
    assert not torch.cuda.is_initialized()
