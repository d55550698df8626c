"""Files a %%dataparallel cell writes are rank 0's, written once (gpumagic.dataparallel.rank.files).

Before, every rank saved the tutorial checkpoint to the same path: the file held whichever rank
finished last (rank 1's loss beside the notebook's rank 0 values), and two writes at once could
interleave; a log the loop appended to had each line once per rank.
"""
from __future__ import annotations

import glob
import io
import os
import tempfile
import threading
import time

import pytest
import torch

from gpumagic.dataparallel.rank.files import writing_once
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, dp_pool

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = DataLoader(TensorDataset(torch.randn(128, 16), torch.randn(128, 2)), batch_size=16)
"""

# "Saving & loading a general checkpoint", from PyTorch's tutorial, inside the training loop; then
# each rank reads back what it saved, as a cell that reloads its best checkpoint does.
TUTORIAL = """
import torch.distributed as dist
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    torch.save({"epoch": epoch, "model_state_dict": model.state_dict(),
                "optimizer_state_dict": opt.state_dict(), "loss": loss}, PATH)
torch.save({"rank": dist.get_rank()}, MINE)
read_back = [None, None]
dist.all_gather_object(read_back, torch.load(MINE)["rank"])
"""


def _private_copies() -> set:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "gpumagic-rank*-*")))


def test_the_tutorials_checkpoint_is_rank_0s_and_each_rank_reads_its_own_save(shell, tmp_path):
    run_cell(shell, SETUP + f"PATH = {str(tmp_path / 'ckpt.pt')!r}\nMINE = {str(tmp_path / 'mine.pt')!r}\n")
    before = _private_copies()
    dp_cell(shell, "--nprocs 2", TUTORIAL)
    ns = shell.user_ns
    checkpoint = torch.load(ns["PATH"])
    assert checkpoint["epoch"] == 1
    assert float(checkpoint["loss"]) == float(ns["loss"])           # rank 0's loss, as the notebook holds
    for name, tensor in ns["model"].state_dict().items():             # the notebook's trained weights
        assert torch.equal(checkpoint["model_state_dict"][name], tensor), name
    assert torch.load(ns["MINE"]) == {"rank": 0}
    assert ns["read_back"] == [0, 1]                                  # rank 1 read its own save
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "mine.pt"]     # no partial files
    assert _private_copies() == before                                # rank 1's copies went with the cell


def test_a_log_the_loop_appends_to_has_each_line_once_and_each_rank_reads_its_own(shell, tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("epoch,loss\n")                          # the header, from an earlier cell
    run_cell(shell, SETUP + f"LOG = {str(log)!r}\nNOTE = {str(tmp_path / 'note.txt')!r}\n"
                            f"ARRAY = {str(tmp_path / 'array.npy')!r}\n")
    dp_cell(shell, "--nprocs 2", """
import pathlib
import torch.distributed as dist
def log_line(epoch, loss):                                # a notebook function writes it too
    with open(LOG, "a") as f:
        f.write(f"{epoch},{loss:.4f}\\n")
for epoch in range(3):
    for x, y in loader:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    log_line(epoch, loss.item())
