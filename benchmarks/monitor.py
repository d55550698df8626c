"""What the memory gauges cost, and how much GPU memory watching memory creates.

Measures, per device:

* the cost of one gauge update in microseconds: NVML's memory query, NVML's
  process list, a full reading, a gauge update that changes the display, one
  that does not (nothing is sent), and one monitor tick (with its history);
* what the history line and the split by process add outside the ticks that
  only read memory: a utilisation reading (every 2.5 s), a redraw of the line
  (when it changes as drawn: about once a step of 5 s), naming who holds the
  GPUs (every 10 s), and all of it amortised over the ticks of a second;
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
from gpumagic.widgets.monitor import DEFAULT_INTERVAL

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
        mon = Monitor([target], split_every=0)
        tick = median_us(mon.tick, repeat)
        rows.append(["monitor tick (reading + gauge)", device, f"{tick:.1f} us"])
        rows += history_costs(mon, device, tick, repeat)
        mon.stop()
    return rows


def history_costs(mon, device: str, tick: float, repeat: int) -> list[list[str]]:
    """What the history adds beyond a tick's median: utilisation every 2.5 s, a redraw once a step."""
    from gpumagic.devices import utilization
    from gpumagic.widgets.history import History
    from gpumagic.widgets.sparkline import sparkline
    busy = median_us(utilization.reader(mon.targets[0]), max(repeat // 10, 20))
    history, t = History(), [0.0]

    def redraw():
        t[0] += history.step   # a new step each time: the line changes and is drawn again
        history.add(t[0], 0.5, 0.5)
        mon.gauges[device].show_history(sparkline(*history.series(t[0]), title="x"))
    drawn = median_us(redraw, max(repeat // 10, 20))
    per_tick = tick + (busy * DEFAULT_INTERVAL / utilization.EVERY) + drawn * DEFAULT_INTERVAL / history.step
    return [[f"utilisation reading (every {utilization.EVERY:g} s)", device, f"{busy:.1f} us"],
            ["history line redraw (when it changes: about once a 5 s step)", device, f"{drawn:.1f} us"],
            [f"monitor tick amortised at {1 / DEFAULT_INTERVAL:.0f} a second (with both)", device,
             f"{per_tick:.1f} us"]]


def split_cost(gpus, repeat: int) -> list[list[str]]:
    """Naming who holds the GPUs, as the gauges do every SPLIT_EVERY seconds (Jupyter answers cached)."""
    from gpumagic.devices.gpu_processes import who
    from gpumagic.widgets.monitor import SPLIT_EVERY, SPLIT_MAX_AGE
    if not gpus:
        return []
    named = median_us(lambda: who(gpus=gpus, max_age=SPLIT_MAX_AGE, in_thread=False), max(repeat // 100, 10))
    processes = sum(len(row.processes) for row in who(gpus=gpus, in_thread=False).devices)
    per_tick = named * DEFAULT_INTERVAL / SPLIT_EVERY / len(gpus)
    return [[f"who holds the GPUs ({processes} processes), every {SPLIT_EVERY:g} s", "all", f"{named / 1000:.2f} ms"],
            [f"... amortised per tick per GPU at {1 / DEFAULT_INTERVAL:.0f} a second", "all", f"{per_tick:.1f} us"]]


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
    rows += split_cost(gpus, args.repeat)
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
