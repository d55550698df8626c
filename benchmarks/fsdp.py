"""A model too big to train on one GPU: out of memory alone and under DDP, trained by %%dataparallel --strategy fsdp.

The model is a transformer-like stack defined in the notebook: ``Net`` = an
``nn.Embedding``, ``--layers`` repeated ``Block`` s (LayerNorm, causal
self-attention through ``F.scaled_dot_product_attention``, LayerNorm, an MLP
of width ``4 x --d-model``) in an ``nn.ModuleList``, a LayerNorm and an
untied output ``nn.Linear``. By default ``--d-model 8192``, 64 heads, 12
layers, vocabulary 8192: 9.8 B parameters, 39 GB in fp32, so its training
state under AdamW (fp32 weights, gradients and two moments: 16 bytes per
parameter, 157 GB) is more than one H200 holds, before any activation. Under
FSDP over 2 GPUs each holds half of it (78 GB) plus a block's gathered
weights and the activations.

The kernel builds the model on the CPU as a notebook would, in a plain cell:
``with torch.device("meta")`` then ``to_empty(device="cpu")`` and
``init_weights`` (Linear weights uniform in +-1/sqrt(fan_in), nn.Linear's
default bound; biases 0; LayerNorm 1 and 0; embeddings N(0, 1)), drawn in
chunks by several threads, each chunk from its own seeded generator: torch's
own initialisers draw on one thread, about a minute for 39 GB. Training:
AdamW (lr ``0.25 / d_model`` unless ``--lr``), a fixed set of ``--batch``
random token sequences of ``--seq`` tokens (next-token cross entropy) read
through a ``DataLoader`` whose one batch is the whole set, so that every step
sees the same batch and the loss surely falls; under
``torch.autocast("cuda", dtype=torch.bfloat16)`` on GPUs (FSDP then gathers
parameters in bf16 and reduces gradients in fp32), in fp32 with ``--quick``.

Columns, each in a fresh Python process of its own (the memory of one is
given back before the next starts):

* ``fsdp``: an IPython ``InteractiveShell`` with gpumagic loaded, as a
  notebook: the build cell, then ``%%dataparallel --strategy fsdp
  --keep-optimizer`` over the training loop (the 78 GB of AdamW state stay
  sharded in the workers; the weights come back). Measured in the cell:
  samples/s over the steps after ``--warmup`` (CUDA-synchronised), each
  rank's ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()``
  (peak since the worker started, sharding included; ``all_gather_object``),
  the loss of every step averaged over the ranks; then every parameter's
  ``full_tensor()`` (all ranks), of which rank 0 returns a float64 sum, a sum
  of absolute values and 64 evenly strided elements. After the cell: the time
  to bring the weights back (``shell.user_ns["dataparallel"].timings["return"]``: from the
  last rank finishing the cell to the notebook's model loaded), and the check
  that the notebook's model holds the ranks' state: the same Parameter objects
  as before the cell, still on the CPU, every sampled element bitwise equal to
  the ranks', every sum within 1e-10 of the sum of absolute values, and
  every parameter changed from its initial sample;
* ``ddp``: the same build and cell under plain ``%%dataparallel`` (DDP, each
  GPU a full replica): expected to end in CUDA out of memory, which is
  recorded as its result (the rank, the cell line, the message);
* ``one``: plain PyTorch, no IPython, on one GPU (the model made on the meta
  device, materialised and initialised on cuda:0, the same loop): expected
  out of memory too.

Prints a table and appends it to ``benchmarks/RESULTS.md``; exits 1 when the
fsdp column failed, its loss did not fall or its weight check failed (an
out-of-memory ``ddp`` or ``one`` column is the expected outcome, not a
failure). ``--strategy fsdp`` moves the notebook's model into anonymous shared
memory (a memfd, not ``/dev/shm``): the host needs room for it once. Run from
the repository root::

    python benchmarks/fsdp.py            # 2 GPUs: about 4-6 minutes, the model built twice on the host
    python benchmarks/fsdp.py --columns fsdp --layers 4     # a smaller model, the fsdp column alone
    python benchmarks/fsdp.py --quick    # CPU smoke run: a tiny model, 2 gloo processes (nothing runs out of memory)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import linecache
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import _common  # also puts the checkout on sys.path
from _common import ROOT, append_results, command, machine, versions

COLUMNS = ("fsdp", "ddp", "one")
RESERVE = {"fsdp": 240.0, "ddp": 120.0, "one": 60.0}   # seconds of the budget kept for a column still to run
SAMPLES = 64       # elements compared bitwise per parameter

# The notebook's first cell (also exec'd by the one-GPU column): the model, its initialisation and the
# helpers the training cell calls.
COMMON = '''
import contextlib, math, os, time
from concurrent.futures import ThreadPoolExecutor
import torch
from torch import nn
import torch.nn.functional as F
import torch.distributed as dist


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d, heads, ff):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.fc2 = nn.Linear(ff, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Net(nn.Module):
    def __init__(self, vocab, d, heads, ff, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, heads, ff) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def init_weights(model, seed=0, threads=None, chunk=1 << 25):
    """Linear weights uniform in +-1/sqrt(fan_in) (nn.Linear's bound), biases 0, LayerNorm 1 and 0,
    embeddings N(0, 1); drawn in chunks by several threads, chunk i of parameter j from a generator
    seeded (seed, j, i): the same values for the same seed, whatever the threads."""
    index = {id(p): j for j, p in enumerate(model.parameters())}
    jobs = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            jobs.append((m.weight, "uniform", 1 / math.sqrt(m.in_features)))
            if m.bias is not None:
                jobs.append((m.bias, "zero", 0.0))
        elif isinstance(m, nn.LayerNorm):
            jobs += [(m.weight, "one", 0.0), (m.bias, "zero", 0.0)]
        elif isinstance(m, nn.Embedding):
            jobs.append((m.weight, "normal", 1.0))
        elif any(True for _ in m.parameters(recurse=False)):
            raise TypeError(f"init_weights does not know {type(m).__name__}")
    work = []
    for p, how, scale in jobs:
        flat = p.detach().view(-1)
        for i, start in enumerate(range(0, flat.numel(), chunk)):
            work.append((flat[start:start + chunk], how, scale, (seed * 1_000_003 + index[id(p)]) * 1_000_003 + i))

    def fill(item):
        part, how, scale, s = item
        if how == "uniform":
            part.uniform_(-scale, scale, generator=torch.Generator(device=part.device).manual_seed(s))
        elif how == "normal":
            part.normal_(0.0, scale, generator=torch.Generator(device=part.device).manual_seed(s))
        else:
            part.fill_(1.0 if how == "one" else 0.0)

    on_cpu = next(model.parameters()).device.type == "cpu"
    threads = threads or (min(32, os.cpu_count() or 1) if on_cpu else 1)
    with torch.no_grad(), ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, work))
    return model


def sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def mean_over_ranks(values):
    """Per-step losses averaged over the ranks (each rank's loss is its share's mean)."""
    t = torch.stack(values).float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()


def gpu_peaks():
    """Every rank's [max_memory_allocated, max_memory_reserved] in bytes (zeros without CUDA)."""
    mine = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()] \\
        if torch.cuda.is_available() and torch.cuda.is_initialized() else [0, 0]
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def checksums(model, samples=64, sums=True):
    """Per parameter: [float64 sum, float64 sum of |x|, evenly strided elements]; a sharded
    parameter is gathered first (every rank must call this, in the same order)."""
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            flat = full.reshape(-1)
            picked = flat[:: max(1, flat.numel() // samples)][:samples].tolist()
            total = float(flat.sum(dtype=torch.float64)) if sums else None
            size = float(torch.linalg.vector_norm(flat, 1, dtype=torch.float64)) if sums else None
            out[name.removeprefix("module.")] = [total, size, picked]
            del full, flat
    return out
'''

# The notebook's build cell: formatted with the run's sizes.
BUILD = """
torch.manual_seed(0)
with torch.device("meta"):
    model = Net({vocab}, {d}, {heads}, {ff}, {layers})
model.to_empty(device="{where}")
init_weights(model, seed=0)
opt = torch.optim.AdamW(model.parameters(), lr={lr})
tokens = torch.randint(0, {vocab}, ({batch}, {seq} + 1), generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size={batch})
DEVICE, STEPS, WARMUP, SAMPLES = {device!r}, {steps}, {warmup}, {samples}
"""

# The training cell: one batch per epoch (the whole fixed set), so one optimizer step per epoch.
TRAIN = """losses = []
done = 0
for epoch in range(STEPS):
    for (batch,) in loader:
        if done == WARMUP:
            sync()
            t0 = time.perf_counter()
        batch = batch.to(DEVICE)
        with {autocast}:
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        done += 1
sync()
elapsed = time.perf_counter() - t0
del logits, loss
losses = mean_over_ranks(losses)
peaks = gpu_peaks()
"""

# Appended to the fsdp column's cell: what the ranks hold, gathered for the check after the cell.
CHECK = "checks = checksums(model, SAMPLES)\n"


# ------------------------------------------------------------------ sizes

def settings(opts) -> dict:
    """The model and run sizes, --quick or not; the per-run defaults filled in."""
    quick = opts.quick
    d = opts.d_model or (64 if quick else 8192)
    s = {
        "d": d, "layers": opts.layers or (3 if quick else 12), "vocab": opts.vocab or (256 if quick else 8192),
        "heads": max(1, d // (16 if quick else 128)), "ff": 4 * d,
        "seq": opts.seq or (32 if quick else 512), "batch": opts.batch or 8,
        "steps": opts.steps or (8 if quick else 12), "warmup": opts.warmup or (2 if quick else 3),
        "lr": opts.lr or 0.25 / d, "nprocs": opts.nprocs,
    }
    s["params"] = param_count(s)
    return s


def param_count(s: dict) -> int:
    d, ff, v = s["d"], s["ff"], s["vocab"]
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)
    return s["layers"] * block + v * d + 2 * d + d * v


def build_cell(s: dict, where: str, device: str) -> str:
    return BUILD.format(where=where, device=device, samples=SAMPLES,
                        **{k: s[k] for k in ("vocab", "d", "heads", "ff", "layers", "lr", "batch", "seq", "steps",
                                             "warmup")})


def train_cell(quick: bool, check: bool = False) -> str:
    autocast = "contextlib.nullcontext()" if quick else 'torch.autocast("cuda", dtype=torch.bfloat16)'
    return TRAIN.format(autocast=autocast) + (CHECK if check else "")


def gib(n) -> str:
    from gpumagic.display import fmt_bytes
    return fmt_bytes(n)


def count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


# ------------------------------------------------------------------ the columns (each in a child process)

def oom_outcome(exc: BaseException) -> dict:
    """A failed cell or loop as a result: out of memory (where, and the message) or another error."""
    from gpumagic.errors import WorkerError
    if isinstance(exc, WorkerError):
        kind, message, tb = exc.exc_type, exc.message, exc.remote_traceback
        rank = exc.rank
    else:
        kind, message, tb = type(exc).__name__, str(exc), "".join(traceback.format_exception(exc))
        rank = None
    oom = "OutOfMemoryError" in kind or "out of memory" in message.lower()
    lines = tb.splitlines()
    # The cell's own line that was running: the first frame of the cell's code in the traceback.
    where = next((lines[i + 1].strip() for i, line in enumerate(lines[:-1])
                  if line.lstrip().startswith(("Cell In[", 'File "<benchmark-cell>"'))), None)
    first = (message.strip().splitlines() or [""])[0]
    return {"outcome": "out of memory" if oom else "failed", "exc_type": kind, "rank": rank, "where": where,
            "message": first[:300]}


def run_magic(shell, line: str, body: str) -> None:
    """``%%dataparallel line`` over ``body``, its output shown after it (the tail, also on failure)."""
    from IPython.utils.capture import capture_output
    cap = None
    try:
        with capture_output() as cap:
            shell.run_cell_magic("dataparallel", line, body)
    finally:
        if cap is not None:
            shown = (cap.stdout + cap.stderr).strip().splitlines()
            print(f"--- %%dataparallel {line}: what the cell showed ({len(shown)} lines, last 30)")
            print("\n".join("  | " + x for x in shown[-30:]), flush=True)


def notebook(opts, s: dict):
    """A shell as a notebook's, with the model built by a plain cell; (shell, seconds the build took)."""
    shell = _common.make_shell()
    result = shell.run_cell(COMMON, silent=True)
    result.raise_error()
    if opts.quick:
        shell.user_ns["torch"].set_num_threads(1)   # as each of the 2 CPU ranks gets on 2 cores
    t0 = time.perf_counter()
    result = shell.run_cell(build_cell(s, "cpu", "cpu" if opts.quick else "cuda"), silent=True)
    result.raise_error()
    build = time.perf_counter() - t0
    print(f"kernel: model of {count(s['params'])} parameters built on the CPU in {build:.1f} s", flush=True)
    return shell, build


def devices_line(opts) -> str:
    return f"--devices cpu --nprocs {opts.nprocs}" if opts.quick else f"--nprocs {opts.nprocs}"


def trained(ns: dict, s: dict) -> dict:
    """What the training cell reports (rank 0's values, the losses and peaks over all ranks)."""
    timed = ns["done"] - s["warmup"]
    rate = timed * s["batch"] / ns["elapsed"]
    return {"outcome": "trained", "samples_per_s": rate, "tokens_per_s": rate * s["seq"], "steps": ns["done"],
            "steps_timed": timed, "elapsed": ns["elapsed"], "losses": ns["losses"], "peaks": ns["peaks"]}


def column_fsdp(opts, s: dict) -> dict:
    shell, build = notebook(opts, s)
    ns = shell.user_ns
    model = ns["model"]
    checksums = ns["checksums"]
    before = list(model.parameters())
    initial = checksums(model, SAMPLES, sums=False)
    line = f"--strategy fsdp {devices_line(opts)} --keep-optimizer"
    t0 = time.perf_counter()
    try:
        run_magic(shell, line, train_cell(opts.quick, check=True))
    except Exception as exc:  # noqa: BLE001 - reported as the column's result
        traceback.print_exc()
        return {**oom_outcome(exc), "build_s": build, "line": line}
    wall = time.perf_counter() - t0
    res = shell.user_ns["dataparallel"]
    out = trained(ns, s)
    out.update(build_s=build, line=line, wall=wall, timings=dict(res.timings), stayed=list(res.stayed),
               shipped_bytes=res.shipped_bytes, returned_bytes=res.returned_bytes,
               per_rank={str(k): dataclasses.asdict(v) for k, v in res.per_rank.items()})
    # The notebook's model against what the ranks held after training.
    t1 = time.perf_counter()
    now = list(model.parameters())
    theirs = ns["checks"]
    mine = checksums(model, SAMPLES)
    names = list(mine)
    out["check"] = {
        "model_same_object": ns["model"] is model,
        "same_parameters": len(now) == len(before) and all(a is b for a, b in zip(before, now)),
        "on_cpu": all(p.device.type == "cpu" for p in now),
        "parameters": len(names),
        "missing": sorted(set(theirs) ^ set(mine)),
        "samples_equal": sum(1 for n in names if n in theirs and mine[n][2] == theirs[n][2]),
        "sums_close": sum(1 for n in names if n in theirs
                          and abs(mine[n][0] - theirs[n][0]) <= 1e-10 * max(mine[n][1], 1e-30)),
        "max_sum_diff": max((abs(mine[n][0] - theirs[n][0]) / max(mine[n][1], 1e-30)
                             for n in names if n in theirs), default=None),
        "changed": sum(1 for n in names if mine[n][2] != initial[n][2]),
        "seconds": time.perf_counter() - t1,
    }
    import resource
    out["kernel_max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shell.run_line_magic("dataparallel", "stop")
    return out


def column_ddp(opts, s: dict) -> dict:
    shell, build = notebook(opts, s)
    line = devices_line(opts)
    try:
        run_magic(shell, line, train_cell(opts.quick))
    except Exception as exc:  # noqa: BLE001 - out of memory is the expected result on GPUs
        print(f"%%dataparallel {line}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        out = {**oom_outcome(exc), "build_s": build, "line": line}
    else:
        out = {**trained(shell.user_ns, s), "build_s": build, "line": line}
    shell.run_line_magic("dataparallel", "stop")
    return out


def column_one(opts, s: dict) -> dict:
    """Plain PyTorch in this process on one device: the model made there, the same loop."""
    ns: dict = {"__name__": "__main__"}
    exec(COMMON, ns)
    torch = ns["torch"]
    device = "cpu" if opts.quick else "cuda:0"
    if opts.quick:
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    exec(build_cell(s, device, device), ns)
    build = time.perf_counter() - t0
    print(f"one device: model built on {device} in {build:.1f} s", flush=True)
    source = train_cell(opts.quick)
    linecache.cache["<benchmark-cell>"] = (len(source), None, source.splitlines(True), "<benchmark-cell>")
    try:
        exec(compile(source, "<benchmark-cell>", "exec"), ns)
    except Exception as exc:  # noqa: BLE001 - out of memory is the expected result on a GPU
        out = {**oom_outcome(exc), "build_s": build}
        if torch.cuda.is_available():
            out["peaks"] = [[torch.cuda.max_memory_allocated(0), torch.cuda.max_memory_reserved(0)]]
        print(f"one device: {out['outcome']}: {out['exc_type']}: {out['message'][:200]}", flush=True)
        return out
    return {**trained(ns, s), "build_s": build}


def child_main(opts) -> None:
    """One column in this process; its result (or error) as JSON in opts.result."""
    s = settings(opts)
    try:
        out = {"fsdp": column_fsdp, "ddp": column_ddp, "one": column_one}[opts.child](opts, s)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which goes on
        traceback.print_exc()
        out = {"outcome": "failed", "error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
        code = 1
    with open(opts.result, "w") as f:
        json.dump(out, f, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------ the run

def run_column(opts, column: str, workdir: str, argv: list, limit: float) -> dict:
    """One column in a child process (its own session: it, its pool and ranks killed together at the end)."""
    result = os.path.join(workdir, f"{column}.json")
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", column, "--result", result]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if column == "one" and not opts.quick:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    print(f"\n===== {column} (at most {limit:.0f} s) =====", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    timed_out = False
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        rc = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    took = time.monotonic() - t0
    if timed_out:
        out = {"outcome": "failed", "error": f"no result after {limit:.0f} s (killed)"}
    else:
        try:
            with open(result) as f:
                out = json.load(f)
        except (OSError, ValueError):
            out = {"outcome": "failed", "error": f"exit status {rc}, no result written"}
    out["process_s"] = took
    print(f"===== {column}: {out['outcome']} ({took:.0f} s)", flush=True)
    return out


def loss_text(r: dict) -> str:
    losses = r.get("losses")
    return f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "-"


def peaks_text(r: dict, which: int) -> str:
    peaks = r.get("peaks")
    if not peaks or not any(p[which] for p in peaks):
        return "n/a"
    return " / ".join(gib(p[which]) for p in peaks)


def result_text(r: dict) -> str:
    if r["outcome"] == "trained":
        return "trained"
    if r["outcome"] == "out of memory":
        rank = f"rank {r['rank']}, " if r.get("rank") is not None else ""
        return f"out of memory ({rank}at `{r.get('where') or '?'}`)"
    return f"failed: {r.get('error') or (r.get('exc_type', '') + ': ' + r.get('message', ''))}"[:160]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny model, 2 gloo processes")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default 12; quick 3)")
    parser.add_argument("--d-model", type=int, default=None, help="model width (default 8192; quick 64)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (default 8192; quick 256)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512; quick 32)")
    parser.add_argument("--batch", type=int, default=None, help="global batch in sequences (default 8)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 12; quick 8)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the timed ones (default 3; quick 2)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 0.25 / d_model)")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks (GPUs) of the %%%%dataparallel columns")
    parser.add_argument("--columns", default=",".join(COLUMNS), help="which of fsdp,ddp,one, in that order")
    parser.add_argument("--budget", type=float, default=460.0,
                        help="seconds for all columns together (default 460): a column may take what is left of "
                             "it less what the columns after it are kept (ddp 120 s, one 60 s)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--child", choices=COLUMNS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parser.parse_args(argv)
    if opts.child:
        child_main(opts)
        return

    s = settings(opts)
    if not 1 <= s["warmup"] < s["steps"]:
        sys.exit(f"--warmup {s['warmup']} must be at least 1 and below --steps {s['steps']}")
    if s["batch"] % s["nprocs"]:
        sys.exit(f"--batch {s['batch']} must be a multiple of --nprocs {s['nprocs']}")
    if s["d"] % s["heads"]:
        sys.exit(f"--d-model {s['d']} must be a multiple of {s['d'] // s['heads']} (the head size)")
    columns = [c.strip() for c in opts.columns.split(",") if c.strip()]
    for c in columns:
        if c not in COLUMNS:
            sys.exit(f"--columns {c!r}: one of {', '.join(COLUMNS)}")
    columns = [c for c in COLUMNS if c in columns]

    from gpumagic import devices
    from gpumagic.display import text_table
    gpus = devices.visible_gpus()
    if not opts.quick and len(gpus) < opts.nprocs:
        sys.exit(f"needs {opts.nprocs} GPUs (or --quick for a CPU smoke run)")
    state = 16 * s["params"]
    print(f"model: {s['layers']} blocks, d_model {s['d']}, {s['heads']} heads, MLP {s['ff']}, vocabulary "
          f"{s['vocab']}: {count(s['params'])} parameters, {gib(4 * s['params'])} in fp32; AdamW training "
          f"state {gib(state)} (16 bytes a parameter), {gib(state / s['nprocs'])} a GPU sharded over "
          f"{s['nprocs']}", flush=True)
    print(f"machine: {machine(gpus)}; {versions()}", flush=True)

    header = ["column", "result", "samples/s", "tokens/s", "peak allocated, per GPU", "peak reserved, per GPU",
              "loss, first -> last step", "weights back in"]
    names = {"fsdp": f"%%dataparallel --strategy fsdp --keep-optimizer, {s['nprocs']} "
                     + ("CPU processes" if opts.quick else "GPUs"),
             "ddp": f"%%dataparallel (DDP), {s['nprocs']} " + ("CPU processes" if opts.quick else "GPUs"),
             "one": "1 CPU process, plain PyTorch" if opts.quick else "1 GPU, plain PyTorch"}
    t_start = time.perf_counter()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpumagic-fsdp-") as workdir:
        for i, column in enumerate(columns):
            # What is left of the budget, less what the columns after this one are kept.
            left = opts.budget - (time.perf_counter() - t_start)
            limit = max(60.0, left - sum(RESERVE[c] for c in columns[i + 1:]))
            results[column] = run_column(opts, column, workdir, argv, limit)

    rows, details, failed = [], [], []
    for column in columns:
        r = results[column]
        back = r.get("timings", {}).get("return")
        rate = r.get("samples_per_s")
        rows.append([names[column], result_text(r), f"{rate:,.1f}" if rate else "-",
                     f"{r['tokens_per_s']:,.0f}" if rate else "-", peaks_text(r, 0), peaks_text(r, 1),
                     loss_text(r), f"{back:.1f} s" if back is not None else "-"])
        if r["outcome"] == "out of memory":
            details.append([names[column], "out of memory", f"{r['exc_type']}: {r['message'][:200]}"])
        if "build_s" in r:
            where = "on " + ("the CPU" if opts.quick else "cuda:0") if column == "one" else "in the kernel (CPU)"
            details.append([names[column], f"model built {where} in", f"{r['build_s']:.1f} s"])
    fs = results.get("fsdp")
    if fs is not None:
        if fs["outcome"] != "trained":
            failed.append(f"the fsdp column did not train: {result_text(fs)}")
        else:
            t, c = fs["timings"], fs["check"]
            flops = 6 * s["params"] * fs["tokens_per_s"] / s["nprocs"]
            details += [
                [names["fsdp"], "model TFLOP/s per GPU (6 x parameters x tokens/s)", f"{flops / 1e12:.3g}"],
                [names["fsdp"], "cell: pool start / ship model and start ranks / run / weight return",
                 " / ".join(f"{t[k]:.1f} s" if t.get(k) is not None else "n/a"
                            for k in ("pool_start", "start", "run", "return"))],
                [names["fsdp"], "cell: tensor bytes through the pool's buffer, out / back (the model: shared memory)",
                 f"{gib(fs['shipped_bytes'])} / {gib(fs['returned_bytes'])}"],
                [names["fsdp"], "state left in the workers", ", ".join(fs["stayed"]) or "none"],
                [names["fsdp"], "kernel peak RSS", gib(fs["kernel_max_rss"])],
                [names["fsdp"], "weights check: parameters, bitwise-equal samples, sums within 1e-10, changed",
                 f"{c['parameters']}, {c['samples_equal']}, {c['sums_close']} (largest {c['max_sum_diff']:.1e}), "
                 f"{c['changed']}"],
                [names["fsdp"], "weights check: same model and Parameter objects, on the CPU",
                 f"{c['model_same_object'] and c['same_parameters']}, {c['on_cpu']}"],
            ]
            n = c["parameters"]
            if not (c["model_same_object"] and c["same_parameters"] and c["on_cpu"] and not c["missing"]
                    and c["samples_equal"] == n and c["sums_close"] == n and c["changed"] == n):
                failed.append(f"weights check failed: {c}")
            if not fs["losses"][-1] < fs["losses"][0]:
                failed.append(f"the loss did not fall: {fs['losses']}")
    if not opts.quick:
        for column in ("ddp", "one"):
            r = results.get(column)
            if r is not None and r["outcome"] != "out of memory":
                print(f"NOTE: {names[column]} was expected to run out of memory; it {result_text(r)}")
    total = time.perf_counter() - t_start
    print()
    print(text_table(rows, header))
    print()
    print(text_table(details, ["column", "what", "value"]))
    for line in failed:
        print(f"FAILED: {line}")
    print(f"\ntotal {total:.0f} s")
    if not opts.no_record:
        title = "fsdp.py" + (" (quick, CPU smoke run: tiny model, fp32, nothing runs out of memory)"
                             if opts.quick else "")
        setup = (f"- model: {s['layers']} blocks, d_model {s['d']}, {s['heads']} heads, MLP {s['ff']}, vocabulary "
                 f"{s['vocab']}: {count(s['params'])} parameters ({gib(4 * s['params'])} fp32; AdamW training "
                 f"state {gib(state)}); global batch {s['batch']} x {s['seq']} tokens, {s['steps']} steps, samples/s "
                 f"over the last {s['steps'] - s['warmup']}, AdamW lr {s['lr']:.2g}, "
                 + ("fp32" if opts.quick else "bf16 autocast") + "; peaks are torch.cuda.max_memory_allocated / "
                 "max_memory_reserved of each rank")
        append_results(title, [f"- machine: {machine(gpus)}; {versions()}",
                               f"- command: `{command('fsdp.py', argv)}`; {total:.0f} s in all", setup,
                               *[f"- FAILED: {x}" for x in failed]],
                       [(header, rows), (["column", "what", "value"], details)])
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