pathlib.Path(NOTE).write_text(f"rank {dist.get_rank()}")
import numpy as np
np.save(ARRAY, np.full(3, dist.get_rank()))              # a data writer the cell calls
lines = [None, None]
dist.all_gather_object(lines, (len(open(LOG).read().splitlines()), pathlib.Path(NOTE).read_text()))
""")
    ns = shell.user_ns
    assert log.read_text().splitlines()[0] == "epoch,loss" and len(log.read_text().splitlines()) == 4
    assert log.read_text().splitlines()[-1] == f"2,{ns['loss'].item():.4f}"     # rank 0's, as the notebook holds
    assert (tmp_path / "note.txt").read_text() == "rank 0"
    # each rank read back what it wrote (rank 1's copy began from the file as it first appended to it,
    # which may hold a line rank 0 had appended by then)
    assert ns["lines"][0] == (4, "rank 0") and ns["lines"][1][0] >= 4 and ns["lines"][1][1] == "rank 1"
    assert __import__("numpy").load(tmp_path / "array.npy").tolist() == [0, 0, 0]
    assert sorted(os.listdir(tmp_path)) == ["array.npy", "log.csv", "note.txt"]


def test_another_ranks_saves_stay_private_and_go_with_the_cell(tmp_path):
    target = tmp_path / "model.pt"
    buffer = io.BytesIO()
    save, load = torch.save, torch.load
    before = _private_copies()
    with writing_once(rank=1):
        torch.save({"w": 1}, target)
        torch.save({"w": 2}, str(target))                   # the same path, spelled otherwise
        torch.save({"in": "memory"}, buffer)                # buffers and open files are untouched
        assert torch.load(target) == {"w": 2} and not target.exists()
        assert len(_private_copies() - before) == 1
    assert (torch.save, torch.load) == (save, load)
    assert _private_copies() == before and not target.exists()
    buffer.seek(0)
    assert torch.load(buffer) == {"in": "memory"}


def test_rank_0_writes_whole_or_not_at_all(tmp_path):
    target = tmp_path / "model.pt"
    with writing_once(rank=0):
        torch.save({"w": 1}, target)
        with pytest.raises(TypeError, match="cannot pickle"):
            torch.save({"lock": threading.Lock()}, target)   # cannot be pickled: the old file stays
    assert torch.load(target) == {"w": 1} and os.listdir(tmp_path) == ["model.pt"]


@pytest.mark.parametrize("write, error", [
    ("torch.save({'w': 1}, NOWHERE + '/ckpt.pt')", "RuntimeError"),     # a directory the cell did not make
    ("open(NOWHERE + '/log.txt', 'w')", "FileNotFoundError"),
    ("open(THERE, 'x')", "FileExistsError"),                          # 'x' of a file from an earlier cell
    ("open(HERE, 'w')", "IsADirectoryError"),
])
def test_a_write_that_fails_on_rank_0_fails_alike_on_every_rank_and_the_pool_stays(shell, tmp_path, write, error):
    """Rank 0's write of the real file failed while rank 1 wrote its private copy and went on: the
    failures differed, so the pool was ended (the next cell started it again)."""
    (tmp_path / "there.txt").write_text("old")
    time.sleep(0.05)                                        # (an earlier cell's: its time is before this one's)
    run_cell(shell, SETUP + f"NOWHERE = {str(tmp_path / 'nowhere')!r}\nTHERE = {str(tmp_path / 'there.txt')!r}\n"
                            f"HERE = {str(tmp_path)!r}\n")
    dp_cell(shell, "--nprocs 2", "for x, y in loader: model(x)\n")
    pids = dp_pool().pids
    with pytest.raises(Exception) as raised:
        dp_cell(shell, "--nprocs 2", "for x, y in loader: model(x)\n" + write + "\n")
    assert type(raised.value).__name__ == "WorkerError" and error in str(raised.value)
    assert dp_pool() is not None and dp_pool().alive and dp_pool().pids == pids
    assert (tmp_path / "there.txt").read_text() == "old" and not (tmp_path / "nowhere").exists()


def test_another_rank_creates_its_copy_of_a_file_rank_0_made_in_the_cell(tmp_path):
    """``open(path, 'x')`` of a file that did not exist as the cell began: rank 0 makes it; rank 1 must not
    find rank 0's file there and fail (on one process it would not exist yet)."""
    target = tmp_path / "new.txt"
    code = compile(f"with open({str(target)!r}, 'x') as f: f.write('rank 1')\n", "<cell-x>", "exec")
    with writing_once(rank=1):
        time.sleep(0.06)                                    # rank 0 was quicker
        target.write_text("rank 0")
        exec(code, {})
    assert target.read_text() == "rank 0"


