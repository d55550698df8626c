"""%%sharedtrain against a hand-written mnist_hogwild-style script, in the same run.

Model and data as in PyTorch's mnist_hogwild example, made synthetic: a
784-512-512-10 MLP (ReLU, log_softmax, nll_loss), SGD (lr 0.01, momentum 0.5)
at batch 64, on MNIST-sized random data (``--samples`` rows of 784 floats,
10 classes). For each N in ``--nprocs`` (capped at this machine's cores):

* **hand-written**: ``model.share_memory()``, N ``fork`` processes, each
  with a ``DistributedSampler`` shard, its own SGD, ``torch.set_num_threads(1)``;
* **%%sharedtrain**: the same loop as a cell run through a real IPython
  ``InteractiveShell`` with ``--start-method fork``, the notebook's loader
  sharded by the magic, the notebook's SGD copied per worker.

Both fork from this process, use one torch thread per worker and the same
environment, and time themselves the same way inside the workers:
samples/s is all workers' samples over the time from the first batch in any
worker to the end of the last worker's loop (start-up excluded); CPU time
per sample is the workers' own CPU time over the same stretch, which a busy
machine disturbs much less than wall time. Runs are interleaved: ``--pairs``
rounds, each running one hand-written and one magic run for every N, the
order within a pair alternating from round to round, so that drifts of the
machine fall on both alike. The ratio is the median of the pairs' ratios.

Start-up is measured in a fresh kernel (a new Python process) for each N, as
a person meets it, with cells that train 20 batches: fork (the first cell,
then a later one); spawn; and the automatic choice where fork is unsafe (a
thread of the notebook's own is running, as when CUDA is initialised): its
first cell spawns and starts the fork server as it ends, the next cell run
right away may wait for the server to finish importing, a later one starts
from it. For each: seconds from running the cell to the cell starting in the
first worker, to the first batch in any worker ("first step", what the
floors are about) and until every worker has finished its first optimizer
step ("all updating": it includes the second or so a first optimizer call
spends importing ``torch._dynamo`` where nothing imported it before). A fresh
Python's ``import torch`` is timed too: no spawned worker can start sooner.
Where torch came without bytecode and Python writes none
(``PYTHONDONTWRITEBYTECODE``), workers keep theirs in gpumagic's cache (see
``gpumagic/procs/bytecode.py``): the benchmark then uses a cache of its own, filled
before the runs as a first worker fills it, and adds a column per N in a
kernel that loads the extension with the cache empty (it starts filling it
in the background) and runs a spawn cell at once: the first spawn ever.

Floors: %%sharedtrain >= 0.95 x hand-written at each N; first step < 1 s
with fork and < 3 s with spawn.

Run from the repository root::

    python benchmarks/sharedtrain.py                       # N = 1, 2, 4, 8 (capped)
    python benchmarks/sharedtrain.py --nprocs 1,2 --pairs 3 --no-record
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from _common import ROOT, append_results, command, make_shell, versions  # also puts the checkout on sys.path
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from gpumagic.display import text_table
from gpumagic.procs import bytecode, forkserver

BATCH = 64
FORK_FLOOR, SPAWN_FLOOR, RATIO_FLOOR = 1.0, 3.0, 0.95
STARTUP_BATCHES = 20


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


def make_dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 784, generator=g), torch.randint(0, 10, (samples,), generator=g))


# --------------------------------------------------------------------------- hand-written

def _hand_train(rank, world, model, dataset, seed, conn):
    # mnist_hogwild/train.py, timed the way the cell below times itself.
    torch.set_num_threads(1)
    torch.manual_seed(seed + rank)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    model.train()
    first, count, cpu = None, 0, 0.0
    for data, target in loader:
        if first is None:
            first, cpu = time.monotonic(), time.process_time()
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        count += len(data)
    conn.send((first, time.monotonic(), count, time.process_time() - cpu))
    conn.close()


def hand_written(nprocs: int, dataset, seed: int = 1) -> dict:
    start = time.monotonic()
    torch.manual_seed(seed)
    model = Net()
    model.share_memory()
    ctx = mp.get_context("fork")
    processes, conns = [], []
    for rank in range(nprocs):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_hand_train, args=(rank, nprocs, model, dataset, seed, send))
        p.start()
        send.close()
        processes.append(p)
        conns.append(recv)
    stats = [c.recv() for c in conns]
    for p in processes:
        p.join()
    return _rates(stats, start)


def _rates(stats, start) -> dict:
    first = min(s[0] for s in stats if s[0] is not None)
    end = max(s[1] for s in stats)
    total = sum(s[2] for s in stats)
    cpu = sum(s[3] for s in stats)
    return {"samples_per_s": total / (end - first), "first_step": first - start, "samples": total,
            "cpu_us_per_sample": 1e6 * cpu / total}


# --------------------------------------------------------------------------- %%sharedtrain

CELL = """%%sharedtrain --nprocs {nprocs} --start-method {method} --seed 1
import time
model.train()
first, count, cpu = None, 0, 0.0
for data, target in train_loader:
    if first is None:
        first, cpu = time.monotonic(), time.process_time()
    optimizer.zero_grad()
    loss = F.nll_loss(model(data), target)
    loss.backward()
    optimizer.step()
    count += len(data)
