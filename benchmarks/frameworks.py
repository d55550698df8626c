"""A Hugging Face Trainer on 2 GPUs: %%dataparallel against accelerate's notebook_launcher and one GPU.

The model is randomly initialised, nothing is downloaded (no ``from_pretrained``,
no tokenizer): GPT-2 small by default (``GPT2Config(n_layer=12, n_embd=768,
n_head=12, n_positions=512)``, ``GPT2LMHeadModel``, 124 M parameters), or with
``--model bert`` BERT base (``BertForMaskedLM(BertConfig())``, 110 M), trained
by ``transformers.Trainer`` on sequences of 512 random tokens with
``labels=input_ids``, bf16 (``bf16=True``), AdamW, per-device batch 8, a fixed
``max_steps``, ``ddp_find_unused_parameters=False`` (every parameter is used;
the Trainer's default for a ``PreTrainedModel`` is True, which costs a graph
walk per step). Every column runs the same training code, with the same
per-device batch and steps, in a process of its own (a failure in one column
does not stop the others):

* ``1 GPU``: a fresh Python with ``CUDA_VISIBLE_DEVICES=0`` makes the model,
  the data and the ``TrainingArguments``, then runs the Trainer;
* ``notebook_launcher``: a fresh Python, as a kernel that has not touched CUDA
  (accelerate's condition for its fork), makes the model and the data and
  calls ``accelerate.notebook_launcher(train_fn, num_processes=2)``;
  ``train_fn`` makes the ``TrainingArguments`` and runs the Trainer;
* ``%%dataparallel``: a fresh Python with an IPython ``InteractiveShell`` and
  gpumagic loaded, as a notebook: one cell makes the model, the data and the
  ``TrainingArguments`` (which initialises CUDA in the kernel on a GPU
  machine: the case notebook_launcher refuses), then a ``%%dataparallel
  --nprocs 2`` cell builds the Trainer and trains (launch mode: gpumagic's
  ranks run it as torchrun processes would); the same cell is run again
  (``later cell``: the pool is warm, the weights already in the workers).

samples/s is global (both GPUs) and is taken by a ``TrainerCallback`` on rank
0: the wall time from the end of optimizer step ``--warmup`` to the end of the
last step, CUDA synchronised at both ends, so the first steps (allocator,
cuBLAS and NCCL set-up) are not counted. ``to first step`` is from the call
(of the function that builds the Trainer and trains, in the 1 GPU script; of
``notebook_launcher``; the cell starting) to the end of the first optimizer
step, wall clock; ``wall`` from that call to its return (for
``%%dataparallel`` that includes loading rank 0's weights into the notebook's
model). The model and data exist before each call; the
``TrainingArguments`` too, except under notebook_launcher, where they may only
be made inside ``train_fn``.

``--quick`` runs the same on the CPU: tiny configs, 12 steps (4 warm-up), no
bf16, gloo; the notebook_launcher process gets ``ACCELERATE_USE_CPU=true``,
as ``accelerate launch --cpu`` sets (without it each CPU process trains
alone, world size 1). A column whose Trainer saw another world size, device
or precision than meant counts as failed.

Floors checked (printed, not an exit status): ``%%dataparallel`` at least
notebook_launcher's samples/s, and at least 1.8x one GPU's where the model
is compute-bound. Prints a table and appends it to ``benchmarks/RESULTS.md``;
exits 1 when a column failed. Run from the repository root::

    python benchmarks/frameworks.py                     # 2 GPUs, GPT-2: about 2-3 minutes
    python benchmarks/frameworks.py --model gpt2,bert   # both shapes
    python benchmarks/frameworks.py --quick             # CPU smoke run: tiny GPT-2, 2 gloo processes
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback

import _common  # also puts the checkout on sys.path
from _common import ROOT, append_results, command, machine, versions

# Shared by the three columns: exec'd in the 1 GPU and notebook_launcher processes, run as the
# notebook's first cell under %%dataparallel (so the classes and functions are the notebook's own).
COMMON = '''
import json, os, tempfile, time
import torch
import transformers


class RandomTokens(torch.utils.data.Dataset):
    """Sequences of random tokens, made once; each sample its own labels (causal or masked LM)."""

    def __init__(self, count, length, vocab, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (count, length), generator=gen)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        row = self.tokens[i]
        return {"input_ids": row, "labels": row}


def make_model(kind, quick):
    """A randomly initialised model (nothing downloaded) and its sequence length and vocabulary."""
    torch.manual_seed(0)
    if kind == "gpt2":
        if quick:
            config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=512)
        else:
            config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=512)
        return transformers.GPT2LMHeadModel(config), config.n_positions, config.vocab_size
    if kind == "bert":
        if quick:
            config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=128, vocab_size=512, max_position_embeddings=64)
        else:
            config = transformers.BertConfig()       # BERT base: 12 layers, 768 wide, 512 positions
        return transformers.BertForMaskedLM(config), config.max_position_embeddings, config.vocab_size
    raise ValueError(kind)


def make_args(output_dir, batch, steps, bf16):
    return transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=batch, max_steps=steps, bf16=bf16,
        learning_rate=1e-4, report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, ddp_find_unused_parameters=False)


def sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepTimer(transformers.TrainerCallback):
    """Times optimizer steps: the first (wall clock), and the window from step WARMUP to the last."""

    def __init__(self, warmup):
        self.warmup = warmup
        self.marks = {}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (1, self.warmup, state.max_steps):   # the only steps that wait for the GPU
            sync()
            self.marks[state.global_step] = (time.time(), time.perf_counter())

    def report(self, trainer, output):
        """Plain values (they come back from a %%dataparallel cell): samples/s over the timed window."""
        args, last = trainer.args, trainer.state.global_step
        elapsed = self.marks[last][1] - self.marks[self.warmup][1]
        per_step = args.per_device_train_batch_size * max(1, args.n_gpu) * args.world_size \\
            * args.gradient_accumulation_steps
        model = trainer.model
        return {"samples_per_s": (last - self.warmup) * per_step / elapsed, "elapsed": elapsed,
                "steps_timed": last - self.warmup, "steps": last, "global_batch": per_step,
                "t_first_step": self.marks[1][0], "t_last_step": self.marks[last][0],
                "world_size": args.world_size, "n_gpu": args.n_gpu,
                "rank": args.process_index, "device": str(args.device), "bf16": bool(args.bf16),
                "mixed_precision": str(trainer.accelerator.mixed_precision),
                "optim": str(getattr(args.optim, "value", args.optim)),
                "attention": str(getattr(model.config, "_attn_implementation", "?")),
                "train_runtime": float(output.metrics.get("train_runtime", float("nan"))),
                "cuda_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30
                if torch.cuda.is_available() and torch.cuda.is_initialized() else 0.0}
'''

# The training itself: the %%dataparallel cell as it stands, the body of run_training() elsewhere.
TRAIN_CELL = """\
timer = StepTimer(WARMUP)
trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
output = trainer.train()
stats = timer.report(trainer, output)
"""

TRAIN_FUNCTION = ("def run_training(model, data, args, WARMUP):\n" + textwrap.indent(TRAIN_CELL, "    ")
                  + "    return stats\n")

# notebook_launcher's function: the TrainingArguments made inside it, as accelerate asks.
LAUNCHER_FUNCTION = '''
def train_fn(model, data, output_dir, batch, steps, bf16, warmup, result_path):
    args = make_args(output_dir, batch, steps, bf16)
    stats = run_training(model, data, args, warmup)
    if args.process_index == 0:
        with open(result_path, "w") as f:
            json.dump(stats, f)
'''

COLUMNS = ("single", "launcher", "dataparallel")
RESULT_TAG = "FRAMEWORKS_RESULT "


def settings(args) -> dict:
    """Per-device batch, steps, warm-up, bf16, for the run's mode."""
    if args.quick:
        return {"batch": args.batch or 4, "steps": args.steps or 12, "warmup": args.warmup or 4, "bf16": False}
    return {"batch": args.batch or 8, "steps": args.steps or 110, "warmup": args.warmup or 10, "bf16": True}


