"""A/B on one machine: ``%%dataparallel`` start-up and weight return, this checkout against another.

Each round starts a fresh kernel per variant (the other checkout's ``gpumagic`` first on the
path, or this one's), builds ``benchmarks/dataparallel.py``'s ResNet-50 (or, with ``--quick``,
its small CPU stand-in), and runs three short ``%%dataparallel`` cells, printing each cell's
timings: the pool's start (first cell), the cell start, the run, the weight return. Machines
differ from run to run by more than a refactor should change these, so compare on one machine::

    git worktree add /tmp/before <commit>
    python benchmarks/dataparallel_ab.py --old /tmp/before            # GPUs
    python benchmarks/dataparallel_ab.py --old /tmp/before --quick    # CPU, 2 gloo ranks
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(variant: str, quick: bool) -> None:
    """In a fresh kernel: three %%dataparallel cells; prints RESULT <package dir> <timings json>."""
    sys.path.insert(0, variant)
    # An editable install of gpumagic would win over the path: leave its finder out.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__name__", f)).lower()]
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "gpumagic")
    src = open(os.path.join(HERE, "dataparallel.py")).read()
    sh.run_cell(re.search(r"COMMON = '{3}(.*?)'{3}", src, re.S).group(1), silent=True).raise_error()
    fixed = re.search(r'FIXED_CELL = "{3}(.*?)"{3}', src, re.S).group(1)
    step = re.search(r'STEP = "{3}(.*?)"{3}', src, re.S).group(1)
    cell = fixed.format(step=textwrap.indent(step.strip("\n") + "\n", "    "))
    dev = "cpu" if quick else "cuda:0"
    sh.run_cell(f"""
torch.manual_seed(0)
model = make_model('resnet50', {quick}).to({dev!r})
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
gb, shape, classes = shapes('resnet50', {quick})
loader = torch.utils.data.DataLoader(SyntheticSet(64 * gb, shape, classes), batch_size=gb, collate_fn=passthrough)
loss_fn = make_loss('resnet50')
WARMUP, STEPS = 2, 4
DEVICE_TYPE, AMP = {dev.split(':')[0]!r}, {dev != 'cpu'}
""").raise_error()
    def last_result():
        """The last cell's result: bound in the notebook as ``dataparallel``, or, in a checkout from before
        that, kept by the package."""
        bound = sh.user_ns.get("dataparallel")
        if hasattr(bound, "timings"):
            return bound
        try:
            from gpumagic.dataparallel.run import last_result as kept
        except ImportError:  # a checkout from before the process layer
            from gpumagic.parallel.ddp import last_result as kept
        return kept()
    out = []
    for _ in range(3):
        with capture_output():
            sh.run_cell_magic("dataparallel", "--devices cpu --nprocs 2" if quick else "", cell)
        out.append({k: round(v, 3) for k, v in last_result().timings.items() if v is not None})
    import gpumagic
    print("RESULT " + os.path.dirname(gpumagic.__file__) + " " + json.dumps(out))
    sh.run_line_magic("dataparallel", "stop")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="another checkout (its folder holding gpumagic/)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="CPU ranks and a small model")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.quick)
    for _ in range(args.rounds):
        for name, variant in (("old", os.path.abspath(args.old)), ("new", ROOT)):
            t0 = time.monotonic()
            cmd = [sys.executable, __file__, "--old", args.old, "--child", variant]
            cmd += ["--quick"] if args.quick else []
            # Not from the checkout: an editable install or the working directory would shadow the variant.
            p = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp", timeout=600)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            print(name, f"{time.monotonic() - t0:.1f} s", line[0][7:] if line else p.stderr[-1500:], flush=True)


if __name__ == "__main__":
    main()
