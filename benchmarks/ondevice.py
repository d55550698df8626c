"""What ``%%ondevice`` costs: per cell, and inside a loop of small ops.

Measures, per device (cpu, and cuda:0 where there is a GPU):

* the time of one trivial cell (``x = 1``) run through ``shell.run_cell`` as
  a plain cell and under ``%%ondevice DEVICE`` (also ``--no-rewrite`` and, on
  a GPU, ``--stream``): the difference is what the magic adds per cell
  (target: well under 1 ms);
* a loop of ``--ops`` iterations of ``y = torch.zeros(8); z = x + 1`` under
  ``%%ondevice DEVICE`` (the rewrite passes ``device=`` explicitly), against
  the same loop written with ``device=dev`` in a plain cell (target: no
  measurable difference), under ``--no-rewrite`` (which sets torch's
  default device, except for cpu when none is set), and in a plain cell
  inside ``with torch.device(dev):``, torch's default-device context, which
  intercepts every torch call. The loop is timed inside the cell.

Prints a table and appends it to ``benchmarks/RESULTS.md`` with the date,
the machine and the command. Run from the repository root::

    python benchmarks/ondevice.py                 # cpu, and cuda:0 if there is a GPU
    python benchmarks/ondevice.py --device cpu --cells 500 --no-record
"""
from __future__ import annotations

import argparse
import statistics
import time

from _common import append_results, command, machine, make_shell, versions  # also puts the checkout on sys.path

from gpumagic import devices
from gpumagic.display import text_table


def run(shell, src: str) -> None:
    result = shell.run_cell(src, store_history=False)
    if result.error_before_exec or result.error_in_exec:
        raise RuntimeError(f"benchmark cell failed: {result.error_before_exec or result.error_in_exec}\n{src}")


def per_cell_us(shell, variants: dict[str, str], cells: int, rounds: int = 10) -> dict[str, float]:
    """Median over ``rounds`` of the mean time per cell, variants interleaved round by round."""
    for src in variants.values():
        for _ in range(20):
            run(shell, src)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    per_round = max(1, cells // rounds)
    for _ in range(rounds):
        for name, src in variants.items():
            t0 = time.perf_counter_ns()
            for _ in range(per_round):
                run(shell, src)
            samples[name].append((time.perf_counter_ns() - t0) / per_round / 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def cell_overhead(shell, device: str, cells: int) -> list[list[str]]:
    body = "x = 1\n"
    variants = {
        "plain cell": body,
        f"%%ondevice {device}": f"%%ondevice {device}\n{body}",
        f"%%ondevice {device} --no-rewrite": f"%%ondevice {device} --no-rewrite\n{body}",
    }
    if device.startswith("cuda"):
        variants[f"%%ondevice {device} --stream"] = f"%%ondevice {device} --stream\n{body}"
    times = per_cell_us(shell, variants, cells)
    base = times["plain cell"]
    rows = [["one cell `x = 1`: plain run_cell", device, f"{base:.1f} us"]]
    for name, us in times.items():
        if name != "plain cell":
            rows.append([f"one cell `x = 1`: {name}", device, f"{us:.1f} us (+{us - base:.1f} us per cell)"])
    return rows


def small_op_loop(shell, device: str, ops: int, repeat: int) -> list[list[str]]:
    """The loop's own time, measured inside each cell (per-cell costs excluded)."""
    shell.run_cell(f"import torch, time\ndev = torch.device({device!r})\nx = torch.zeros(8, device=dev)\n",
                   store_history=False)
    sync = "torch.cuda.synchronize()\n" if device.startswith("cuda") else ""

    def timed(kw: str, indent: str = "") -> str:
        return (f"{indent}_t0 = time.perf_counter()\n"
                f"{indent}for _ in range({ops}):\n"
                f"{indent}    y = torch.zeros(8{kw})\n"
                f"{indent}    z = x + 1\n"
                f"{indent}{sync}"
                f"{indent}_bench = time.perf_counter() - _t0\n")

    base_name = "plain cell, explicit device=dev"
    variants = {
        base_name: timed(", device=dev"),
        f"%%ondevice {device} (rewrite passes device=)": f"%%ondevice {device}\n" + timed(""),
        f"%%ondevice {device} --no-rewrite": f"%%ondevice {device} --no-rewrite\n" + timed(""),
        "plain cell in `with torch.device(dev):`": "with torch.device(dev):\n" + timed("", "    "),
    }
    for src in variants.values():
        run(shell, src)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, src in variants.items():
            run(shell, src)
            samples[name].append(shell.user_ns["_bench"] / ops * 1e6)
    base_med = statistics.median(samples[base_name])
    base_min = min(samples[base_name])
    rows = []
    for name, values in samples.items():
        med, low = statistics.median(values), min(values)
        rows.append([f"{ops} x (torch.zeros(8); x + 1): {name}", device,
                     f"median {med:.2f} us/iter ({med / base_med:.2f}x), min {low:.2f} ({low / base_min:.2f}x)"])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", action="append",
                        help="device to measure (repeatable); default: cpu, and cuda:0 where there is a GPU")
    parser.add_argument("--cells", type=int, default=2000, help="trivial cells timed per variant (default 2000)")
    parser.add_argument("--ops", type=int, default=10_000, help="iterations of the small-op loop (default 10000)")
    parser.add_argument("--repeat", type=int, default=9, help="timed runs of each loop variant (median reported)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args(argv)

    gpus = devices.visible_gpus()
    targets = args.device or (["cpu", "cuda:0"] if gpus else ["cpu"])
    shell = make_shell()
    header = ["measurement", "device", "value"]
    rows = []
    for device in targets:
        device = devices.parse_device(device, gpus)
        rows += cell_overhead(shell, device, args.cells)
        rows += small_op_loop(shell, device, args.ops, args.repeat)
    print(text_table(rows, header))
    if not args.no_record:
        append_results("ondevice.py", [f"- machine: {machine(gpus)}; {versions()}",
                                       f"- command: `{command('ondevice.py', argv)}`"], [(header, rows)])


if __name__ == "__main__":
    main()
