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

Both time themselves the same way inside the workers: samples/s is all
workers' samples over the time from the first batch in any worker to the end
of the last worker's loop (start-up excluded). Each is run ``--repeats``
times, alternating, and the best is kept. Then the time from cell start to
the first step is measured for the magic with ``fork`` and with ``spawn``.

Floors: %%sharedtrain >= 0.95 x hand-written at each N; first step < 1 s
with fork and < 3 s with spawn.

One thread per worker in both: Hogwild's parallelism is the processes, and
letting each of N workers use every core would oversubscribe the machine and
compare thread schedulers rather than the launchers.

Run from the repository root::

    python benchmarks/sharedtrain.py                      # N = 1, 2, 4, 8 (capped), 60000 samples
    python benchmarks/sharedtrain.py --samples 20000 --repeats 3 --no-record
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from gpumagic.display import text_table  # noqa: E402

BATCH = 64
FORK_FLOOR, SPAWN_FLOOR, RATIO_FLOOR = 1.0, 3.0, 0.95


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
    first, count = None, 0
    for data, target in loader:
        if first is None:
            first = time.monotonic()
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        count += len(data)
    conn.send((first, time.monotonic(), count))
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
    return {"samples_per_s": total / (end - first), "first_step": first - start, "samples": total}


# --------------------------------------------------------------------------- %%sharedtrain

CELL = """%%sharedtrain --nprocs {nprocs} --start-method {method} --seed 1
import time
model.train()
first, count = None, 0
for data, target in train_loader:
    if first is None:
        first = time.monotonic()
    optimizer.zero_grad()
    loss = F.nll_loss(model(data), target)
    loss.backward()
    optimizer.step()
    count += len(data)
report(first=first, end=time.monotonic(), samples=count)
"""


def make_shell():
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "gpumagic")
    return shell


def magic(shell, nprocs: int, dataset, method: str = "fork", seed: int = 1) -> dict:
    from IPython.utils.capture import capture_output
    torch.manual_seed(seed)
    model = Net()
    shell.user_ns.update(
        torch=torch, F=F, model=model, train_loader=DataLoader(dataset, batch_size=BATCH, shuffle=True),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5))
    start = time.monotonic()
    with capture_output() as cap:
        result = shell.run_cell(CELL.format(nprocs=nprocs, method=method))
    if result.error_in_exec is not None:
        print(cap.stdout, cap.stderr)
        raise result.error_in_exec
    history = shell.user_ns["sharedtrain"].history
    stats = [(h[-1]["first"], h[-1]["end"], h[-1]["samples"]) for h in history]
    return _rates(stats, start)


# --------------------------------------------------------------------------- the run

def machine() -> str:
    from gpumagic import devices
    cpu = devices.cpu_facts()
    gpus = [g.name for g in devices.visible_gpus()]
    where = f"{cpu['name']}, {cpu['cores_physical']} cores ({cpu['cores_logical']} logical)"
    where += f"; {len(gpus)} x {gpus[0]}" if gpus else " (no GPU)"
    return f"{where}; {platform.node()}; torch {torch.__version__}; Python {platform.python_version()}"


def record(header, rows, command: str, extra: list[str]) -> None:
    path = os.path.join(ROOT, "benchmarks", "RESULTS.md")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"\n### sharedtrain.py, {stamp}", f"- machine: {machine()}", f"- command: `{command}`", *extra, "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"\nappended to {os.path.relpath(path)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", default="1,2,4,8", help="comma-separated worker counts (default 1,2,4,8)")
    parser.add_argument("--samples", type=int, default=60000, help="training samples per run (default 60000)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, best kept (default 1)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args(argv)

    cores = len(os.sched_getaffinity(0))
    counts = sorted({min(int(n), cores) for n in args.nprocs.split(",")})
    dataset = make_dataset(args.samples)
    shell = make_shell()
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1).zero_grad()  # lazy imports, for both alike

    header = ["N", "hand-written samples/s", "%%sharedtrain samples/s", "ratio", "first step fork",
              "first step spawn", "hand-written first step", "floors"]
    rows, failed = [], False
    for n in counts:
        hand, mine = [], []
        for _ in range(args.repeats):
            hand.append(hand_written(n, dataset))
            mine.append(magic(shell, n, dataset, "fork"))
        best_hand = max(hand, key=lambda r: r["samples_per_s"])
        best_mine = max(mine, key=lambda r: r["samples_per_s"])
        fork_first = min(r["first_step"] for r in mine)
        spawn_first = magic(shell, n, dataset, "spawn")["first_step"]
        ratio = best_mine["samples_per_s"] / best_hand["samples_per_s"]
        ok = ratio >= RATIO_FLOOR and fork_first < FORK_FLOOR and spawn_first < SPAWN_FLOOR
        failed |= not ok
        rows.append([n, f"{best_hand['samples_per_s']:.0f}", f"{best_mine['samples_per_s']:.0f}", f"{ratio:.3f}",
                     f"{fork_first:.2f} s", f"{spawn_first:.2f} s",
                     f"{min(r['first_step'] for r in hand):.2f} s", "ok" if ok else "BELOW"])
        print(text_table([[str(c) for c in r] for r in rows[-1:]], header), flush=True)
    print()
    print(text_table([[str(c) for c in r] for r in rows], header))
    extra = [f"- 784-512-512-10 MLP, batch {BATCH}, SGD(0.01, 0.5), {args.samples} synthetic MNIST-sized samples "
             f"per run, one torch thread per worker, best of {args.repeats}; floors: ratio >= {RATIO_FLOOR}, "
             f"first step < {FORK_FLOOR:g} s (fork) and < {SPAWN_FLOOR:g} s (spawn)"]
    if not args.no_record:
        record(header, rows, "python " + " ".join(shlex.quote(a) for a in ["benchmarks/sharedtrain.py", *sys.argv[1:]]),
               extra)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
