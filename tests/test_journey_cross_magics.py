"""The magics together, in the order a long notebook session uses them (a real InteractiveShell)."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import torch

from gpumagic.errors import CellInterrupted
from tests.conftest import run_cell

SETUP = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
X = torch.randn(64, 4); Y = X.sum(1, keepdim=True)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16)
"""
STEP = "for x, y in loader:\n    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()\n"


def test_sharedtrain_after_an_fsdp_cell_still_forks(shell):
    # An fsdp cell sends shared tensors through torch's reducers, which starts multiprocessing's
    # descriptor sharer thread in the kernel; it is fork-safe, and was blamed as "a thread that
    # could hold a lock across fork", so every later %%sharedtrain lost fork (the first one spawning).
    from gpumagic.procs.start import fork_unsafe_threads
    run_cell(shell, SETUP)
    threads_before = set(threading.enumerate())   # (earlier tests in this process may have left some)
    try:
        result, out, _ = run_cell(shell, "%%dataparallel --nprocs 2 --strategy fsdp\n" + STEP)
        assert result.success, out
        started = [t for t in threading.enumerate() if t not in threads_before]
        assert fork_unsafe_threads(started) == [], started
        before = [p.detach().clone() for p in shell.user_ns["model"].parameters()]
        result, out, _ = run_cell(shell, "%%sharedtrain --nprocs 2\n" + STEP)
        assert result.success, out
        trained = shell.user_ns["sharedtrain"]
        if not fork_unsafe_threads():   # (else fork is refused for threads this test did not start)
            assert trained.start_method == "fork", trained.start_reason
        assert not any(t.name in trained.start_reason for t in started), trained.start_reason
        after = list(shell.user_ns["model"].parameters())
        assert any(not torch.equal(a, b) for a, b in zip(before, after))
    finally:
        shell.run_line_magic("dataparallel", "stop")


def test_an_interrupted_sharedtrain_cell_shows_no_gpumagic_frames(shell):
    run_cell(shell, SETUP)
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    sent = {}

    def interrupt():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len({c.pid for c in me.children(recursive=True)} - before) >= 2:
                time.sleep(0.5)
                sent["at"] = time.monotonic()
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    sender = threading.Thread(target=interrupt)
    sender.start()
    try:
        result, out, _ = run_cell(shell, "%%sharedtrain --nprocs 2 --start-method fork\nimport time\n"
                                         "while True:\n    model(torch.ones(1, 4))\n    time.sleep(0.01)\n")
    finally:
        sender.join()
    assert "at" in sent, out
    assert isinstance(result.error_in_exec, CellInterrupted), out
    assert "stopped 2 workers" in out and "KeyboardInterrupt" in out
    assert "launch.py" not in out and "interrupt.result" not in out, out   # as %%dataparallel shows it
    assert shell.user_ns["sharedtrain"].status == "interrupted"
