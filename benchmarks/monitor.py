"""What the memory gauges cost, and how much GPU memory watching memory creates.

Measures, per device:

* the cost of one gauge update in microseconds: NVML's memory query, NVML's
  process list, a full reading, a gauge update that changes the display, one
  that does not (nothing is sent), and one monitor tick;
* the GPU memory created by ``--seconds`` of monitoring at the default rate
  (target: 0 bytes; NVML used before/after, and whether NVML lists this
  process), against ``torch.cuda.mem_get_info`` in a fresh subprocess, which
  makes a CUDA context (about 550 MB on an H200).

Prints a table and appends it to ``benchmarks/RESULTS.md`` with the date,
the machine and the command. Run from the repository root::

    python benchmarks/monitor.py                 # about a minute of monitoring
    python benchmarks/monitor.py --seconds 20 --no-record

Gauge updates are timed without a Jupyter kernel attached, so they count the
widget work (trait changes, state serialisation) but not the kernel's socket send.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

from _common import ROOT, append_results, command, machine  # also puts the checkout on sys.path

from gpumagic import devices
from gpumagic.devices import memory, nvml
from gpumagic.display import fmt_bytes, text_table

GiB = 2**30


def median_us(fn, repeat: int) -> float:
    fn()  # warm up (imports, first NVML call)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000


def update_costs(targets: list, repeat: int) -> list[list[str]]:
    from gpumagic.widgets.gauge import MemoryGauge
    from gpumagic.widgets.monitor import Monitor
    rows = []
    for target in targets:
        device = target if isinstance(target, str) else target.device
        if not isinstance(target, str):
            nv = nvml.lib()
            rows.append(["NVML memory query", device,
                         f"{median_us(lambda: nv.nvmlDeviceGetMemoryInfo(target.handle), repeat):.1f} us"])
            rows.append(["NVML process list (this kernel's share)", device,
                         f"{median_us(lambda: memory.gpu_process_memory(target.handle), repeat):.1f} us"])
        rows.append(["full reading", device, f"{median_us(lambda: memory.device_memory(target), repeat):.1f} us"])
        gauge = MemoryGauge(device)
        flip = [0]

        def changed():
            flip[0] ^= 1
            gauge.show((10 + 30 * flip[0]) * GiB, 100 * GiB, "kernel 1.0 GiB")

        rows.append(["gauge update, display changed", device, f"{median_us(changed, repeat):.1f} us"])
        rows.append(["gauge update, unchanged (nothing sent)", device,
                     f"{median_us(lambda: gauge.show(10 * GiB, 100 * GiB, 'kernel 1.0 GiB'), repeat):.1f} us"])
        gauge.close()
        mon = Monitor([target])
        rows.append(["monitor tick (reading + gauge)", device, f"{median_us(mon.tick, repeat):.1f} us"])
        mon.stop()
    return rows


def nvml_view(gpus) -> dict:
    if not gpus:
        return {}
    nv = nvml.lib()
    view = {}
    for g in gpus:
        pids = set()
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                pids |= {p.pid for p in getattr(nv, fn)(g.handle)}
            except Exception:
                pass
        view[g.device] = {"used": nv.nvmlDeviceGetMemoryInfo(g.handle).used, "pids": pids}
    return view


def monitoring_footprint(gpus, seconds: float) -> list[list[str]]:
    """Monitor every device for ``seconds`` at the default rate; what did it create?"""
    import psutil
    import torch  # imported as in a notebook; the monitor must not initialise it

    from gpumagic.widgets import monitor
    before = nvml_view(gpus)
    cpu0 = psutil.Process().cpu_times()
    t0 = time.monotonic()
    mon = monitor.start(["cpu", *gpus])
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    ticks, sends = mon.ticks, sum(g.sends for g in mon.gauges.values())
    after = nvml_view(gpus)
    monitor.stop()
    cpu1 = psutil.Process().cpu_times()
    busy = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / elapsed
    rows = [
        ["monitoring time", "all", f"{elapsed:.0f} s, interval {mon.interval} s"],
        ["monitor ticks / gauge updates sent", "all", f"{ticks} / {sends} over {len(mon.gauges)} gauges"],
        ["kernel CPU while monitoring", "all", f"{100 * busy:.2f} % of one core"],
        ["torch.cuda.is_initialized() after", "all", str(torch.cuda.is_initialized())],
    ]
    pid = os.getpid()
    for g in gpus:
        created = after[g.device]["used"] - before[g.device]["used"]
        new_pids = after[g.device]["pids"] - before[g.device]["pids"]
        rows.append(["GPU memory created by monitoring (NVML used after - before)", g.device, fmt_bytes(created)])
        rows.append(["processes NVML lists that monitoring added", g.device,
                     f"{len(new_pids)} (this pid listed: {'yes' if pid in after[g.device]['pids'] else 'no'})"])
    return rows


TORCH_QUERY = """
import json, os, sys, time
sys.path.insert(0, {root!r})
import torch
from gpumagic import devices
from gpumagic.devices import memory, nvml
gpu = devices.visible_gpus()[{index}]
nv = nvml.lib()
before = nv.nvmlDeviceGetMemoryInfo(gpu.handle).used
t0 = time.perf_counter()
torch.cuda.mem_get_info({index})
took = time.perf_counter() - t0
after = nv.nvmlDeviceGetMemoryInfo(gpu.handle).used
own, note = memory.gpu_process_memory(gpu.handle)
print(json.dumps({{"created": after - before, "seconds": took, "own": own, "note": note}}))
"""


def torch_query_footprint(index: int) -> dict:
    code = textwrap.dedent(TORCH_QUERY.format(root=ROOT, index=index))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to monitor (default 60)")
    parser.add_argument("--repeat", type=int, default=2000, help="timed calls per cost (median reported)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args(argv)

    gpus = devices.visible_gpus()
    header = ["measurement", "device", "value"]
    rows = update_costs(["cpu", *gpus], args.repeat)
    rows += monitoring_footprint(gpus, args.seconds)
    for g in gpus:
        try:
            q = torch_query_footprint(g.index)
        except Exception as exc:
            rows.append(["torch.cuda.mem_get_info in a fresh process", g.device, f"failed: {exc}"])
            continue
        own = fmt_bytes(q["own"]) if q["own"] is not None else f"n/a ({q['note']})"
        rows.append(["torch.cuda.mem_get_info in a fresh process: GPU memory created", g.device,
                     f"{fmt_bytes(q['created'])} (process share {own}), {q['seconds']:.2f} s"])
    if not gpus:
        rows.append(["GPU memory created by monitoring", "-", f"n/a: {nvml.unavailable_reason() or 'no GPU'}"])

    print(text_table(rows, header))
    if not args.no_record:
        append_results("monitor.py", [f"- machine: {machine(gpus)}", f"- command: `{command('monitor.py', argv)}`"],
                       [(header, rows)])


if __name__ == "__main__":
    main()