report(first=first, end=time.monotonic(), samples=count, cpu=time.process_time() - cpu)
"""

# Start-up: when the cell began, its first batch, and the end of its first optimizer step.
STARTUP_CELL = """%%sharedtrain --nprocs {nprocs}{method} --seed 1
import time
ready = time.monotonic()
first = updated = None
for i, (data, target) in enumerate(train_loader):
    if first is None:
        first = time.monotonic()
    optimizer.zero_grad()
    loss = F.nll_loss(model(data), target)
    loss.backward()
    optimizer.step()
    if updated is None:
        updated = time.monotonic()
    if i + 1 == {batches}:
        break
report(ready=ready, first=first, updated=updated)
"""


def _run_cell(shell, nprocs: int, dataset, source: str, seed: int = 1):
    from IPython.utils.capture import capture_output
    torch.manual_seed(seed)
    model = Net()
    shell.user_ns.update(
        torch=torch, F=F, model=model, train_loader=DataLoader(dataset, batch_size=BATCH, shuffle=True),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5))
    start = time.monotonic()
    with capture_output() as cap:
        result = shell.run_cell(source)
    if result.error_in_exec is not None:
        print(cap.stdout, cap.stderr)
        raise result.error_in_exec
    return start, shell.user_ns["sharedtrain"]


def magic(shell, nprocs: int, dataset, method: str = "fork") -> dict:
    start, result = _run_cell(shell, nprocs, dataset, CELL.format(nprocs=nprocs, method=method))
    stats = [(h[-1]["first"], h[-1]["end"], h[-1]["samples"], h[-1]["cpu"]) for h in result.history]
    return _rates(stats, start)


def startup(shell, nprocs: int, dataset, method: str | None) -> dict:
    flag = f" --start-method {method}" if method else ""
    start, result = _run_cell(shell, nprocs, dataset,
                              STARTUP_CELL.format(nprocs=nprocs, method=flag, batches=STARTUP_BATCHES))
    last = [h[-1] for h in result.history]
    return {"ready": min(e["ready"] for e in last) - start, "first": min(e["first"] for e in last) - start,
            "updating": max(e["updated"] for e in last) - start, "method": result.start_method}


STARTUP_SEQUENCE = [("fork", "fork, first cell"), ("fork", "fork, later cell"), ("spawn", "spawn"),
                    (None, "fork unsafe, first cell"), (None, "fork unsafe, next cell at once"),
                    (None, "fork unsafe, later cell")]


COLD_SEQUENCE = [("spawn", "spawn, cache empty at %load_ext")]


def startup_child(nprocs: int, samples: int, cold: bool = False) -> None:
    """In a fresh kernel: the start-up cells in order; one JSON line on stdout."""
    import threading
    dataset = make_dataset(samples)
    shell = make_shell()
    out = []
    stop = threading.Event()
    for method, label in COLD_SEQUENCE if cold else STARTUP_SEQUENCE:
        if method is None and not stop.is_set() and threading.active_count() == 1:
            # A thread of the notebook's own makes fork unsafe, as CUDA in the kernel would.
            threading.Thread(target=stop.wait, name="notebook-thread", daemon=True).start()
        out.append({"label": label, **startup(shell, nprocs, dataset, method)})
    stop.set()
    forkserver.stop()
    sys.__stdout__.write("STARTUP " + json.dumps(out) + "\n")


def _child_env(**extra) -> dict:
    """The checkout first on the path, then whatever the path already held (installed wheels, say)."""
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), **extra}


def fresh_python(code: str, **env) -> float:
    """Seconds from starting a new Python to the end of ``code`` in it (best of two)."""
    best = float("inf")
    for _ in range(2):
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", f"{code}\nimport time; print(time.monotonic())"],
                             capture_output=True, text=True, cwd=ROOT, env=_child_env(**env))
        best = min(best, float(out.stdout.split()[-1]) - start)
    return best


def startup_in_fresh_kernel(nprocs: int, samples: int, cold_cache: str | None = None) -> list[dict]:
    """The start-up sequence in a new kernel; with ``cold_cache``, only a spawn cell, that cache empty."""
    args = ["--startup-cold"] if cold_cache else []
    env = {bytecode.SETTING: cold_cache} if cold_cache else {}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--startup-child", str(nprocs),
                          "--samples", str(samples), *args], capture_output=True, text=True, cwd=ROOT,
                         env=_child_env(**env), timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("STARTUP ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"start-up run for N={nprocs} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("STARTUP "):])


def report_cost(calls: int = 20000) -> tuple[float, float]:
    """Microseconds per ``report(loss=loss)`` and per counted batch, in a worker's channel."""
    from gpumagic.sharedtrain.worker import Channel
    channel = Channel(lambda message: None, t0=time.monotonic())
    loss = torch.tensor(2.3)
    batch = [torch.zeros(BATCH, 784), torch.zeros(BATCH, dtype=torch.long)]
    start = time.perf_counter()
    for _ in range(calls):
        channel.report(loss=loss)
    per_report = (time.perf_counter() - start) / calls * 1e6
    channel.counting = True
    start = time.perf_counter()
    for _ in range(calls):
        channel.step(batch)
    return per_report, (time.perf_counter() - start) / calls * 1e6


