"""Training throughput of %%dataparallel against one GPU, nn.DataParallel and hand-written DDP.

For each model (ResNet-50 when torchvision is there, an MLP 1024-4096-4096-4096-10
at batch 8192, a TransformerEncoder of 8 layers of width 1024 at sequence 128 and
batch 64), with synthetic data, bf16 autocast, SGD with momentum, and the same
global batch in every column:

* ``1 GPU``: the loop in this process on cuda:0;
* ``1 GPU, B/2``: the same at half the batch, a diagnostic: twice its samples/s is
  the most DDP over 2 GPUs can reach when a step costs the same at any batch size
  (launch-bound models), whatever the communication;
* ``nn.DataParallel``: ``nn.DataParallel(model, [0, 1])`` in this process;
* ``DDP (hand-written)``: the script people write by hand (``init_process_group``,
  ``DistributedSampler``, ``DDP(model, device_ids=[rank])``), one process per GPU
  started with ``torch.multiprocessing.spawn``; the ranks meet through a file in a
  private temporary directory (``file://`` rendezvous), not a TCP port that another
  process could take between its choice and the ranks' bind;
* ``%%dataparallel``: the same loop as a notebook cell run through a real IPython
  ``InteractiveShell`` (worker pool, DDP, weights back into the notebook);
* ``%%dataparallel --strategy dp``: the cell in this process, calls of the model
  split with replicate/scatter/parallel_apply/gather.

Every column reads its batches from a ``DataLoader`` over the same synthetic
dataset, whose batches are made once on the device that asks for them (so no
host-to-device copy is timed anywhere). Each column warms up (cuDNN autotuning
included), then times a fixed number of steps sized to take a few seconds;
in-process columns that turn out slow stop after ``--seconds``.

It also reports the first ``%%dataparallel`` cell's overhead (pool start, then
shipping the model and starting the ranks) and a later ResNet-50 cell's start
and weight return (the pool reused). Prints a table, appends it to
``benchmarks/RESULTS.md``. Run from the repository root::

    python benchmarks/dataparallel.py            # 2 GPUs: about 3-4 minutes
    python benchmarks/dataparallel.py --quick    # CPU smoke run: tiny models, 2 gloo processes
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import textwrap
import time

import _common  # also puts the checkout on sys.path
from _common import append_results, command, machine, versions

# Shared by this script, the hand-written DDP processes and the notebook (the shell's namespace).
COMMON = '''
import time
import torch
from torch import nn
import torch.nn.functional as F


class SyntheticSet(torch.utils.data.Dataset):
    """Random batches made once per device and size, served as they are (no host work per step)."""

    def __init__(self, length, x_shape, classes):
        self.length, self.x_shape, self.classes = length, tuple(x_shape), classes
        self._made = {}

    def __len__(self):
        return self.length

    def __getitems__(self, indices):
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        key = (device, len(indices))
        if key not in self._made:
            x = torch.randn((len(indices),) + self.x_shape, device=device)
            y = torch.randint(0, self.classes, (len(indices),), device=device)
            self._made[key] = (x, y)
        return self._made[key]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_made"] = {}
        return state


def passthrough(batch):
    return batch


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_model(kind, quick):
    if kind == "resnet50":
        if quick:
            return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
        import torchvision
        return torchvision.models.resnet50()
    if kind == "mlp":
        w = (64, 128, 128, 128) if quick else (1024, 4096, 4096, 4096)
        return nn.Sequential(nn.Linear(w[0], w[1]), nn.ReLU(), nn.Linear(w[1], w[2]), nn.ReLU(),
                             nn.Linear(w[2], w[3]), nn.ReLU(), nn.Linear(w[3], 10))
    if kind == "transformer":
        d, layers, heads = (64, 2, 4) if quick else (1024, 8, 16)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, batch_first=True)
        return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    raise ValueError(kind)


def shapes(kind, quick):
    """(global batch, sample shape, classes)"""
    if kind == "resnet50":
        return (32, (3, 16, 16), 10) if quick else (256, (3, 224, 224), 1000)
    if kind == "mlp":
        return (256, (64,), 10) if quick else (8192, (1024,), 10)
    return (16, (16, 64), 10) if quick else (64, (128, 1024), 10)


def make_loss(kind):
    if kind == "transformer":
        return lambda out, y: out.float().pow(2).mean()
    return lambda out, y: F.cross_entropy(out.float(), y)
'''

exec(COMMON, globals())
# What COMMON defines, named here for readers and linters (exec hides them).
SyntheticSet, passthrough, sync, make_model, shapes, make_loss = (
    globals()[name] for name in ("SyntheticSet", "passthrough", "sync", "make_model", "shapes", "make_loss"))
_SCRIPT_MAIN = sys.modules.get("__main__")   # IPython replaces it; spawn needs this one to find our functions

STEP = """
x, y = next(it)
with torch.autocast(DEVICE_TYPE, dtype=torch.bfloat16, enabled=AMP):
    loss = loss_fn(model(x), y)
