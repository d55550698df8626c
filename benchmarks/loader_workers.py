"""How fast a DataLoader with worker processes starts inside ``%%dataparallel`` ranks.

A cell whose ``DataLoader(num_workers=W)`` serves tiny batches for a few
epochs is timed inside the cell, the loader's workers starting afresh each
epoch (``persistent_workers=False``, the default): in the kernel, then under
``%%dataparallel`` (the pool already started, so its start-up is not counted;
rank 0's time is reported). The loop does no training work, so the time is
nearly all loader start-up: the ranks should come close to the kernel.

Prints a table and appends it to ``benchmarks/RESULTS.md``. Run from the
repository root::

    python benchmarks/loader_workers.py                        # every GPU, else 2 CPU ranks
    python benchmarks/loader_workers.py --devices cpu --nprocs 2 --no-record
"""
from __future__ import annotations

import argparse

from _common import append_results, command, machine, make_shell, versions  # also puts the checkout on sys.path

from gpumagic import devices
from gpumagic.display import text_table

SETUP = """
import time, torch
from torch.utils.data import DataLoader, TensorDataset
model = torch.nn.Linear(4, 1)
loader = DataLoader(TensorDataset(torch.randn(256, 4)), batch_size=32, num_workers={workers})
"""

EPOCHS = """
t0 = time.perf_counter()
for epoch in range({epochs}):
    for (x,) in loader:
        pass
model(x)
loader_seconds = time.perf_counter() - t0
"""


def run(shell, src: str) -> None:
    result = shell.run_cell(src, store_history=False)
    if result.error_before_exec or result.error_in_exec:
        raise RuntimeError(f"benchmark cell failed: {result.error_before_exec or result.error_in_exec}\n{src}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default=None, help="%%dataparallel --devices (default: every GPU, else cpu)")
    parser.add_argument("--nprocs", type=int, default=None, help="%%dataparallel --nprocs (default: one per device)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader num_workers (default 2)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs timed (default 3)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each (best reported)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args(argv)

    gpus = devices.visible_gpus()
    dp_line = ""
    if args.devices or not gpus:
        dp_line += f" --devices {args.devices or 'cpu'}"
    if args.nprocs or not gpus:
        dp_line += f" --nprocs {args.nprocs or 2}"
    shell = make_shell()
    run(shell, SETUP.format(workers=args.workers))
    epochs = EPOCHS.format(epochs=args.epochs)
    run(shell, f"%%dataparallel{dp_line}\nmodel(torch.zeros(1, 4))\n")   # start the pool: not timed
    times: dict[str, list[float]] = {"kernel": [], "ranks": []}
    for _ in range(args.repeat):
        run(shell, epochs)
        times["kernel"].append(shell.user_ns["loader_seconds"])
        run(shell, f"%%dataparallel{dp_line}\n{epochs}")
        times["ranks"].append(shell.user_ns["loader_seconds"])
    run(shell, "%dataparallel stop")
    kernel, ranks = min(times["kernel"]), min(times["ranks"])
    header = ["measurement", "where", "seconds (best)"]
    what = f"{args.epochs} epochs, DataLoader(num_workers={args.workers}), 8 batches each"
    rows = [[what, "kernel", f"{kernel:.2f}"],
            [what, f"%%dataparallel{dp_line or ' (every GPU)'}, rank 0", f"{ranks:.2f} ({ranks / kernel:.1f}x)"]]
    print(text_table(rows, header))
    if not args.no_record:
        append_results("loader_workers.py", [f"- machine: {machine(gpus)}; {versions()}",
                                             f"- command: `{command('loader_workers.py', argv)}`"],
                       [(header, rows)])


if __name__ == "__main__":
    main()