# ------------------------------------------------------------------ the columns (each in a child process)

def child_namespace(quick: bool) -> dict:
    ns: dict = {"__name__": "__main__"}
    exec(COMMON + TRAIN_FUNCTION + LAUNCHER_FUNCTION, ns)
    if quick:
        # One torch thread per process, as each of the 2 CPU ranks of the other columns gets on 2 cores.
        ns["torch"].set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    return ns


def samples_needed(s, nprocs) -> int:
    return (s["steps"] + 1) * s["batch"] * max(2, nprocs)    # no epoch ends inside the run


def data_for(ns, model_kind, quick, s, nprocs) -> tuple:
    model, length, vocab = ns["make_model"](model_kind, quick)
    count = samples_needed(s, nprocs)
    return model, ns["RandomTokens"](count, length, vocab)


def column_single(opts, s, workdir) -> dict:
    ns = child_namespace(opts.quick)
    model, data = data_for(ns, opts.model, opts.quick, s, opts.nprocs)
    args = ns["make_args"](os.path.join(workdir, "single"), s["batch"], s["steps"], s["bf16"])
    t_call = time.time()
    stats = ns["run_training"](model, data, args, s["warmup"])
    t_return = time.time()
    return timed(stats, t_call, t_return)


def timed(stats: dict, t_call: float, t_return: float) -> dict:
    """Wall-clock figures from the call (t_call) and its return, and the rank's step times."""
    stats["wall"] = t_return - t_call
    stats["to_first_step"] = stats["t_first_step"] - t_call
    stats["after_last_step"] = t_return - stats["t_last_step"]
    return stats


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def column_launcher(opts, s, workdir) -> dict:
    ns = child_namespace(opts.quick)
    import torch
    from accelerate import notebook_launcher
    model, data = data_for(ns, opts.model, opts.quick, s, opts.nprocs)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before notebook_launcher: the benchmark is wrong")
    result_path = os.path.join(workdir, "launcher-rank0.json")
    t_call = time.time()
    notebook_launcher(ns["train_fn"], args=(model, data, os.path.join(workdir, "launcher"), s["batch"], s["steps"],
                                            s["bf16"], s["warmup"], result_path),
                      num_processes=opts.nprocs, use_port=str(free_port()))
    t_return = time.time()
    with open(result_path) as f:
        stats = json.load(f)
    return timed(stats, t_call, t_return)


