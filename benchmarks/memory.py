"""What getting memory back costs and gives: the per-cell ledger's cost, and on a GPU the rescue.

Measures, through a real IPython shell with gpumagic loaded:

* the ledger's cost per cell (``%gpumem --cells``): the median time its
  ``pre_run_cell`` and ``post_run_cell`` handlers add to a cell, in a notebook
  of ``--variables`` variables, for a cell that used no CUDA (target: under
  1 ms) and, on a GPU, for a cell that did (target: under 5 ms);
* on a GPU, the rescue after a real CUDA out-of-memory error: a model and
  AdamW after a step; a function that holds half the GPU's memory in
  activations and asks for as much again; then ``%gpumem --rescue``: the
  allocated bytes over the baseline (target: at most 2 MiB), the bytes moved and
  the GB/s, and whether the function re-run at half the size succeeds;
* on a GPU, ``%gpumem --park`` and ``--unpark`` of a model and its AdamW state
  against the pinned host<->device bandwidth measured in the same run (target:
  the copies at 80 % of it or more).

Prints a table and appends it to ``benchmarks/RESULTS.md`` with the date, the
machine and the command. Run from the repository root::

    python benchmarks/memory.py
    python benchmarks/memory.py --cells 400 --no-record
"""
from __future__ import annotations

import argparse
import statistics
import time

from _common import make_shell, record  # also puts the checkout on sys.path

from gpumagic import devices
from gpumagic.display import fmt_bytes, text_table

MiB = 2**20


def ledger_cost(shell, cell: str, runs: int) -> float:
    """Median microseconds the ledger adds to ``cell``: its handlers, timed around a real run."""
    from gpumagic.magics import cell_events
    handlers = cell_events._registered[id(shell)]
    extra = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        handlers.pre_run_cell(None)
        t1 = time.perf_counter_ns()
        result = shell.run_cell(cell, store_history=False, silent=True)   # silent: no handler runs inside
        t2 = time.perf_counter_ns()
        handlers._started = True
        handlers.post_run_cell(result)
        t3 = time.perf_counter_ns()
        extra.append((t1 - t0) + (t3 - t2))
    return statistics.median(extra) / 1000


def rescue_floor(shell) -> list[list[str]]:
    """The issue's floor on one GPU, measured in the shell; rows of (measurement, value)."""
    setup = ("import torch, gc\n"
             "model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()\n"
             "opt = torch.optim.AdamW(model.parameters())\n"
             "model(torch.randn(64, 4096, device='cuda')).sum().backward(); opt.step()\n"
             "ids = (id(model), id(opt))\n"
             "baseline = torch.cuda.memory_allocated()\n"
             "total = torch.cuda.get_device_properties(0).total_memory\n"
             "def step(share):\n"
             "    rows = int(total * share) // (4096 * 4) // 32\n"
             "    h = torch.randn(rows, 4096, device='cuda', requires_grad=True)\n"
             "    acts = []\n"
             "    for i in range(32):\n"
             "        h = torch.relu(h * 1.0001)     # each keeps its output for backward\n"
             "        acts.append(h)\n"
             "    more = torch.empty(int(total * share), dtype=torch.uint8, device='cuda')\n"
             "    return float(more.numel() + len(acts))\n")
    assert shell.run_cell(setup).success
    failed = shell.run_cell("step(0.5)")
    ns = shell.user_ns
    error = failed.error_in_exec
    oom = type(error).__name__
    held = ns["torch"].cuda.memory_allocated() - ns["baseline"]
    del error, failed
    t0 = time.perf_counter()
    report = shell.run_line_magic("gpumem", "--rescue --json")
    seconds = time.perf_counter() - t0
    over = ns["torch"].cuda.memory_allocated() - ns["baseline"]
    same = (id(ns["model"]), id(ns["opt"])) == ns["ids"]
    rerun = shell.run_cell("ok = step(0.25) > 0").success and ns["ok"]
    moved = sum(report["moved"].values())
    rate = moved / report["seconds"] / 1e9 if report["seconds"] else 0
    return [["out-of-memory error", oom], ["held by the error", fmt_bytes(held)],
            ["moved to the CPU by --rescue", f"{fmt_bytes(moved)} in {report['seconds']:.2f} s ({rate:.1f} GB/s)"],
            ["--rescue in all", f"{seconds:.2f} s"],
            ["allocated over the baseline after --rescue", f"{over} bytes (floor: at most {2 * MiB})"],
            ["model and opt the same objects", str(same)], ["re-run at half the size", "succeeded" if rerun
                                                             else "FAILED"]]