opt.zero_grad(set_to_none=True)
loss.backward()
opt.step()
"""

FIXED_CELL = """it = iter(loader)
for i in range(WARMUP + STEPS):
    if i == WARMUP:
        sync()
        t0 = time.perf_counter()
{step}sync()
elapsed = time.perf_counter() - t0
done = STEPS
"""

BOUNDED_CELL = """it = iter(loader)
for i in range(WARMUP):
{step}sync()
t0 = time.perf_counter()
done = 0
while True:
    for j in range(CHUNK):
{step2}        done += 1
    sync()
    elapsed = time.perf_counter() - t0
    if elapsed > SECONDS or done >= STEPS:
        break
"""


def _indent(text: str, n: int) -> str:
    return textwrap.indent(text.strip("\n") + "\n", " " * n)


def fixed_loop() -> str:
    return FIXED_CELL.format(step=_indent(STEP, 4))


def bounded_loop() -> str:
    return BOUNDED_CELL.format(step=_indent(STEP, 4), step2=_indent(STEP, 8))


# ------------------------------------------------------------------ in-process columns

def run_in_process(ns: dict, code: str) -> dict:
    exec(compile(code, "<benchmark>", "exec"), ns)
    return {"elapsed": ns["elapsed"], "steps": ns["done"]}


def in_process(kind, quick, device, batch, warmup, steps, seconds, chunk, wrap=None) -> dict:
    import torch
    torch.manual_seed(0)
    gbatch, shape, classes = shapes(kind, quick)
    model = make_model(kind, quick).to(device)
    run_model = wrap(model) if wrap else model
    ds = SyntheticSet(10**8, shape, classes)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, collate_fn=passthrough)
    ns = dict(globals())
    ns.update(model=run_model, opt=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
              loader=loader, loss_fn=make_loss(kind), WARMUP=warmup, STEPS=steps, SECONDS=seconds,
              CHUNK=chunk, DEVICE_TYPE=device.split(":")[0], AMP=device != "cpu")
    out = run_in_process(ns, bounded_loop())
    del ns, model, run_model, loader
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    out["samples_per_s"] = out["steps"] * batch / out["elapsed"]
    return out


# ------------------------------------------------------------------ hand-written DDP (torchrun-style)

def hand_ddp_worker(rank, world, kind, quick, rendezvous, warmup, steps, result_path, compiled=None):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    cuda = torch.cuda.is_available() and not quick
    if cuda:
        torch.cuda.set_device(rank)
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))   # as the pool's CPU workers do
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    gbatch, shape, classes = shapes(kind, quick)
    device = f"cuda:{rank}" if cuda else "cpu"
    model = make_model(kind, quick).to(device)
    inside = bool(compiled) and compiled.startswith("inner-")   # DDP(torch.compile(model))
    mode = compiled.removeprefix("inner-") if compiled else None
    if inside:
        model = torch.compile(model, mode=None if mode == "default" else mode)
    model = DDP(model, device_ids=[rank] if cuda else None)
    if compiled and not inside:
        # as torch's DDP docs say: wrap first, then compile (for a model made only of torch's layers
        # dynamo traces nothing this way: it skips torch's own frames)
        model = torch.compile(model, mode=None if mode == "default" else mode)
    ds = SyntheticSet((warmup + steps) * gbatch, shape, classes)
    loader = DataLoader(ds, batch_size=gbatch // world, sampler=DistributedSampler(ds, shuffle=False),
                        collate_fn=passthrough)
    ns = dict(globals())
    ns.update(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), loader=loader,
              loss_fn=make_loss(kind), WARMUP=warmup, STEPS=steps, DEVICE_TYPE=device.split(":")[0], AMP=cuda)
    out = run_in_process(ns, fixed_loop())
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def hand_ddp(kind, quick, world, warmup, steps, compiled=None, limit=None) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:   # mkdtemp: this user's alone, and new each time
        path = os.path.join(tmp, "result.json")
        rendezvous = os.path.join(tmp, "rendezvous")   # the ranks' FileStore: no port to lose to another process
        t0 = time.perf_counter()
        saved = sys.modules.get("__main__")
        sys.modules["__main__"] = _SCRIPT_MAIN
        try:
            context = mp.spawn(hand_ddp_worker, args=(world, kind, quick, rendezvous, warmup, steps, path, compiled),
                               nprocs=world, join=False)
            deadline = None if limit is None else time.monotonic() + limit
            while not context.join(timeout=5):
                if deadline is not None and time.monotonic() > deadline:
                    for p in context.processes:
                        p.kill()
                    raise TimeoutError(f"no result after {limit:.0f} s")
        finally:
            sys.modules["__main__"] = saved
        wall = time.perf_counter() - t0
        with open(path) as f:
            out = json.load(f)
    gbatch = shapes(kind, quick)[0]
    out["samples_per_s"] = out["steps"] * gbatch / out["elapsed"]
    out["wall"] = wall
    return out


# ------------------------------------------------------------------ through IPython

def make_shell():
    shell = _common.make_shell()
    shell.run_cell(COMMON, silent=True)
    return shell


def notebook_setup(shell, kind, quick, device, length, warmup, steps, seconds, chunk):
    gbatch, shape, classes = shapes(kind, quick)
    code = f"""
