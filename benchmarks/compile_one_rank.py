"""What --compile does for one %%dataparallel rank: eager, --compile and --compile reduce-overhead side by side.

One rank on one GPU (DDP over a world of one) runs the Transformer of
``benchmarks/dataparallel.py`` (8 layers, d1024, bf16 autocast, batch 64 by
default) through an IPython ``InteractiveShell`` as a notebook would: a fresh
model for each column, then ``%%dataparallel --devices cuda:0 [--compile
[MODE]]`` over the fixed-step loop of ``dataparallel.py``. For each column:
samples/s over the timed steps, the cell's wall time, and the ``--compile`` note
(graphs compiled, first optimizer step). ``TORCH_LOGS=perf_hints`` is set for
the ranks, so any "skipping cudagraphs" hint inductor prints is reported.

It tells whether a rank's step is bound by kernel launches (CUDA graphs then
help a lot) before two GPUs are measured with ``dataparallel.py --compile
--cudagraphs``. Prints a table and appends it to ``benchmarks/RESULTS.md``::

    python benchmarks/compile_one_rank.py                 # one GPU, about 1.5 minutes
    python benchmarks/compile_one_rank.py --batch 32 --no-record
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import _common  # puts the checkout first on sys.path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["TORCH_LOGS"] = "perf_hints"   # the ranks inherit it: "skipping cudagraphs due to ..."
import dataparallel as bench  # after TORCH_LOGS, which torch reads at import

LINES = ("", "--compile", "--compile reduce-overhead")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: the tiny Transformer, one CPU rank")
    args = parser.parse_args(argv)

    from IPython.utils.capture import capture_output

    from gpumagic import devices
    from gpumagic.display import text_table
    gpus = devices.visible_gpus()
    if not gpus and not args.quick:
        print("compile_one_rank.py needs a GPU (--quick runs it on the CPU)")
        return 2
    device, where = ("cpu", "--devices cpu --nprocs 1") if args.quick else ("cuda:0", "--devices cuda:0")
    shell = bench.make_shell()
    rows = []
    base = None
    for flags in LINES:
        line = f"{where} {flags}".strip()
        # a fresh model per column, its loader batch set to --batch
        bench.notebook_setup(shell, "transformer", args.quick, device, (30 + args.steps) * args.batch, 30, args.steps,
                             4, 10)
        shell.run_cell(f"loader = torch.utils.data.DataLoader(loader.dataset, batch_size={args.batch}, "
                       "collate_fn=passthrough)", silent=True).raise_error()
        t0 = time.perf_counter()
        with capture_output() as cap:
            shell.run_cell_magic("dataparallel", line, bench.fixed_loop())
        wall = time.perf_counter() - t0
        ns = shell.user_ns
        rate = ns["done"] * args.batch / ns["elapsed"]
        base = base or rate
        text = cap.stdout + cap.stderr
        note = next((ln for ln in text.splitlines() if ln.startswith("--compile")), "-")
        hints = sorted({ln.strip()[:160] for ln in text.splitlines() if "cudagraph" in ln.lower()})
        rows.append([line, f"{rate:,.0f}", f"{rate / base:.2f}x", f"{wall:.1f} s", note,
                     "; ".join(hints) or "none"])
        print(rows[-1], flush=True)
    shell.run_line_magic("dataparallel", "stop")
    header = ["%%dataparallel", "samples/s", "vs eager", "cell", "--compile note", "cudagraph hints"]
    print(text_table(rows, header))
    if not args.no_record:
        _common.record("compile_one_rank.py", argv, gpus, f"Transformer 8 x d1024, bf16, batch {args.batch}, "
                       f"{args.steps} timed steps", [(header, rows)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