def column_dataparallel(opts, s, workdir) -> dict:
    from IPython.utils.capture import capture_output

    shell = _common.make_shell()
    setup = f"""
model, _length, _vocab = make_model({opts.model!r}, {opts.quick!r})
data = RandomTokens({samples_needed(s, opts.nprocs)}, _length, _vocab)
args = make_args({os.path.join(workdir, 'dataparallel')!r}, {s['batch']}, {s['steps']}, {s['bf16']})
WARMUP = {s['warmup']}
kernel_device = str(args.device)
kernel_cuda_initialised = torch.cuda.is_initialized()
"""
    for code in (COMMON, setup):
        result = shell.run_cell(code, silent=True)
        result.raise_error()
    if opts.quick:
        shell.user_ns["torch"].set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    ns = shell.user_ns
    line = f"--nprocs {opts.nprocs}"
    out = {"kernel_device": ns["kernel_device"], "kernel_cuda_initialised": ns["kernel_cuda_initialised"]}
    try:
        for which in ("first", "later"):
            ns.pop("stats", None)
            t_call = time.time()
            cap = None
            try:
                with capture_output() as cap:
                    shell.run_cell_magic("dataparallel", line, TRAIN_CELL)
            finally:
                if cap is not None:     # also when the cell failed: the ranks' output says why
                    shown = (cap.stdout + cap.stderr).strip().splitlines()
                    print(f"--- %%dataparallel {line}, {which} cell: what the cell showed ({len(shown)} lines, "
                          "last 40)")
                    print("\n".join("  | " + x for x in shown[-40:]), flush=True)
            t_return = time.time()
            res = shell.user_ns["dataparallel"]
            stats = timed(dict(ns["stats"]), t_call, t_return)
            stats["timings"] = dict(res.timings)
            stats["rank0_first_step"] = res.per_rank[0].first_step
            stats["shipped_mib"] = res.shipped_bytes / 2**20
            stats["cached_mib"] = res.cached_bytes / 2**20
            stats["returned_mib"] = res.returned_bytes / 2**20
            stats["devices"] = list(res.devices)
            out[which] = stats
            print(f"{which} cell: gpumagic timings {res.timings}, rank 0 first_step {stats['rank0_first_step']}",
                  flush=True)
    finally:
        shell.run_line_magic("dataparallel", "stop")
    return out


