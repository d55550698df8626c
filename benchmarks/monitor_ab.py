"""A/B on one machine: what one memory-gauge tick costs per device, this checkout against another.

Each round runs a fresh Python per variant (the other checkout's ``gpumagic`` first on the path, or
this one's). It builds the gauges' monitor for one device and times its tick two ways: the median
of ``--repeat`` ticks back to back (what ``benchmarks/monitor.py`` reports), and the mean of the
ticks of ``--seconds`` at the gauges' own rate (4 a second), which also counts what runs every few
seconds (utilisation readings, history redraws). With ``--fake-nvml`` (the default
on a machine without a GPU) the GPU is ``tests/fake_nvml.py``'s: what is timed is then gpumagic's
own work per GPU, without the driver's calls. Compare on one machine::

    git archive <commit> gpumagic | tar -x -C /tmp/before     # or: git worktree add /tmp/before <commit>
    python benchmarks/monitor_ab.py --old /tmp/before
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(variant: str, device: str, fake: bool, repeat: int, seconds: float) -> None:
    """In a fresh process: time the tick of a monitor of ``device``; prints RESULT <json>."""
    sys.path.insert(0, variant)
    # An editable install of gpumagic would win over the path: leave its finder out.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__name__", f)).lower()]
    from gpumagic.devices import nvml, visible_gpus
    if fake:
        spec = importlib.util.spec_from_file_location("fake_nvml", os.path.join(ROOT, "tests", "fake_nvml.py"))
        fake_nvml = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fake_nvml)
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        nvml.use(fake_nvml.four_gpu_machine())
    target = "cpu" if device == "cpu" else next(g for g in visible_gpus() if g.device == device)
    from gpumagic.widgets.monitor import Monitor
    mon = Monitor([target])
    mon.tick()
    back_to_back = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        mon.tick()
        back_to_back.append(time.perf_counter_ns() - t0)
    at_rate = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter_ns()
        mon.tick()
        at_rate.append(time.perf_counter_ns() - t0)
        time.sleep(0.25)
    mon.stop()
    import gpumagic
    print("RESULT " + json.dumps({"package": os.path.dirname(gpumagic.__file__),
                                  "median_us": statistics.median(back_to_back) / 1000,
                                  "at_rate_mean_us": statistics.mean(at_rate) / 1000, "ticks": len(at_rate)}))


def run_variant(variant: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--device", args.device,
           "--repeat", str(args.repeat), "--seconds", str(args.seconds)] + (["--fake-nvml"] if args.fake_nvml else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{variant}: {out.stderr.strip()[-2000:]}")
    result = json.loads(line[len("RESULT "):])
    if not result["package"].startswith(os.path.abspath(variant)):
        raise RuntimeError(f"{variant} imported gpumagic from {result['package']}")
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", help="the other checkout (its gpumagic/ is timed as 'old')")
    parser.add_argument("--device", default="cuda:0", help="the device whose gauge ticks (default cuda:0)")
    parser.add_argument("--fake-nvml", action="store_true", help="the fake NVML's GPUs (default without a GPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2000, help="ticks back to back per round (median)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of ticks at 4 a second per round")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.device, args.fake_nvml, args.repeat, args.seconds)
        return
    if not args.old:
        parser.error("--old CHECKOUT is needed")
    sys.path.insert(0, HERE)
    from _common import append_results, command, machine

    from gpumagic import devices
    from gpumagic.display import text_table
    gpus = devices.visible_gpus()
    args.fake_nvml = args.fake_nvml or (not gpus and args.device != "cpu")
    rows = []
    for r in range(args.rounds):
        for name, variant in (("old", args.old), ("new", ROOT)):
            res = run_variant(variant, args)
            rows.append([str(r + 1), name, args.device + (" (fake NVML)" if args.fake_nvml else ""),
                         f"{res['median_us']:.1f} us", f"{res['at_rate_mean_us']:.1f} us ({res['ticks']} ticks)"])
    header = ["round", "variant", "device", "tick, median back to back", "tick, mean at 4 a second"]
    print(text_table(rows, header))
    if not args.no_record:
        append_results("monitor_ab.py", [f"- machine: {machine(gpus)}",
                                         f"- command: `{command('monitor_ab.py', argv)}`; old = {args.old}"],
                       [(header, rows)])


if __name__ == "__main__":
    main()
