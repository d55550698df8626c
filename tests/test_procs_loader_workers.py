"""DataLoader workers inside ranks: forked (fast, notebook classes work), printing through the rank,
and gone with the rank when the kernel is killed."""
from __future__ import annotations

import glob
import time

import psutil
import pytest

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import ROOT, run_cell
from tests.dataparallel_helpers import alive, dp_cell, dp_pool, wait_dead

CPU2 = "--devices cpu --nprocs 2"
# On two GPUs, ranks that hold CUDA contexts and NCCL communicators fork the loader workers.
WHERE = [CPU2, pytest.param("--nprocs 2", marks=[pytest.mark.gpu, pytest.mark.gpu2], id="two-gpus")]

SETUP = """
import os, torch
from torch.utils.data import DataLoader, get_worker_info

class Squares(torch.utils.data.Dataset):      # defined in the notebook: no module to import it from
    def __len__(self):
        return 32
    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor([float(i * i)]), torch.tensor([os.getppid()])

def say_hello(worker_id):
    print(f"loader worker {worker_id} of pid {os.getppid()} starts")

model = torch.nn.Linear(1, 1)
loader = DataLoader(Squares(), batch_size=4, num_workers=2, worker_init_fn=say_hello)
"""

TRAIN = """
import os, torch
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
seen, parents = [], set()
for epoch in range(2):
    for x, y, ppid in loader:
        device = next(model.parameters()).device
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        seen += x.flatten().tolist()
        parents.update(ppid.flatten().tolist())
rank_pid = os.getpid()
parents = sorted(parents)   # a plain value, to come back
"""


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


@pytest.mark.parametrize("where", WHERE)
def test_loader_workers_in_ranks_are_forked_from_the_rank_and_load_notebook_classes(shell, where):
    run_cell(shell, SETUP)
    _, cap = dp_cell(shell, where + " --all-output", TRAIN)
    # Rank 0 came back: it read its half of every batch, both epochs, from workers it forked itself.
    ns = shell.user_ns
    assert ns["parents"] == [ns["rank_pid"]]
    assert ns["rank_pid"] in dp_pool().pids
    rank0_share = [float(i) for start in range(0, 32, 4) for i in range(start, start + 2)]
    assert ns["seen"] == rank0_share * 2
    # What the loader workers printed reached the cell, from each rank's workers, each epoch.
    for rank, pid in enumerate(dp_pool().pids):
        for worker_id in (0, 1):
            line = f"[rank {rank}] loader worker {worker_id} of pid {pid} starts"
            assert cap.stdout.count(line + "\n") == 2, (line, cap.stdout)


@pytest.mark.parametrize("where", WHERE)
def test_no_loader_worker_outlives_its_epoch_or_leaves_semaphores(shell, where):
    run_cell(shell, SETUP.replace("worker_init_fn=say_hello", "worker_init_fn=say_hello, pin_memory=True"))
    before = set(glob.glob("/dev/shm/sem.*"))
    dp_cell(shell, where, TRAIN)
    for pid in dp_pool().pids:
        assert wait_dead([c.pid for c in psutil.Process(pid).children(recursive=True)]) == []
    assert set(glob.glob("/dev/shm/sem.*")) - before == set()


PLAIN_LOADER = """
plain_loader = DataLoader(torch.utils.data.TensorDataset(torch.arange(32.).unsqueeze(1)), batch_size=4, num_workers=2)
"""
KILLED_CELL = """%%dataparallel {where}
import time
for epoch in range(10 ** 6):
    for (x,) in plain_loader:
        model(x.to(next(model.parameters()).device))
        time.sleep(0.01)
"""


@pytest.mark.parametrize("where", WHERE)
def test_a_killed_kernel_takes_the_ranks_loader_workers_along(where):
    from jupyter_client.manager import start_new_kernel
    sems_before = set(glob.glob("/dev/shm/sem.*"))
    km, kc = start_new_kernel(kernel_name="python3", cwd=ROOT)
    try:
        # A plain TensorDataset: nothing to pickle that a spawned loader worker could not load.
        reply = kc.execute_interactive("%load_ext gpumagic\n" + SETUP + PLAIN_LOADER, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        outputs: list = []
        kc.execute(KILLED_CELL.format(where=where))
        kernel = psutil.Process(km.provisioner.process.pid)
        # Two ranks, each with two loader workers, all running.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                family = kernel.children(recursive=True)
                ranks = [p for p in family if any(c.ppid() == p.pid for c in family) and p.ppid() == kernel.pid]
                loader_workers = [c for r in ranks for c in r.children()]
            except psutil.NoSuchProcess:   # a short-lived child ended while we looked: look again
                ranks, loader_workers = [], []
            if len(ranks) == 2 and len(loader_workers) == 4:
                break
            time.sleep(0.2)
        else:
            while kc.iopub_channel.msg_ready():
                outputs.append(kc.get_iopub_msg()["content"])
            pytest.fail(f"the ranks' loader workers never ran: {kernel.children(recursive=True)} {outputs}")
        pids = [p.pid for p in kernel.children(recursive=True)]
        km.shutdown_kernel(now=True)
        assert wait_dead(pids, timeout=10) == []
    finally:
        if km.is_alive():
            km.shutdown_kernel(now=True)
        kc.stop_channels()
    assert set(glob.glob("/dev/shm/sem.*")) - sems_before == set()
    assert not any(alive(p) for p in pids)
