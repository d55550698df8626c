"""A stand-in NVML that behaves like a machine with several GPUs.

``gpumagic.devices.nvml.use(FakeNvml(...))`` makes every gpumagic query read it.
It is small on purpose: the functions gpumagic calls, with NVML's shapes
(``busId``, ``total``/``used``/``free``, ``NVMLError`` for unsupported fields).
"""
from __future__ import annotations

from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


def gpu(uuid, bus_id, name="NVIDIA H200", cc=(9, 0), total=141 * 2**30, used=2**30, sms=132,
        nvlinks=(), migs=(), processes=(), supported=True):
    """One fake GPU; ``nvlinks`` is a list of remote bus ids, ``processes`` (pid, bytes)."""
    return dict(uuid=uuid, bus_id=bus_id, name=name, cc=cc, total=total, used=used, sms=sms,
                nvlinks=list(nvlinks), migs=list(migs), processes=list(processes), supported=supported,
                mig=bool(migs))


class FakeNvml:
    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_NVLINK_MAX_LINKS = 4
    NVML_FEATURE_ENABLED = 1

    def __init__(self, gpus):
        self.gpus = gpus
        self.calls = 0
        self.initialised = False

    # --- system
    def nvmlInit(self):
        self.initialised = True

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlSystemGetCudaDriverVersion(self):
        return 13000

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        self.calls += 1
        return self.gpus[i]

    # --- identity
    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetName(self, h):
        return h["name"].encode()  # old bindings return bytes

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=h["bus_id"])

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return h["cc"]

    def nvmlDeviceGetAttributes(self, h):
        if h["sms"] is None:  # full GPUs: NVML answers for MIG devices only
            raise NVMLError_NotSupported()
        return SimpleNamespace(multiprocessorCount=h["sms"])

    def nvmlDeviceGetMigMode(self, h):
        if "migs" not in h:
            raise NVMLError_NotSupported()
        return (1, 1) if h["mig"] else (0, 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return len(h["migs"])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        return h["migs"][i]

    # --- state
    def _need(self, h):
        self.calls += 1
        if not h.get("supported", True):
            raise NVMLError_NotSupported()

    def nvmlDeviceGetMemoryInfo(self, h):
        self.calls += 1
        return SimpleNamespace(total=h["total"], used=h["used"], free=h["total"] - h["used"])

    def nvmlDeviceGetUtilizationRates(self, h):
        self._need(h)
        return SimpleNamespace(gpu=37, memory=12)

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._need(h)
        return 41

    def nvmlDeviceGetPowerUsage(self, h):
        self._need(h)
        return 123_000

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        self._need(h)
        return 700_000

    def nvmlDeviceGetClockInfo(self, h, clock):
        self._need(h)
        return 1980 if clock == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        self._need(h)
        return 1980 if clock == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        self._need(h)
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        self._need(h)
        return 16

    def nvmlDeviceGetNvLinkState(self, h, link):
        self._need(h)
        return 1 if link < len(h["nvlinks"]) else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=h["nvlinks"][link])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self.calls += 1
        return [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in h["processes"]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return []


class LiveNvml(FakeNvml):
    """The fake NVML, listing only the processes still running,
    and counting their memory in the GPU's used memory (``used`` is the rest: the driver's), as NVML does."""

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self.calls += 1
        return [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in h["processes"] if _running(pid)]

    def nvmlDeviceGetMemoryInfo(self, h):
        self.calls += 1
        used = h["used"] + sum(b for pid, b in h["processes"] if _running(pid))
        return SimpleNamespace(total=h["total"], used=used, free=h["total"] - used)


def _running(pid: int) -> bool:
    """Alive and not a zombie: a dead process (reaped or not) holds no GPU memory."""
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def four_gpu_machine():
    """Four GPUs whose NVML (PCI) order differs from their UUID order, linked in pairs."""
    return FakeNvml([
        gpu("GPU-aaaa1111", "00000000:18:00.0", nvlinks=["00000000:2A:00.0"] * 2),
        gpu("GPU-bbbb2222", "00000000:2A:00.0", nvlinks=["00000000:18:00.0"] * 2, used=5 * 2**30),
        gpu("GPU-cccc3333", "00000000:9C:00.0", nvlinks=["00000000:AB:00.0"] * 2),
        gpu("GPU-dddd4444", "00000000:AB:00.0", nvlinks=["00000000:9C:00.0"] * 2, supported=False),
    ])


def fabric_machine():
    """Two GPUs on an NVLink fabric whose far ends NVML cannot name (as in VMs and NVSwitch)."""
    fake = FakeNvml([
        gpu("GPU-aaaa", "00000000:00:06.0", nvlinks=["ffffffff:ff:ff.0"] * 3, sms=None),
        gpu("GPU-bbbb", "00000000:00:07.0", nvlinks=["ffffffff:ff:ff.0"] * 3, sms=None),
    ])
    fake.NVML_P2P_CAPS_INDEX_NVLINK = 3
    fake.NVML_P2P_STATUS_OK = 0
    fake.nvmlDeviceGetP2PStatus = lambda a, b, index: 0 if index == 3 else 5
    fake.nvmlDeviceGetNumGpuCores = lambda h: 16896
    return fake


GiB = 2**30
NO_SUCH_PID = 4_194_400  # above Linux's largest pid_max, so no process has it


def busy_four_gpu_machine() -> FakeNvml:
    """Four fake GPUs; cuda:1 runs this process (3 GiB) and another live one."""
    import os
    fake = four_gpu_machine()
    fake.gpus[1]["processes"] = [(os.getpid(), 3 * GiB), (os.getppid(), GiB)]
    fake.gpus[2]["processes"] = [(os.getppid(), 2 * GiB)]
    fake.gpus[3]["processes"] = [(NO_SUCH_PID, GiB)]
    return fake


def installed(fake, monkeypatch):
    """Make every gpumagic query read ``fake``, numbered as without CUDA_VISIBLE_DEVICES (a generator
    for a fixture: ``yield from installed(fake, monkeypatch)``)."""
    from gpumagic.devices import nvml
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    nvml.use(fake)
    yield fake
    nvml.use(None)