def pinned_bandwidth(torch, nbytes: int = 4 << 30, repeat: int = 3) -> tuple[float, float]:
    """(device-to-host, host-to-device) GB/s of one large copy between pinned memory and cuda:0."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for src, dst in ((dev, host), (host, dev)):
        times = []
        for _ in range(repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rates.append(nbytes / statistics.median(times) / 1e9)
    del host, dev
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()
    return rates[0], rates[1]


def park_floor(shell) -> list[list[str]]:
    """Park and unpark a model with its AdamW state; rows of (measurement, value)."""
    import torch
    d2h, h2d = pinned_bandwidth(torch)
    setup = ("park_model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(24)]).cuda()\n"
             "park_opt = torch.optim.AdamW(park_model.parameters())\n"
             "park_model(torch.randn(8, 4096, device='cuda')).sum().backward(); park_opt.step()\n")
    assert shell.run_cell(setup).success
    parked = shell.run_line_magic("gpumem", "cuda:0 --park --json")
    left = torch.cuda.memory_reserved()
    back = shell.run_line_magic("gpumem", "--unpark --json")
    shell.run_cell("del park_model, park_opt")
    rows = [["pinned bandwidth, device to host / host to device", f"{d2h:.1f} / {h2d:.1f} GB/s"]]
    for name, report, peak in (("park", parked, d2h), ("unpark", back, h2d)):
        moved = sum(report["moved"].values())
        rate = (report["rate"] or 0) / 1e9
        rows.append([f"--{name}: copies", f"{fmt_bytes(moved)} at {rate:.1f} GB/s ({100 * rate / peak:.0f} % of "
                     f"pinned; floor 80 %), {report['copy_seconds']:.2f} s"])
        rows.append([f"--{name}: in all", f"{report['seconds']:.2f} s"])
    rows.append(["torch reserved on cuda:0 while parked", fmt_bytes(left)])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=200, help="cells timed per case")
    parser.add_argument("--variables", type=int, default=100, help="notebook variables while timing")
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args(argv)
    gpus = devices.visible_gpus()
    shell = make_shell()
    shell.run_cell("import torch\n" + "\n".join(f"v{i} = torch.zeros(16)" for i in range(args.variables)))
    shell.run_line_magic("gpumem", "--cells")
    rows = [["ledger: a cell without CUDA (`x = 1`)", f"{ledger_cost(shell, 'x = 1', args.cells):.1f} us"]]
    if gpus:
        shell.run_cell("g = torch.ones(1024, device='cuda')")
        cost = ledger_cost(shell, "g.mul_(1.0001); y = g.sum().item()", args.cells)
        rows.append(["ledger: a cell using CUDA (`g.mul_(...)`)", f"{cost:.1f} us"])
    shell.run_line_magic("gpumem", "--cells")
    if gpus:
        rows += rescue_floor(shell)
        shell.run_line_magic("gpumem", "--free")
        rows += park_floor(shell)
    print(text_table(rows, ["measurement", "value"]))
    if not args.no_record:
        record("memory.py", argv, gpus, f"{args.cells} cells per case, {args.variables} variables",
               [(["measurement", "value"], rows)])


if __name__ == "__main__":
    main()