def test_rank_0_saves_through_a_link_to_the_file_it_points_to(tmp_path):
    """The save under a temporary name, renamed, replaced the link (or a device: as root, /dev/null)."""
    (tmp_path / "store").mkdir()
    link = tmp_path / "latest.pt"
    link.symlink_to(tmp_path / "store" / "run1.pt")
    pipe = tmp_path / "pipe"                                # not a file (a stand-in for /dev/null)
    os.mkfifo(pipe)
    read: list = []
    reader = threading.Thread(target=lambda: read.append(pipe.read_bytes()), daemon=True)
    reader.start()
    with writing_once(rank=0):
        torch.save({"w": 1}, link)
        torch.save({"w": 2}, pipe)                          # written into, not replaced by a file
    reader.join(10)
    assert link.is_symlink() and torch.load(tmp_path / "store" / "run1.pt") == {"w": 1}
    assert not pipe.is_file() and torch.load(io.BytesIO(read[0])) == {"w": 2}


def test_a_cell_that_writes_nothing_makes_no_private_directory():
    """A rank killed mid-cell (an interrupt, another rank's failure) cannot remove its directory: one was
    left in the temporary directory by every such cell, writing or not."""
    before = _private_copies()
    with writing_once(rank=1):
        assert _private_copies() == before


def test_a_scripted_and_an_exported_model_are_saved_once_rank_0s(shell, tmp_path):
    """``torch.jit.save``/``torch.export.save`` write from C++, past ``open()``: every rank wrote the same
    path before. Now the file is rank 0's, byte for byte, written once, and each rank loads its own."""
    here = tmp_path / "here"
    here.mkdir()
    run_cell(shell, SETUP + f"JIT = {str(tmp_path / 'model.ts')!r}\nPT2 = {str(tmp_path / 'model.pt2')!r}\n"
                            f"HERE = {str(here)!r}\n")
    dp_cell(shell, "--nprocs 2", """
import os
import torch.distributed as dist
for x, y in loader:
    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
mark = torch.nn.Linear(1, 1, bias=False)
with torch.no_grad():
    mark.weight.fill_(dist.get_rank())           # what each rank writes differs
scripted, exported = torch.jit.script(mark), torch.export.export(mark, (torch.ones(1, 1),))
torch.jit.save(scripted, JIT)
torch.export.save(exported, PT2)
if dist.get_rank() == 0:                          # the same objects saved as a plain process saves them
    torch.jit.save.__wrapped__(scripted, os.path.join(HERE, "model.ts"))
    torch.export.save.__wrapped__(exported, os.path.join(HERE, "model.pt2"))
dist.barrier()                                    # rank 0 has written by now
stamps = [None, None]
dist.all_gather_object(stamps, (os.stat(JIT).st_mtime_ns, os.stat(PT2).st_mtime_ns))
mine = [None, None]
dist.all_gather_object(mine, (torch.jit.load(JIT).weight.item(),
                              torch.export.load(PT2).module()(torch.ones(1, 1)).item()))
""")
    ns = shell.user_ns
    assert ns["mine"] == [(0.0, 0.0), (1.0, 1.0)]                  # each rank read back its own save
    assert ns["stamps"][0] == ns["stamps"][1]                       # written once: rank 1 wrote no real file
    assert sorted(os.listdir(tmp_path)) == ["here", "model.pt2", "model.ts"]
    # byte for byte rank 0's, as one process writes it (the archive's records are named after the file:
    # a temporary name would show inside)
    for name in ("model.ts", "model.pt2"):
        assert (tmp_path / name).read_bytes() == (here / name).read_bytes(), name
    assert torch.jit.load(str(tmp_path / "model.ts")).weight.item() == 0.0
    assert torch.export.load(str(tmp_path / "model.pt2")).module()(torch.ones(1, 1)).item() == 0.0
    torch.save({"w": 1}, str(here / "ckpt.pt"))
    dp_cell(shell, "--nprocs 2", f"model.train()\ntorch.save({{'w': 1}}, {str(tmp_path / 'ckpt.pt')!r})\n")
    assert (tmp_path / "ckpt.pt").read_bytes() == (here / "ckpt.pt").read_bytes()
