"""%gpumem on a real GPU machine (pytest -m gpu).

The "monitoring creates nothing" check runs in a fresh process, so that
"CUDA was never initialised" means something; the others initialise CUDA here.
NVML may list processes by pids of another pid namespace (containers), so
checks that depend on pids also hold when the pids do not match ours.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from gpumagic import devices
from gpumagic.devices import memory
from gpumagic.display import fmt_bytes
from gpumagic.memory import variables
from tests.conftest import run_cell, wait_for

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
MiB = 2**20


def python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object last."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])



def test_gpumem_and_gauges_create_no_cuda_context():
    out = python("""
import json, os, threading, time
import torch
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
shell = InteractiveShell.instance()
shell.kernel = object()   # as in a Jupyter kernel: --watch shows gauges
shell.run_line_magic("load_ext", "gpumagic")
from gpumagic import devices
from gpumagic.devices import nvml
from gpumagic.widgets import monitor
nv = nvml.lib()
gpus = devices.visible_gpus()

def listing():
    seen = {}
    for g in gpus:
        procs = list(nv.nvmlDeviceGetComputeRunningProcesses(g.handle))
        try:
            procs += list(nv.nvmlDeviceGetGraphicsRunningProcesses(g.handle))
        except Exception:
            pass
        seen[g.device] = {"pids": sorted({p.pid for p in procs}),
                          "used": nv.nvmlDeviceGetMemoryInfo(g.handle).used,
                          "total": nv.nvmlDeviceGetMemoryInfo(g.handle).total}
    return seen

before = listing()
shell.user_ns["t"] = torch.ones(1000)
with capture_output(display=True):
    shell.run_line_magic("gpumem", "")
    shell.run_line_magic("gpumem", "--vars")
    shell.run_line_magic("gpumem", "--watch --interval 0.05")
mon = monitor.current()
time.sleep(4)
during = listing()
gauges = {d: [g.used, g.total, g.caption] for d, g in mon.gauges.items()}
threads = sum(t.name == monitor.THREAD_NAME for t in threading.enumerate())
ticks = mon.ticks
with capture_output():
    shell.run_line_magic("gpumem", "--stop")
print(json.dumps({"pid": os.getpid(), "initialised": torch.cuda.is_initialized(), "before": before,
                  "during": during, "gauges": gauges, "threads": threads, "ticks": ticks,
                  "errors": mon.errors,
                  "left": sum(t.name == monitor.THREAD_NAME for t in threading.enumerate())}))
""")
    assert out["initialised"] is False
    assert out["threads"] == 1 and out["left"] == 0
    assert out["ticks"] >= 20 and out["errors"] == []
    assert set(out["gauges"]) >= {"cpu", "cuda:0"}
    for device, seen in out["during"].items():
        # Not listed by our pid, and (pid namespaces) no new process and no context-sized growth.
        assert out["pid"] not in seen["pids"]
        assert set(seen["pids"]) <= set(out["before"][device]["pids"])
        assert seen["used"] - out["before"][device]["used"] < 200 * MiB
        used, total, caption = out["gauges"][device]
        assert total == seen["total"] and 0 < used <= total
        assert "torch" not in caption  # no allocator figures: CUDA was never initialised


@pytest.fixture
def cuda0():
    import torch
    torch.zeros(1, device="cuda:0")   # this test initialises CUDA itself
    torch.cuda.synchronize()
    torch.cuda.empty_cache()          # so new tensors need new device memory
    yield torch
    torch.cuda.empty_cache()


def test_vars_sees_tensors_on_cuda0_with_exact_bytes(shell, cuda0):
    result, _, _ = run_cell(shell, """import torch
x = torch.empty(1000, 1000, device="cuda:0")
head = torch.nn.Linear(256, 256).to("cuda:0")
head(torch.randn(8, 256, device="cuda:0")).sum().backward()
on_cpu = torch.ones(10)""")
    assert result.success
    rep = variables.variable_memory(shell.user_ns, hidden=shell.user_ns_hidden)
    params = (256 * 256 + 256) * 4
    assert rep["x", "cuda:0"].nbytes == 4_000_000
    assert rep["head", "cuda:0"].parts == {"params": params, "grads": params}
    assert rep["on_cpu", "cpu"].nbytes == 40
    assert rep.totals["cuda:0"] == 4_000_000 + 2 * params
    result, out, _ = run_cell(shell, "%gpumem --vars cuda:0")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["x"][1:5] == ["Tensor", "cuda:0", "3.8", "MiB"]
    assert "head" in rows and "on_cpu" not in rows


def test_snapshot_adds_torch_figures_once_cuda_is_initialised(cuda0):
    torch = cuda0
    keep = torch.empty(64 * MiB // 4, device="cuda:0")
    snap = memory.snapshot("cuda:0")
    row = snap["cuda:0"]
    assert row.allocated == torch.cuda.memory_allocated(0) >= 64 * MiB
    assert row.reserved == torch.cuda.memory_reserved(0)
    assert row.peak == torch.cuda.max_memory_allocated(0)
    free, total = torch.cuda.mem_get_info(0)
    assert row.total >= total > 0.9 * row.total
    if row.process is not None:      # this process is listed under its own pid
        assert row.process >= row.reserved
    else:                            # a container's pid namespace hides it
        assert row.process_note == "pid namespace"
    del keep


def test_gauge_moves_when_a_tensor_is_allocated(cuda0):
    torch = cuda0
    from gpumagic.widgets import monitor
    mon = monitor.start([devices.visible_gpus()[0]], interval=0.05)
    try:
        gauge = mon.gauges["cuda:0"]
        time.sleep(0.3)
        base = gauge.used
        big = torch.ones(GiB // 4, device="cuda:0")   # 1 GiB of float32
        torch.cuda.synchronize()
        assert wait_for(lambda: gauge.used - base >= 0.95 * GiB), (base, gauge.used)
        allocated = torch.cuda.memory_allocated(0)
        assert allocated >= GiB
        assert wait_for(lambda: f"torch {fmt_bytes(allocated)} alloc" in gauge.caption), gauge.caption
        assert gauge.bar.value >= round(base / gauge.total, 3)
        peak = gauge.used
        del big
        torch.cuda.empty_cache()
        assert wait_for(lambda: peak - gauge.used >= 0.95 * GiB), (peak, gauge.used)
    finally:
        monitor.stop()
    assert monitor.current() is None and not mon.running


def test_a_kept_loss_on_the_gpu_holds_its_activations(shell, cuda0):
    from tests.test_magics_gpumem_autograd import ACTIVATIONS, BATCH, F32, IN, PARAMS, SAVED_BY_TORCH, TRAINING_CELL, B
    on_gpu = TRAINING_CELL.replace(f"x = torch.randn({B}, {IN})",
                                   f"model.to('cuda:0')\nx = torch.randn({B}, {IN}, device='cuda:0')")
    assert on_gpu != TRAINING_CELL
    result, _, _ = run_cell(shell, on_gpu + SAVED_BY_TORCH)
    assert result.success, result.error_in_exec
    assert shell.user_ns["saved_by_torch"] == ACTIVATIONS   # CUDA's forward saves what the CPU's does
    held = shell.run_line_magic("gpumem", "--vars --json")
    rows = {v["name"]: v for v in held["variables"]}
    assert rows["loss"]["parts"] == {"tensors": F32, "autograd": ACTIVATIONS}
    assert held["totals"] == {"cuda:0": F32 + ACTIVATIONS + PARAMS + BATCH}
    run_cell(shell, "del loss\nimport gc; gc.collect()")
    assert all(ref.expired() for ref in shell.user_ns["_kept"])