# --------------------------------------------------------------------------- the run

def machine() -> str:
    from gpumagic import devices
    cpu = devices.cpu_facts()
    gpus = [g.name for g in devices.visible_gpus()]
    where = f"{cpu['name']}, {cpu['cores_physical']} cores ({cpu['cores_logical']} logical)"
    where += f"; {len(gpus)} x {gpus[0]}" if gpus else " (no GPU)"
    return f"{where}; {platform.node()}; {versions()}"


def _median(values):
    return statistics.median(values)


def throughput(counts, dataset, shell, pairs: int) -> tuple[list, list, bool]:
    header = ["N", "hand-written samples/s", "%%sharedtrain samples/s", "ratio (median of pairs)",
              "pair ratios", "CPU us/sample hand / magic", "floor"]
    # One discarded pair first: page faults on the dataset, first forks, first imports.
    hand_written(counts[0], dataset)
    magic(shell, counts[0], dataset)
    runs = {n: ([], []) for n in counts}
    for round_ in range(pairs):
        for n in counts:
            hand, mine = runs[n]
            if round_ % 2 == 0:
                hand.append(hand_written(n, dataset))
                mine.append(magic(shell, n, dataset))
            else:
                mine.append(magic(shell, n, dataset))
                hand.append(hand_written(n, dataset))
        done = ", ".join(f"N={n} {runs[n][1][-1]['samples_per_s'] / runs[n][0][-1]['samples_per_s']:.3f}"
                         for n in counts)
        print(f"round {round_ + 1}/{pairs}: ratios {done}", flush=True)
    rows, failed = [], False
    for n in counts:
        hand, mine = runs[n]
        ratios = sorted(m["samples_per_s"] / h["samples_per_s"] for h, m in zip(hand, mine))
        ratio = _median(ratios)
        ok = ratio >= RATIO_FLOOR
        failed |= not ok
        rows.append([n, f"{_median([r['samples_per_s'] for r in hand]):.0f}",
                     f"{_median([r['samples_per_s'] for r in mine]):.0f}", f"{ratio:.3f}",
                     " ".join(f"{r:.2f}" for r in ratios),
                     f"{_median([r['cpu_us_per_sample'] for r in hand]):.1f} / "
                     f"{_median([r['cpu_us_per_sample'] for r in mine]):.1f}",
                     "ok" if ok else "BELOW"])
    return header, rows, failed


