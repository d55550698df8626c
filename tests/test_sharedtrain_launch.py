"""Hogwild from plain Python (gpumagic.sharedtrain.launch.train_shared), without a shell."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import ROOT

LOW_LIMIT_SCRIPT = """
import os, resource, torch
from gpumagic.sharedtrain.launch import train_shared
resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)])   # 80 storages
before = model[-1].bias.detach().clone()
ns = {"torch": torch, "model": model}
result = train_shared(ns, '''
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    opt.zero_grad(); model(torch.ones(2, 4)).pow(2).sum().backward(); opt.step()
''', nprocs=2, start_method="fork", seed=0)
print("strategy", result.sharing_strategy, result.status)
print("changed", not torch.equal(before, model[-1].bias.detach()))
print("note", [n for n in result.notes if "to share" in n][0])
print("pid", os.getpid())
"""


def test_low_open_file_limit_switches_to_file_system_sharing():
    out = subprocess.run([sys.executable, "-c", LOW_LIMIT_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "strategy file_system done" in out.stdout and "changed True" in out.stdout
    assert "too low to share 80 tensors by file descriptor" in out.stdout
    pid = out.stdout.rsplit("pid ", 1)[1].strip()
    deadline = time.monotonic() + 5  # torch_shm_manager removes the files once the process is gone
    while any(n.startswith(f"torch_{pid}_") for n in os.listdir("/dev/shm")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(n.startswith(f"torch_{pid}_") for n in os.listdir("/dev/shm"))