def child_main(opts) -> None:
    """One column in this process; its result (or error) as JSON in opts.result."""
    s = settings(opts)
    try:
        fn = {"single": column_single, "launcher": column_launcher, "dataparallel": column_dataparallel}[opts.child]
        out = fn(opts, s, opts.workdir)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which goes on
        traceback.print_exc()
        out = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"}
        code = 1
    with open(opts.result, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # no waiting on threads a framework left behind


# ------------------------------------------------------------------ the run

def child_env(quick: bool, column: str) -> dict:
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), "PYTHONUNBUFFERED": "1"}
    env.setdefault("HF_HUB_OFFLINE", "1")         # nothing is downloaded; never wait on a network
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if column == "single" and not quick:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    if column == "launcher" and quick:
        # accelerate launch --cpu sets this; without it each CPU process trains alone (world size 1)
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def run_column(opts, column: str, model_kind: str, workdir: str, argv: list) -> dict:
    """One column in a child process with a deadline; its JSON result, or {"error": ...}."""
    result = os.path.join(workdir, f"{model_kind}-{column}.json")
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", column, "--model", model_kind,
           "--workdir", workdir, "--result", result]
    print(f"\n===== {model_kind}: {column} =====", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(opts.quick, column), start_new_session=True)
    try:
        rc = proc.wait(timeout=opts.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)    # the child's session: it, its ranks, its pool
        proc.wait()
        return {"error": f"no result after {opts.timeout:.0f} s (killed)"}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # anything it left running (pool workers, launcher ranks)
        except ProcessLookupError:
            pass
    took = time.monotonic() - t0
    try:
        with open(result) as f:
            out = json.load(f)
    except (OSError, ValueError):
        out = {"error": f"exit status {rc}, no result written"}
    if "error" not in out and rc != 0:
        out = {"error": f"exit status {rc}"}
    out["process_seconds"] = took
    print(f"===== {model_kind}: {column}: " + (f"FAILED: {out['error']}" if "error" in out else "ok")
          + f" ({took:.0f} s)", flush=True)
    return out


def check(out: dict, world: int, device_type: str, bf16: bool) -> dict:
    """A column that ran but not as meant (wrong world size, device or precision) is an error too."""
    if "error" in out:
        return out
    if out.get("mixed_precision") != ("bf16" if bf16 else "no"):
        return {**out, "error": f"trained with mixed precision {out.get('mixed_precision')!r}, expected "
                                f"{'bf16' if bf16 else 'no'}"}
    if out.get("world_size") != world or not str(out.get("device", "")).startswith(device_type) \
            or out.get("n_gpu", 0) > 1:
        return {**out, "error": f"trained with world size {out.get('world_size')}, n_gpu {out.get('n_gpu')} on "
                                f"{out.get('device')}; expected world size {world} on {device_type}"}
    return out