def startups(counts, samples: int, cold_dir: str | None) -> tuple[list, list, bool]:
    """One row per N; with ``cold_dir`` (workers keep bytecode in gpumagic's cache) a first-ever column too."""
    header, rows, failed = None, [], False
    for n in counts:
        found = startup_in_fresh_kernel(n, samples)
        if cold_dir:
            found += startup_in_fresh_kernel(n, samples, os.path.join(cold_dir, f"n{n}"))
        if header is None:  # each column names the start method the cell used
            header = ["N"] + [f"{r['label']} ({r['method']})" for r in found] + ["floors"]
        by_label = {r["label"]: r for r in found}
        ok = by_label["fork, first cell"]["first"] < FORK_FLOOR and by_label["spawn"]["first"] < SPAWN_FLOOR
        failed |= not ok
        rows.append([n] + [f"{r['ready']:.2f} / {r['first']:.2f} / {r['updating']:.2f}" for r in found]
                    + ["ok" if ok else "BELOW"])
        print(text_table([[str(c) for c in rows[-1]]], header), flush=True)
    return header, rows, failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", default="1,2,4,8", help="comma-separated worker counts (default 1,2,4,8)")
    parser.add_argument("--samples", type=int, default=48000, help="training samples per run (default 48000)")
    parser.add_argument("--pairs", type=int, default=5,
                        help="interleaved hand-written/magic pairs per N; the median is kept (default 5)")
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up measurements")
    parser.add_argument("--startup-only", action="store_true", help="only the start-up measurements")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--startup-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--startup-cold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.startup_child is not None:
        startup_child(args.startup_child, args.samples, args.startup_cold)
        return 0

    began = time.monotonic()
    cores = len(os.sched_getaffinity(0))
    counts = sorted({min(int(n), cores) for n in args.nprocs.split(",")})
    dataset = make_dataset(args.samples)
    shell = make_shell()
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1).zero_grad()  # lazy imports, for both alike

    tables, failed, extra = [], False, []
    if not args.startup_only:
        header, rows, bad = throughput(counts, dataset, shell, args.pairs)
        print()
        print(text_table([[str(c) for c in r] for r in rows], header), flush=True)
        tables.append((header, rows))
        failed |= bad
        per_report, per_batch = report_cost()
        extra += [f"- 784-512-512-10 MLP, batch {BATCH}, SGD(0.01, 0.5), {args.samples} synthetic MNIST-sized "
                  f"samples per run, one torch thread per worker, both forked from one process; {args.pairs} "
                  f"interleaved pairs per N (order alternating), median kept; floors: ratio >= {RATIO_FLOOR}, "
                  f"first step < {FORK_FLOOR:g} s (fork) and < {SPAWN_FLOOR:g} s (spawn)",
                  f"- per-step bookkeeping in a worker: report(loss=loss) {per_report:.1f} us per call, "
                  f"counting a batch {per_batch:.1f} us"]
    if not args.no_startup:
        torch_s = fresh_python("import torch")
        worker_s = fresh_python("import gpumagic.sharedtrain.worker")
        cache = bytecode.worker_pycache()
        cold_dir = None
        if cache:
            # Workers keep bytecode in gpumagic's cache here: measure with one of the benchmark's own,
            # filled first as a worker fills it, and once per N with an empty one (the first spawn ever).
            cold_dir = tempfile.mkdtemp(prefix="gpumagic-bench-pycache-")
            cache = os.path.join(cold_dir, "warm")
            os.environ[bytecode.SETTING] = cache
            # Best of two: the first run fills the cache as a first worker would, the second reads it.
            cached_s = fresh_python("import gpumagic.sharedtrain.worker", **{bytecode.WORKER_ENV: cache})
            bytecode_note = (f"torch was installed without bytecode and Python writes none here, so workers keep "
                             f"theirs in gpumagic's cache: a fresh worker imports what it needs in {cached_s:.2f} s "
                             f"with it, {worker_s:.2f} s without")
        else:
            bytecode_note = "workers read the bytecode installed with torch"
        print(f"\nfresh Python: import torch {torch_s:.2f} s; import gpumagic.sharedtrain.worker {worker_s:.2f} s;"
              f" {bytecode_note}", flush=True)
        try:
            header, rows, bad = startups(counts, args.samples, cold_dir)
        finally:
            if cold_dir:
                shutil.rmtree(cold_dir, ignore_errors=True)
        print()
        print(text_table([[str(c) for c in r] for r in rows], header))
        tables.append((header, rows))
        failed |= bad
        extra.append(f"- start-up in a fresh kernel per N, seconds from running the cell to the cell starting in the "
                     f"first worker / its first batch in any worker (first step) / every worker having taken its "
                     f"first optimizer step; a fresh Python takes {torch_s:.2f} s to import torch and "
                     f"{worker_s:.2f} s to import what a worker needs; {bytecode_note}")
    extra.append(f"- whole benchmark: {time.monotonic() - began:.0f} s")
    print(extra[-1][2:])
    if not args.no_record:
        append_results("sharedtrain.py",
                       [f"- machine: {machine()}", f"- command: `{command('sharedtrain.py', argv)}`", *extra], tables)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