torch.manual_seed(0)
model = make_model({kind!r}, {quick!r}).to({device!r})
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loader = torch.utils.data.DataLoader(SyntheticSet({length}, {shape!r}, {classes}), batch_size={gbatch},
                                     collate_fn=passthrough)
loss_fn = make_loss({kind!r})
WARMUP, STEPS, SECONDS, CHUNK = {warmup}, {steps}, {seconds}, {chunk}
DEVICE_TYPE, AMP = {device.split(':')[0]!r}, {device != 'cpu'}
"""
    result = shell.run_cell(code, silent=True)
    result.raise_error()


def magic_cell(shell, line: str, body: str) -> dict:
    from IPython.utils.capture import capture_output
    with capture_output():
        shell.run_cell_magic("dataparallel", line, body)
    ns = shell.user_ns
    return {"elapsed": ns["elapsed"], "steps": ns["done"]}


# ------------------------------------------------------------------ the run

def fmt_rate(x) -> str:
    if x is None:
        return "n/a"
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    return f"{x:,.0f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny models, 2 gloo processes")
    parser.add_argument("--models", default="resnet50,mlp,transformer")
    parser.add_argument("--seconds", type=float, default=None, help="timed window per column (default 4; quick 1)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--cudagraphs", action="store_true",
                        help="with --compile: also the reduce-overhead (CUDA graphs) columns on GPUs")
    parser.add_argument("--compile", action="store_true",
                        help="also the compiled columns: 1 GPU with torch.compile, hand-written DDP with "
                             "torch.compile, %%%%dataparallel --compile (first and later cell), and "
                             "with --grad-dtype bf16")
    args = parser.parse_args(argv)

    import torch

    from gpumagic import devices
    from gpumagic.display import text_table

    gpus = devices.visible_gpus()
    quick = args.quick
    if not quick and len(gpus) < 2:
        sys.exit("needs 2 GPUs (or --quick for a CPU smoke run)")
    seconds = args.seconds or (1.0 if quick else 4.0)
    world = 2
    device = "cpu" if quick else "cuda:0"
    ddp_line = "--devices cpu --nprocs 2" if quick else "--devices 0,1"
    dp_line = "--strategy dp" + ("" if quick else " --devices 0,1")
    if not quick:
        torch.backends.cudnn.benchmark = True      # every column, the notebook's too (workers follow it)
    else:
        # One thread per process everywhere (as the pool's 2 CPU workers get on 2 cores): OpenMP
        # threads that spin on a shared, busy CPU make a single process erratically slow.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    kinds = [k.strip() for k in args.models.split(",") if k.strip()]
    if "resnet50" in kinds and not quick:
        try:
            import torchvision  # noqa: F401
        except ImportError:
            print("torchvision is not installed: skipping ResNet-50")
            kinds.remove("resnet50")

    shell = make_shell()
    header = ["model", "global batch", "column", "samples/s", "vs 1 GPU", "steps timed"]
    rows, overheads = [], []
    t_start = time.perf_counter()
    first_cell = True

    def attempt(results, column, fn):
        """One column; a failure becomes a row saying so, and the run goes on."""
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - a benchmark reports, it does not stop
            import traceback
            traceback.print_exc()
            out = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"}
        results.append((column, out))
        return out

    def one_model(kind):
        """Every column for one model; its rows join ``rows``, its overheads ``overheads``."""
        nonlocal first_cell
        gbatch = shapes(kind, quick)[0]
        name = {"resnet50": "ResNet-50", "mlp": "MLP", "transformer": "Transformer"}[kind]
        results: list = []
        # 1 GPU: also tells how many steps fill the timed window.
        try:
            probe = in_process(kind, quick, device, gbatch, warmup=5, steps=10**9, seconds=seconds / 4, chunk=2)
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            rows.append([name, str(gbatch), "(all)", "error", f"{type(exc).__name__}: {exc}"[:120], "-"])
            return
        rate = probe["steps"] / probe["elapsed"]
        warmup = max(5, math.ceil(rate * 1.0))
        steps = max(10, round(rate * seconds * 1.8 / 2) * 2)   # about `seconds` for a 1.8x faster column
        if quick:
            steps = min(steps, 40)   # gloo on a small CPU is far slower than one process: keep it short
        chunk = max(1, round(rate * 0.25))
        one = attempt(results, "1 GPU" if not quick else "1 process",
                      lambda: in_process(kind, quick, device, gbatch, warmup, 10**9, seconds, chunk))
        base = one.get("samples_per_s")
        if not quick:
            def half():
                r = in_process(kind, quick, device, gbatch // 2, warmup, 10**9, seconds, chunk)
                return {**r, "samples_per_s": 2 * r["samples_per_s"]}
            attempt(results, "1 GPU, B/2 (x2 = DDP ceiling)", half)
            attempt(results, "nn.DataParallel",
                    lambda: in_process(kind, quick, device, gbatch, warmup, 10**9, seconds, chunk,
                                       wrap=lambda m: torch.nn.DataParallel(m, device_ids=[0, 1])))
        attempt(results, "DDP (hand-written)", lambda: hand_ddp(kind, quick, world, warmup, steps))

        def ours():
            notebook_setup(shell, kind, quick, device, (warmup + steps) * gbatch, warmup, steps, seconds, chunk)
            r = magic_cell(shell, ddp_line, fixed_loop())
            r["samples_per_s"] = r["steps"] * gbatch / r["elapsed"]
            r["timings"] = shell.user_ns["dataparallel"].timings
            print(f"{name}: %%dataparallel timings {r['timings']}", flush=True)
            return r
        r = attempt(results, "%%dataparallel", ours)
        if first_cell and "timings" in r:
            t = r["timings"]
            overheads.append([name, "first cell: pool start", f"{t['pool_start']:.2f} s"])
            overheads.append([name, "first cell: ship model + start ranks", f"{t['start']:.2f} s"])
            overheads.append([name, "first cell: weight return", f"{t['return']:.2f} s"])
            first_cell = False
        if kind == "resnet50" or (quick and kind == kinds[0]):
            def later():
                notebook_setup(shell, kind, quick, device, 8 * gbatch, 3, 5, seconds, chunk)
                magic_cell(shell, ddp_line, fixed_loop())    # a first short cell: the workers now hold the model
                magic_cell(shell, ddp_line, fixed_loop())    # the cell measured
                res = shell.user_ns["dataparallel"]
                t = res.timings
                overheads.append([name, "later cell: start (pool reused)", f"{t['start']:.3f} s"])
                overheads.append([name, "later cell: weight + optimizer return", f"{t['return']:.3f} s"])
                overheads.append([name, "later cell: tensor bytes shipped / kept in workers",
                                  f"{res.shipped_bytes / 2**20:.1f} MiB / {res.cached_bytes / 2**20:.1f} MiB"])
                overheads.append([name, "later cell: bytes returned", f"{res.returned_bytes / 2**20:.1f} MiB"])
                return {}
            try:
                later()
            except Exception as exc:  # noqa: BLE001
                import traceback
                traceback.print_exc()
                overheads.append([name, "later cell", f"error: {type(exc).__name__}: {exc}"[:160]])

        def magic_with(flags: str) -> dict:
            """The %%dataparallel column with more flags, on a fresh copy of the model."""
            notebook_setup(shell, kind, quick, device, (warmup + steps) * gbatch, warmup, steps, seconds, chunk)
            r = magic_cell(shell, f"{ddp_line} {flags}", fixed_loop())
            r["samples_per_s"] = r["steps"] * gbatch / r["elapsed"]
            return r

        if kind == "transformer" and not quick:
            attempt(results, "%%dataparallel --static-graph", lambda: magic_with("--static-graph"))

        if args.compile:
            one_compiled = attempt(results, "1 GPU, torch.compile" if not quick else "1 process, torch.compile",
                                   lambda: in_process(kind, quick, device, gbatch, warmup, 10**9, seconds, chunk,
                                                      wrap=torch.compile))
            print(f"{name}: 1 GPU compiled {one_compiled}", flush=True)
            attempt(results, "DDP (hand-written) + torch.compile",
                    lambda: hand_ddp(kind, quick, world, warmup, steps, compiled="default", limit=300))
            attempt(results, "DDP(torch.compile(model)) (hand-written)",
                    lambda: hand_ddp(kind, quick, world, warmup, steps, compiled="inner-default", limit=300))

            def first_step_row(which: str) -> None:
                """From the magic's start: shipping, starting the ranks, compiling, the first step."""
                res = shell.user_ns["dataparallel"]
                first_step = res.per_rank[0].first_step
                first = (res.timings["start"] or 0.0) + (first_step if first_step is not None else float("nan"))
                overheads.append([name, f"--compile, {which} cell: first optimizer step, from the cell's start",
                                  f"{first:.1f} s"])

            def ours_compiled():
                r = magic_with("--compile")       # a new model: the ranks compile it
                first_step_row("first")
                magic_cell(shell, f"{ddp_line} --compile", fixed_loop())   # the same model, a later cell
                first_step_row("later")
                return r
            attempt(results, "%%dataparallel --compile", ours_compiled)
            attempt(results, "%%dataparallel --compile --grad-dtype bf16",
                    lambda: magic_with("--compile --grad-dtype bf16"))
            if args.cudagraphs and not quick:
                # CUDA graphs: one launch for a whole graph, for steps bound by kernel launches
                attempt(results, "1 GPU, torch.compile reduce-overhead",
                        lambda: in_process(kind, quick, device, gbatch, warmup, 10**9, seconds, chunk,
                                           wrap=lambda m: torch.compile(m, mode="reduce-overhead")))
                attempt(results, "DDP(torch.compile(model, reduce-overhead)) (hand-written)",
                        lambda: hand_ddp(kind, quick, world, warmup, steps, compiled="inner-reduce-overhead",
                                         limit=300))
                attempt(results, "%%dataparallel --compile reduce-overhead",
                        lambda: magic_with("--compile reduce-overhead"))

        def with_dp():
            notebook_setup(shell, kind, quick, device, 10**8, warmup, steps, seconds, chunk)
            r = magic_cell(shell, dp_line, bounded_loop())
            r["samples_per_s"] = r["steps"] * gbatch / r["elapsed"]
            return r
        attempt(results, "%%dataparallel --strategy dp", with_dp)
        for column, r in results:
            if "error" in r:
                rows.append([name, str(gbatch), column, "error", r["error"], "-"])
                continue
            rows.append([name, str(gbatch if "B/2" not in column else gbatch // 2), column,
                         fmt_rate(r["samples_per_s"]),
                         f"{r['samples_per_s'] / base:.2f}x" if base else "n/a", str(r["steps"])])
        shell.run_cell("for _n in ('model', 'opt', 'loader'):\n    globals().pop(_n, None)", silent=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(text_table([r for r in rows if r[0] == name], header), flush=True)

    for kind in kinds:
        one_model(kind)
    shell.run_line_magic("dataparallel", "stop")
    total = time.perf_counter() - t_start
    print()
    print(text_table(rows, header))
    print()
    print(text_table(overheads, ["model", "overhead", "value"]))
    print(f"\ntotal {total:.0f} s")
    if not args.no_record:
        title = "dataparallel.py" + (" (quick, CPU smoke run: tiny models)" if quick else "")
        append_results(title, [f"- machine: {machine(gpus)}; {versions()}",
                               f"- command: `{command('dataparallel.py', argv)}`; {total:.0f} s in all"],
                       [(header, rows), (["model", "overhead", "value"], overheads)])


if __name__ == "__main__":
    main()