def fmt(x, spec=",.0f", unit="") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, 2 gloo processes")
    parser.add_argument("--model", default="gpt2", help="gpt2, bert, or both: gpt2,bert (default gpt2)")
    parser.add_argument("--batch", type=int, default=None, help="per-device batch (default 8; quick 4)")
    parser.add_argument("--steps", type=int, default=None, help="max_steps (default 110; quick 12)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps before the timed window (default 10; quick 4)")
    parser.add_argument("--nprocs", type=int, default=2, help="processes (GPUs) of the distributed columns")
    parser.add_argument("--columns", default=",".join(COLUMNS), help="which of single,launcher,dataparallel")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per column (default 300)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--child", choices=COLUMNS, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parser.parse_args(argv)
    if opts.child:
        child_main(opts)
        return

    s = settings(opts)
    if not 1 <= s["warmup"] < s["steps"]:
        sys.exit(f"--warmup {s['warmup']} must be at least 1 and below --steps {s['steps']}")
    opts.timeout = opts.timeout or 300.0
    kinds = [k.strip() for k in opts.model.split(",") if k.strip()]
    columns = [c.strip() for c in opts.columns.split(",") if c.strip()]
    for k in kinds:
        if k not in ("gpt2", "bert"):
            sys.exit(f"--model {k!r}: gpt2 or bert")
    for c in columns:
        if c not in COLUMNS:
            sys.exit(f"--columns {c!r}: one of {', '.join(COLUMNS)}")

    from gpumagic import devices
    from gpumagic.display import text_table
    gpus = devices.visible_gpus()
    if not opts.quick and len(gpus) < opts.nprocs:
        sys.exit(f"needs {opts.nprocs} GPUs (or --quick for a CPU smoke run)")
    device_type = "cpu" if opts.quick else "cuda"
    # What the children get: the run's own options, less --model (each child gets one).
    child_argv = [a for a in argv]
    if "--model" in child_argv:
        i = child_argv.index("--model")
        del child_argv[i:i + 2]
    child_argv = [a for a in child_argv if not a.startswith("--model=")]

    one = "1 GPU" if not opts.quick else "1 process"
    multi = f"{opts.nprocs} GPUs" if not opts.quick else f"{opts.nprocs} CPU processes"
    names = {"single": one, "launcher": f"notebook_launcher, {multi}", "dataparallel": f"%%dataparallel, {multi}"}
    header = ["model", "column", "global batch", "samples/s", "vs 1 GPU", "vs notebook_launcher",
              "to first step", "wall"]
    rows, overheads, floors, failed = [], [], [], []
    t_start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="gpumagic-frameworks-")
    try:
        for kind in kinds:
            name = {"gpt2": "GPT-2 124M" if not opts.quick else "GPT-2 (tiny)",
                    "bert": "BERT base MLM" if not opts.quick else "BERT MLM (tiny)"}[kind]
            res = {}
            for column in columns:
                out = run_column(opts, column, kind, workdir, child_argv)
                if column == "dataparallel" and "error" not in out:
                    first = check(out["first"], opts.nprocs, device_type, s["bf16"])
                    later = check(out["later"], opts.nprocs, device_type, s["bf16"])
                    res["dataparallel"], res["dataparallel-later"] = first, later
                    res["dataparallel-meta"] = out
                else:
                    res[column] = check(out, 1 if column == "single" else opts.nprocs, device_type, s["bf16"])
            base = res.get("single", {}).get("samples_per_s")
            launcher = res.get("launcher", {}).get("samples_per_s")
            order = [("single", names["single"]), ("launcher", names["launcher"]),
                     ("dataparallel", names["dataparallel"] + ", first cell"),
                     ("dataparallel-later", names["dataparallel"] + ", later cell")]
            for key, label in order:
                if key not in res:
                    continue
                r = res[key]
                if "error" in r:
                    failed.append(f"{name}: {label}: {r['error']}")
                    rows.append([name, label, "-", "error", r["error"][:100], "", "", ""])
                    continue
                rate = r["samples_per_s"]
                rows.append([name, label, str(r["global_batch"]), fmt(rate, ",.1f" if rate < 100 else ",.0f"),
                             ratio(rate, base), ratio(rate, launcher),
                             fmt(r["to_first_step"], ".1f", " s"), fmt(r["wall"], ".1f", " s")])
            for key in ("dataparallel", "dataparallel-later"):
                r = res.get(key, {})
                if "error" in r or not r:
                    continue
                t, which = r["timings"], "first" if key == "dataparallel" else "later"
                if which == "first":
                    meta = res["dataparallel-meta"]
                    overheads.append([name, "kernel: TrainingArguments device; CUDA initialised",
                                      f"{meta['kernel_device']}; {meta['kernel_cuda_initialised']}"])
                    overheads.append([name, "first cell: pool start", fmt(t["pool_start"], ".2f", " s")])
                overheads.append([name, f"{which} cell: ship model + start ranks", fmt(t["start"], ".2f", " s")])
                overheads.append([name, f"{which} cell: rank 0's first optimizer step after its start",
                                  fmt(r["rank0_first_step"], ".2f", " s")])
                overheads.append([name, f"{which} cell: weight return", fmt(t["return"], ".2f", " s")])
                overheads.append([name, f"{which} cell: MiB shipped / kept in workers / returned",
                                  f"{r['shipped_mib']:.0f} / {r['cached_mib']:.0f} / {r['returned_mib']:.0f}"])
            for key, label in order:
                r = res.get(key, {})
                if r and "error" not in r:
                    overheads.append([name, f"{label}: last step to return", fmt(r["after_last_step"], ".2f", " s")])
            ours = res.get("dataparallel", {}).get("samples_per_s")
            if ours and launcher:
                floors.append(f"{name}: %%dataparallel / notebook_launcher = {ours / launcher:.2f} "
                              f"(floor 1.00: {'met' if ours >= launcher else 'NOT met'})")
            if ours and base:
                floors.append(f"{name}: %%dataparallel / {one} = {ours / base:.2f} "
                              f"(floor 1.80 where compute-bound: {'met' if ours >= 1.8 * base else 'NOT met'})")
            print()
            print(text_table([r for r in rows if r[0] == name], header), flush=True)
            for key in ("single", "launcher", "dataparallel"):
                r = res.get(key)
                if r and "error" not in r:
                    print(f"{key}: device {r['device']}, world {r['world_size']}, precision {r['mixed_precision']}, "
                          f"optim {r['optim']}, "
                          f"attention {r['attention']}, train_runtime {r['train_runtime']:.1f} s, "
                          f"max allocated {r['cuda_max_allocated_gib']:.1f} GiB", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total = time.perf_counter() - t_start
    print()
    print(text_table(rows, header))
    if overheads:
        print()
        print(text_table(overheads, ["model", "overhead", "value"]))
    print()
    for line in floors:
        print(line)
    for line in failed:
        print(f"FAILED: {line}")
    print(f"\ntotal {total:.0f} s")
    if not opts.no_record:
        title = "frameworks.py" + (" (quick, CPU smoke run: tiny models, no bf16)" if opts.quick else "")
        setup = (f"- Hugging Face Trainer, per-device batch {s['batch']}, {s['steps']} steps, samples/s over steps "
                 f"{s['warmup'] + 1}-{s['steps']} (TrainerCallback, CUDA-synchronised on GPUs), bf16 {s['bf16']}, "
                 f"ddp_find_unused_parameters=False; %%dataparallel --nprocs {opts.nprocs} in an IPython "
                 "InteractiveShell whose kernel made the TrainingArguments first")
        append_results(title, [f"- machine: {machine(gpus)}; {versions()}; {_library_versions()}",
                               f"- command: `{command('frameworks.py', argv)}`; {total:.0f} s in all", setup,
                               *[f"- {line}" for line in floors + [f'FAILED: {x}' for x in failed]]],
                       [(header, rows)] + ([(["model", "overhead", "value"], overheads)] if overheads else []))
    if failed:
        sys.exit(1)


def _library_versions() -> str:
    from importlib.metadata import PackageNotFoundError, version
    parts = []
    for name in ("transformers", "accelerate"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} missing")
    return "; ".join(parts)


if __name__ == "__main__":
    main()
