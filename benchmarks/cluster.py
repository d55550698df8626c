"""How fast %%dataparallel --cluster starts a cell and brings the weights back, beside the local pool.

A notebook (an IPython ``InteractiveShell`` with gpumagic loaded) makes an MLP
of ``--mb`` megabytes of fp32 weights (``--layers`` square Linear layers) and
an SGD optimizer with momentum (its state as large again), then runs the same
cell, one training step on random data, 1 + ``--later`` times in each of two places:

* on the local pool, ``%%dataparallel`` over this machine's GPUs (or
  ``--devices cpu --nprocs 2`` without one);
* on an ipyparallel cluster the notebook starts (``%dataparallel cluster start
  --engines local -n N``: one engine per GPU, or 2 on the CPU), with
  ``%%dataparallel --cluster``: a first cell and a later one.

For each cell, from the result it binds as ``dataparallel``: the cell's start (the magic's first line
to every rank running the cell's code; the pool's or cluster's own start not
counted), the weight return (the last rank done to the notebook's model and
optimizer loaded), the bytes returned and what that makes per second, and the
bytes shipped (a later cell ships no weights: the ranks kept them); the later
cells' medians, with the range of their rates. Each cell
checks that the notebook's weights changed and equal what rank 0 computed (a
sum it returns). Prints a table and appends it to ``benchmarks/RESULTS.md``::

    python benchmarks/cluster.py              # about 1-2 minutes on a 2-core machine
    python benchmarks/cluster.py --mb 400 --no-record
"""
from __future__ import annotations

import argparse
import time

import _common  # puts the checkout first on sys.path

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
WIDTH = {width}
model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range({layers})]).to({device!r})
opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
before = [p.detach().cpu().clone() for p in model.parameters()][:1]
"""

# One step; rank 0's sum of the trained weights comes back as a plain value to check the notebook's.
CELL = """
x = torch.randn(64, WIDTH, device={device!r})
opt.zero_grad()
model(x).square().mean().backward()
opt.step()
trained_sum = float(sum(p.detach().double().sum() for p in model.parameters()))
"""


def run_cells(shell, line: str, device: str, label: str, rows: list, later: int) -> None:
    """A first cell, then ``later`` cells on the same model: a row for the first, and one for the
    later ones (medians, the rate's range in brackets)."""
    import statistics

    from IPython.utils.capture import capture_output

    seen = []
    for _ in range(1 + later):
        with capture_output():
            shell.run_cell_magic("dataparallel", line, CELL.format(device=device))
        res = shell.user_ns["dataparallel"]
        ns = shell.user_ns
        mine = float(sum(p.detach().double().sum() for p in ns["model"].parameters()))
        assert abs(mine - ns["trained_sum"]) <= 1e-6 * max(1.0, abs(mine)), (mine, ns["trained_sum"])
        assert not ns["model"][0].weight.detach().cpu().equal(ns["before"][0]), "the weights did not change"
        t = res.timings
        seen.append((t["start"], t["return"], res.returned_bytes, res.shipped_bytes))
        print(label, seen[-1], flush=True)
    for which, cells in (("first", seen[:1]), (f"later (median of {later})", seen[1:])):
        start = statistics.median(c[0] for c in cells)
        back = statistics.median(c[1] for c in cells)
        rates = sorted(c[2] / c[1] / 1e6 for c in cells)
        rate = f"{statistics.median(rates):.0f} MB/s" + (f" ({rates[0]:.0f}-{rates[-1]:.0f})" if len(rates) > 1 else "")
        rows.append([label, which, f"{start:.2f} s", f"{back:.2f} s", f"{cells[0][2] / 1e6:.0f} MB", rate,
                     f"{statistics.median(c[3] for c in cells) / 1e6:.0f} MB"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200, help="the model's fp32 weights, in MB (default 200)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--later", type=int, default=5, help="later cells after the first (default 5)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args(argv)

    from gpumagic import devices
    from gpumagic.display import text_table
    gpus = devices.visible_gpus()
    width = int((args.mb * 1e6 / 4 / args.layers) ** 0.5)
    device = "cuda" if gpus else "cpu"
    local_line = "" if gpus else "--devices cpu --nprocs 2"
    engines = len(gpus) or 2
    shell = _common.make_shell()
    rows: list = []
    t0 = time.perf_counter()
    try:
        shell.run_cell(SETUP.format(width=width, layers=args.layers, device=device)).raise_error()
        run_cells(shell, local_line, device, "local pool", rows, args.later)
        shell.run_line_magic("dataparallel", "stop")
        shell.run_cell(SETUP.format(width=width, layers=args.layers, device=device)).raise_error()
        shell.run_line_magic("dataparallel", f"cluster start --engines local -n {engines}")
        label = f"--cluster ({engines} local engine{'s' if engines != 1 else ''})"
        run_cells(shell, "--cluster", device, label, rows, args.later)
    finally:
        shell.run_line_magic("dataparallel", "cluster stop")
        shell.run_line_magic("dataparallel", "stop")
    header = ["ranks", "cell", "start", "weight return", "returned", "rate", "shipped"]
    print(text_table(rows, header))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if not args.no_record:
        _common.record("cluster.py", argv, gpus, f"model: {args.layers} x Linear({width}, {width}), "
                       f"{args.mb:.0f} MB of weights, SGD momentum (state as large again)", [(header, rows)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
