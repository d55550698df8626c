"""A notebook's TensorBoard SummaryWriter in a %%dataparallel cell (gpumagic.procs.relays).

PyTorch's TensorBoard tutorial makes ``writer = SummaryWriter('runs/...')`` in one cell and calls
``writer.add_scalar('training loss', ...)`` in the training loop. The writer holds a thread and an
open file: before, the cell was refused ("cannot send to the worker processes"), and a writer made
in the cell wrote one event file per rank. Now rank 0's calls are made on the notebook's writer.
"""
from __future__ import annotations

import glob
import pickle

import pytest

from gpumagic.procs.relays import CallRelay, Relays
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell

pytest.importorskip("tensorboard")


@pytest.fixture(autouse=True)
def _close_the_writer(shell):
    """A writer's thread would outlive the test, and a later test's fork-safety check would see it."""
    yield
    writer = shell.user_ns.get("writer")
    if writer is not None and hasattr(writer, "close"):
        writer.close()

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter
torch.manual_seed(0)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 2)), batch_size=16)
writer = SummaryWriter({logdir!r})
losses = []
"""

TRAIN = """
running_loss = 0.0
for epoch in range(2):
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        writer.add_scalar("training loss", loss.item(), epoch * len(loader) + i)
    writer.add_histogram("weight", model.weight, epoch)
same = writer
logdir = writer.log_dir
"""


def _scalars(logdir: str) -> tuple[list, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    files = sorted(glob.glob(f"{logdir}/events.out.tfevents.*"))
    events = EventAccumulator(files[0], size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return files, {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]} | {
        f"histogram {tag}": [e.step for e in events.Histograms(tag)] for tag in events.Tags()["histograms"]}


def test_rank_0s_calls_are_made_on_the_notebooks_writer(shell, tmp_path):
    logdir = str(tmp_path / "runs" / "exp1")
    run_cell(shell, SETUP.format(logdir=logdir))
    ns = shell.user_ns
    writer = ns["writer"]
    _, cap = dp_cell(shell, "--nprocs 2", TRAIN)
    assert ns["writer"] is writer and ns["same"] is writer and ns["logdir"] == logdir
    writer.flush()
    files, scalars = _scalars(logdir)
    assert len(files) == 1                                  # the notebook's event file, no file per rank
    losses = ns["losses"]                                   # rank 0's, 2 epochs x 4 global batches
    assert len(losses) == 8
    assert [s for s, _ in scalars["training loss"]] == list(range(8))
    assert [v for _, v in scalars["training loss"]] == pytest.approx(losses, rel=1e-6)
    assert scalars["histogram weight"] == [0, 1]
    # the writer keeps working in the notebook
    writer.add_scalar("after", 1.0, 0)
    writer.flush()
    assert _scalars(logdir)[1]["after"] == [(0, 1.0)]


def test_calls_that_cannot_reach_the_notebook_are_said_once(shell, tmp_path):
    logdir = str(tmp_path / "runs")
    run_cell(shell, SETUP.format(logdir=logdir))
    with pytest.warns(UserWarning, match="SummaryWriter.add_graph was not made in the notebook") as warned:
        _, cap = dp_cell(shell, "--nprocs 2", """
for x, y in loader:
    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
    writer.add_graph(model, x)                   # holds the rank's module: cannot travel
    writer.add_scalar("bad", "not a number", 0)  # fails in the kernel
""")
    said = [str(w.message) for w in warned if "add_graph" in str(w.message)]
    assert len(said) == 1 and "holds a torch.nn.Module (Linear)" in said[0], said
    assert cap.stderr.count("SummaryWriter.add_scalar, called on rank 0, failed in the kernel") == 1, cap.stderr


def test_a_relay_stands_for_each_logger_once_and_other_ranks_send_nothing():
    class SummaryWriter:                                    # the tutorial's class, by name and module
        def __init__(self):
            self.log_dir, self._hidden, self.file_writer = "runs/x", object(), object()
    SummaryWriter.__module__ = "torch.utils.tensorboard.writer"
    writer, relays = SummaryWriter(), Relays()
    assert relays.stand_in_for(writer) == relays.stand_in_for(writer) == ("relay", 0)
    assert relays.stand_in_for(object()) is None
    assert relays.found == {0: ("SummaryWriter", {"log_dir": "runs/x"}, ["file_writer"])}
    sent: list = []
    quiet = CallRelay(0, "SummaryWriter", {"log_dir": "runs/x"}, sent.append, active=False)
    assert quiet.add_scalar("loss", 1.0, 0) is None and sent == []
    assert quiet.log_dir == "runs/x" and quiet.get_logdir() == "runs/x"
    # an attribute that is no plain value stays in the kernel: said so, not a stand-in function
    # (``writer.file_writer.flush()`` failed with "'function' object has no attribute 'flush'")
    held = CallRelay(0, "SummaryWriter", {}, sent.append, active=True, held=["file_writer"])
    with pytest.raises(AttributeError, match="SummaryWriter.file_writer stays in the kernel"):
        held.file_writer.flush()
    assert not hasattr(held, "file_writer") and sent == []
    loud = CallRelay(0, "SummaryWriter", {}, sent.append, active=True)
    loud.add_scalar("loss", 1.0, step=3)
    assert [(m["method"], pickle.loads(m["args"])) for m in sent] == [("add_scalar", (("loss", 1.0), {"step": 3}))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_every_sharedtrain_workers_calls_reach_the_notebooks_writer(shell, tmp_path, method):
    """Before: spawn refused the writer, and under fork a worker's copy of it (with no writing thread)
    waited for ever."""
    logdir = str(tmp_path / "runs")
    run_cell(shell, SETUP.format(logdir=logdir))
    result, out, _ = run_cell(shell, f"%%sharedtrain --nprocs 2 --start-method {method}\n" + """
for i, (x, y) in enumerate(loader):
    opt.zero_grad(); loss = ((model(x) - y) ** 2).mean(); loss.backward(); opt.step()
    writer.add_scalar(f"loss/{rank}", loss.item(), i)
writer.flush()
""")
    assert result.error_in_exec is None, out
    shell.user_ns["writer"].flush()
    files, scalars = _scalars(logdir)
    assert len(files) == 1
    assert {tag: [s for s, _ in points] for tag, points in scalars.items()} == {"loss/0": [0, 1], "loss/1": [0, 1]}


def test_a_writer_the_cell_makes_logs_rank_0s_curve_only(shell, tmp_path):
    """Made in the cell, each rank's writer would add an event file to the same folder: TensorBoard
    then shows every step twice."""
    logdir = str(tmp_path / "runs" / "in_cell")
    run_cell(shell, SETUP.format(logdir=str(tmp_path / "notebook")) + f"LOGDIR = {logdir!r}\n")
    dp_cell(shell, "--nprocs 2", """
with SummaryWriter(LOGDIR) as own:
    for i, (x, y) in enumerate(loader):
        opt.zero_grad(); loss = ((model(x) - y) ** 2).mean(); loss.backward(); opt.step()
        losses.append(loss.item())
        own.add_scalar("loss", loss.item(), i)
""")
    files, scalars = _scalars(logdir)
    assert len(files) == 1
    assert [s for s, _ in scalars["loss"]] == [0, 1, 2, 3]
    assert [v for _, v in scalars["loss"]] == pytest.approx(shell.user_ns["losses"], rel=1e-6)
