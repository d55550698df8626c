"""What a launch-mode cell leaves in the notebook besides the weights, as a plain cell would (CPU, 2 ranks).

A LightningModule that collects values in itself (``self.losses.append(loss)``, a
common way to plot them after ``fit``) keeps them, and a LightningDataModule keeps
what its ``prepare_data``/``setup`` set on it. A name the cell binds to what cannot
come back (``trainer = L.Trainer(...)``) is unbound in the notebook, as the note
says, rather than left holding an earlier cell's object.
"""
from __future__ import annotations

import pytest

from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell

pytest.importorskip("lightning")

CPU2 = "--nprocs 2"

SETUP = """\
import torch
import lightning as L
torch.manual_seed(0)
X = torch.randn(64, 8)
Y = X.sum(1, keepdim=True)

class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.losses, self.epochs = [], {}

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.losses.append(loss)                  # with its graph, as a plain cell allows
        return loss

    def on_train_epoch_end(self):
        self.epochs[self.current_epoch] = float(torch.stack(self.losses).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

class Data(L.LightningDataModule):
    def setup(self, stage):
        self.train_set = torch.utils.data.TensorDataset(X, Y)
        self.features = X.shape[1]                # set by setup(), read by the notebook afterwards

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=8)

lit, data = Regressor(), Data()
losses = lit.losses
trainer = "the trainer of an earlier plain run"
"""

FIT = """\
trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=2, logger=False, enable_checkpointing=False,
                    enable_model_summary=False, enable_progress_bar=False)
trainer.fit(lit, datamodule=data)
rank0_losses = [float(x) for x in lit.losses]
"""


def test_lightning_module_and_datamodule_keep_what_they_collected(shell):
    result, text, _ = run_cell(shell, SETUP)
    assert result.success, text
    ns = shell.user_ns
    _, cap = dp_cell(shell, CPU2, FIT)
    lit = ns["lit"]
    # rank 0's 2 epochs of 4 steps, in the notebook's own list, without their graphs
    assert lit.losses is ns["losses"] and len(lit.losses) == 8
    assert [float(x) for x in lit.losses] == ns["rank0_losses"]
    assert all(not x.requires_grad for x in lit.losses)
    assert sorted(lit.epochs) == [0, 1]
    assert ns["data"].features == 8
    assert "trainer (holds a Trainer" in cap.stderr
    assert "trainer" not in ns        # not the earlier run's


def test_notebook_objects_rebound_to_their_framework_wrappers_stay(shell):
    """``loader = accelerator.prepare(loader)`` cannot come back either, but the notebook's loader is what
    the cell trained with: it stays bound, while the cell's ``accelerator`` replaces an earlier value."""
    pytest.importorskip("accelerate")
    result, text, _ = run_cell(shell, SETUP + """
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
net = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
accelerator = "an earlier value"
""")
    assert result.success, text
    ns = shell.user_ns
    loader, opt, net = ns["loader"], ns["opt"], ns["net"]
    _, cap = dp_cell(shell, CPU2, """\
from accelerate import Accelerator
accelerator = Accelerator()
net, opt, loader = accelerator.prepare(net, opt, loader)
for x, y in loader:
    opt.zero_grad()
    accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
    opt.step()
""")
    assert "loader (holds a DataLoader" in cap.stderr
    assert ns["loader"] is loader and ns["opt"] is opt and ns["net"] is net
    assert "accelerator" not in ns


SPLIT = """\
import torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset, random_split
torch.manual_seed(0)
X = torch.randn(64, 8)
Y = X.sum(1, keepdim=True)
full = TensorDataset(X, Y)

class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

class Data(L.LightningDataModule):
    def setup(self, stage):                       # Lightning's MNIST pattern
        self.train_set, self.val_set = random_split(full, [48, 16], generator=torch.Generator().manual_seed(1))
        own = TensorDataset(X * 2, Y)             # made here: both splits share it, over the notebook's Y
        self.small_train, self.small_val = random_split(own, [60, 4], generator=torch.Generator().manual_seed(2))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=8)

lit, dm = Regressor(), Data()
"""


def test_datasets_a_datamodule_sets_in_setup_come_back_over_the_notebooks_dataset(shell):
    """``self.train_set, self.val_set = random_split(full, ...)`` in a DataModule's ``setup()``: a plain
    cell leaves them set; launch mode left them out ("dm.train_set (not a plain value)")."""
    result, text, _ = run_cell(shell, SPLIT)
    assert result.success, text
    ns = shell.user_ns
    from torch.utils.data import Subset, random_split
    dp_cell(shell, CPU2, """\
trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_model_summary=False, enable_progress_bar=False)
trainer.fit(lit, datamodule=dm)
""")
    dm, full = ns["dm"], ns["full"]
    import torch
    train, val = random_split(full, [48, 16], generator=torch.Generator().manual_seed(1))   # as a plain cell
    assert isinstance(dm.train_set, Subset) and isinstance(dm.val_set, Subset)
    assert dm.train_set.dataset is full and dm.val_set.dataset is full      # the notebook's, not a copy
    assert list(dm.train_set.indices) == list(train.indices) and list(dm.val_set.indices) == list(val.indices)
    own = dm.small_train.dataset
    assert dm.small_val.dataset is own and own.tensors[1] is ns["Y"]
    assert torch.equal(own.tensors[0], ns["X"] * 2)
    assert len(dm.small_train) == 60 and len(dm.small_val) == 4
    from tests.dataparallel_helpers import last_result
    assert not any(n.startswith(("dm.train_set", "dm.val_set", "dm.small")) for n in last_result().not_returned)
