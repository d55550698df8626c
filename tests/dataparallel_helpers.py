"""Helpers shared by the %%dataparallel tests on CPU and on GPUs."""
from __future__ import annotations

import textwrap
import time

import psutil
from IPython.utils.capture import capture_output

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod


def last_result():
    """What the last %%dataparallel cell did, as the notebook has it (bound as ``dataparallel``)."""
    from IPython.core.interactiveshell import InteractiveShell
    return InteractiveShell.instance().user_ns["dataparallel"]


def dp_pool():
    """The worker pool %%dataparallel keeps, or None."""
    return poolmod.current_pool(POOL_NAME)


def alive(pid) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_dead(pids, timeout=5.0) -> list:
    """Wait up to ``timeout`` seconds for ``pids`` to end; those still alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def dp_cell(shell, line, body):
    """Run ``%%dataparallel line`` over ``body`` (dedented); its value and captured output."""
    with capture_output() as cap:
        value = shell.run_cell_magic("dataparallel", line, textwrap.dedent(body))
    return value, cap


def interrupt_once_training(shell, line, cell, marker, timeout=120.0) -> None:
    """Run ``%%dataparallel line`` over ``cell`` and interrupt the kernel once ``marker`` exists (the cell
    touches it from a training step); expects the KeyboardInterrupt that follows."""
    import _thread
    import threading

    import pytest

    def interrupt_when_training():
        deadline = time.monotonic() + timeout
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()
    watcher = threading.Thread(target=interrupt_when_training, daemon=True)
    watcher.start()
    with pytest.raises(KeyboardInterrupt):
        dp_cell(shell, line, cell)
    watcher.join()
    assert marker.exists(), "interrupted before training began"


# A small regression a cell trains: the notebook these tests start from.
REGRESSION = """
import numpy as np
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(32, 4); Y = X.sum(1, keepdim=True)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
"""


def notebook_from(shell, source: str = REGRESSION) -> dict:
    """Run ``source`` as a plain cell (it must succeed); the notebook's namespace."""
    from tests.conftest import run_cell
    result, text, _ = run_cell(shell, source)
    assert result.success, text
    return shell.user_ns


def trained_in_one_process(ns: dict):
    """A copy of the notebook's ``model`` after one epoch of ``loader`` in this process (SGD, lr 0.1,
    squared error), as a plain cell trains it: what a %%dataparallel cell must match."""
    import copy

    import torch
    ref = copy.deepcopy(ns["model"])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in ns["loader"]:
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
    return ref
