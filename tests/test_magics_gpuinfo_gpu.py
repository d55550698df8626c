"""%gpuinfo on a real GPU machine (pytest -m gpu). Each check runs in a fresh
Python process, so that "CUDA was never initialised" means something."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(code: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object last."""
    full_env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SHELL = """
import json, os
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "gpumagic")
"""


def test_table_matches_torch_and_nvml_without_initialising_cuda():
    out = python(SHELL + """
import torch, pynvml
report = shell.run_line_magic("gpuinfo", "--json")
shell.run_line_magic("gpuinfo", "")
before = torch.cuda.is_initialized()
pynvml.nvmlInit()
mine = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    mine += [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()]
gpus = [d for d in report["devices"] if d["device"].startswith("cuda:")]
# Only now touch CUDA, to compare with torch's own view.
torch_view = [{"uuid": str(torch.cuda.get_device_properties(i).uuid), "name": torch.cuda.get_device_properties(i).name,
               "sms": torch.cuda.get_device_properties(i).multi_processor_count,
               "total": torch.cuda.get_device_properties(i).total_memory,
               "cc": "%d.%d" % torch.cuda.get_device_capability(i)} for i in range(torch.cuda.device_count())]
print(json.dumps({"gpus": gpus, "torch": torch_view, "initialised_before": before, "my_processes": mine,
                  "driver": report["system"]["driver_version"]}))
""")
    assert out["initialised_before"] is False
    assert out["my_processes"] == []
    assert len(out["gpus"]) == len(out["torch"]) >= 1
    for ours, theirs in zip(out["gpus"], out["torch"]):
        assert ours["uuid"].lower().removeprefix("gpu-") == theirs["uuid"].lower()
        assert ours["name"] == theirs["name"]
        assert ours["compute_capability"] == theirs["cc"]
        assert ours["memory_total"] >= theirs["total"]
        if ours["multiprocessors"] is not None:
            assert ours["multiprocessors"] == theirs["sms"]
        assert ours["temperature_c"] is not None and ours["power_w"] is not None
    assert out["driver"]


@pytest.mark.gpu2
def test_reordered_visible_devices_map_by_uuid():
    code = SHELL + """
import torch
report = shell.run_line_magic("gpuinfo", "--json")
ours = [d["uuid"].lower().removeprefix("gpu-") for d in report["devices"] if d["device"].startswith("cuda:")]
theirs = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
print(json.dumps({"ours": ours, "theirs": theirs}))
"""
    plain = python(code)
    swapped = python(code, {"CUDA_VISIBLE_DEVICES": "1,0"})
    assert plain["ours"] == plain["theirs"]
    assert swapped["ours"] == swapped["theirs"] == plain["theirs"][:2][::-1]
    uuid_env = python(code, {"CUDA_VISIBLE_DEVICES": "GPU-" + plain["theirs"][1]})
    assert uuid_env["ours"] == uuid_env["theirs"] == [plain["theirs"][1]]


def test_pycuda_all_attributes_and_kernel_stays_fork_safe():
    pytest.importorskip("pycuda")
    out = python(SHELL + """
import torch, sys
report = shell.run_line_magic("gpuinfo", "--all --json")
attrs = report["devices"][1]["attributes"]
initialised = torch.cuda.is_initialized()
cuda_driver_loaded = any("pycuda._driver" in m for m in sys.modules)
pid = os.fork()
if pid == 0:
    # A forked child can still use CUDA: the kernel never called cuInit.
    x = torch.ones(1024, device="cuda:0")
    os._exit(0 if float(x.sum()) == 1024.0 else 3)
_, status = os.waitpid(pid, 0)
print(json.dumps({"n": len(attrs), "sample": {k: attrs[k] for k in list(attrs)[:3]},
                  "initialised": initialised, "driver_loaded": cuda_driver_loaded,
                  "child_status": os.waitstatus_to_exitcode(status),
                  "mp": attrs.get("MULTIPROCESSOR_COUNT")}))
""")
    assert out["n"] >= 80
    assert out["initialised"] is False and out["driver_loaded"] is False
    assert out["child_status"] == 0
    assert out["mp"] and int(out["mp"]) > 0
