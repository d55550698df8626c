"""Workers follow the kernel's %cd, sys.path and environment (gpumagic.procs.follow_kernel).

The %%dataparallel pool outlives the cell that started it, and %%sharedtrain's fork server the
cell that started it: before, a notebook that ran ``%cd data`` or ``%env HF_HUB_OFFLINE=1`` later
had cells whose relative paths, imports and environment were those of the kernel as it was then.
"""
from __future__ import annotations

import os
import sys

import pytest

from gpumagic.procs.follow_kernel import KernelView, follow, where_now
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell

SETUP = """
import os, sys, torch
model = torch.nn.Linear(2, 1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)
"""

# Reads what a plain cell would see: the directory, a module beside the notebook, a path, the environment.
READ = """
where = os.getcwd()
import helper_beside
from_path = __import__("helper_on_path").VALUE
env = (os.environ.get("GPUMAGIC_TEST_SET"), os.environ.get("GPUMAGIC_TEST_UNSET"))
value = helper_beside.VALUE
"""


@pytest.fixture
def kernel_moves(tmp_path, monkeypatch):
    """After the workers start: the kernel moves to a new directory, extends sys.path and changes its
    environment (all put back afterwards)."""
    def move():
        here = tmp_path / "notebook"
        extra = tmp_path / "src"
        here.mkdir()
        extra.mkdir()
        (here / "helper_beside.py").write_text("VALUE = 'beside'\n")
        (extra / "helper_on_path.py").write_text("VALUE = 'on path'\n")
        monkeypatch.chdir(here)
        monkeypatch.syspath_prepend(str(extra))
        monkeypatch.syspath_prepend("")                       # as in a Jupyter kernel: the notebook's directory
        monkeypatch.setenv("GPUMAGIC_TEST_SET", "new")
        monkeypatch.delenv("GPUMAGIC_TEST_UNSET")
        return str(here)
    monkeypatch.setenv("GPUMAGIC_TEST_UNSET", "old")
    yield move
    for name in ("helper_beside", "helper_on_path"):
        sys.modules.pop(name, None)


def test_the_pool_follows_the_kernel_between_cells(shell, kernel_moves):
    run_cell(shell, SETUP)
    dp_cell(shell, "--nprocs 2", "first = os.environ.get('GPUMAGIC_TEST_UNSET')\nfor (x,) in loader: model(x)\n")
    assert shell.user_ns["first"] == "old"                  # the pool started with the kernel's environment
    here = kernel_moves()
    dp_cell(shell, "--nprocs 2", READ + "for (x,) in loader: model(x)\n")
    ns = shell.user_ns
    assert (ns["where"], ns["value"], ns["from_path"], ns["env"]) == (here, "beside", "on path", ("new", None))


def test_forkservers_workers_start_where_the_kernel_is_now(shell, kernel_moves):
    run_cell(shell, SETUP + "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    cell = "%%sharedtrain --nprocs 2 --start-method forkserver\nfor (x,) in loader:\n    opt.zero_grad(); " \
           "model(x).sum().backward(); opt.step()\n"
    result, out, _ = run_cell(shell, cell)                 # the fork server starts here
    assert result.error_in_exec is None, out
    here = kernel_moves()
    result, out, _ = run_cell(shell, cell + READ + "report(where=where, value=value, from_path=from_path, "
                                                   "set=env[0], unset=str(env[1]))\n")
    assert result.error_in_exec is None, out
    last = shell.user_ns["sharedtrain"].history[0][-1]
    assert (last["where"], last["value"], last["from_path"], last["set"], last["unset"]) == (
        here, "beside", "on path", "new", "None")


def test_a_view_sends_what_changed_and_keeps_a_workers_own_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUMAGIC_TEST_A", "1")
    monkeypatch.setenv("GPUMAGIC_TEST_B", "2")
    view = KernelView()
    monkeypatch.setenv("GPUMAGIC_TEST_A", "changed")
    monkeypatch.delenv("GPUMAGIC_TEST_B")
    monkeypatch.setenv("RANK", "5")                         # a worker's own: never sent
    changes = view.changes()
    assert changes["set"] == {"GPUMAGIC_TEST_A": "changed"} and changes["unset"] == ["GPUMAGIC_TEST_B"]
    assert changes["cwd"] == os.getcwd() and changes["path"] == sys.path
    assert view.changes()["set"] == {} and view.changes()["unset"] == []   # sent once
    monkeypatch.setenv("GPUMAGIC_TEST_B", "back")
    monkeypatch.chdir(tmp_path)
    follow({"cwd": str(tmp_path / "gone"), "set": {"GPUMAGIC_TEST_C": "3"}, "unset": ["GPUMAGIC_TEST_B"]})
    assert os.getcwd() == str(tmp_path)                     # a directory removed since: the worker stays
    assert os.environ.get("GPUMAGIC_TEST_C") == "3" and "GPUMAGIC_TEST_B" not in os.environ
    monkeypatch.delenv("GPUMAGIC_TEST_C")


def test_a_directory_removed_under_the_kernel_or_a_worker_is_left_behind(monkeypatch, tmp_path):
    gone, home = tmp_path / "gone", tmp_path / "home"
    gone.mkdir()
    home.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()                                            # the kernel's own directory, removed
    assert where_now()["cwd"] is None                        # the cell still runs, as a plain one would
    follow({"cwd": None, "path": None})                     # a worker there stays where it is
    follow({"cwd": str(home), "path": None})                # a worker whose directory was removed moves on
    assert os.getcwd() == str(home)


def test_the_pool_survives_a_directory_it_followed_being_removed(shell, tmp_path, monkeypatch):
    """``%cd scratch``, a cell, ``%cd ..`` and ``rm -r scratch``: the ranks, still in scratch, used to die
    asking where they were (WorkerDied, and a new pool)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.chdir(scratch)
    run_cell(shell, SETUP)
    dp_cell(shell, "--nprocs 2", "first = os.getcwd()\nfor (x,) in loader: model(x)\n")
    assert shell.user_ns["first"] == str(scratch)
    monkeypatch.chdir(tmp_path)
    scratch.rmdir()
    dp_cell(shell, "--nprocs 2", "second = os.getcwd()\nfor (x,) in loader: model(x)\n")
    assert shell.user_ns["second"] == str(tmp_path)
