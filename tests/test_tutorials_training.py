"""The PyTorch mnist example as a notebook, trained under %%dataparallel: its evaluation prints what
a plain cell prints, its scheduler does not warn, and what it returns keeps its type.

The cells are pytorch/examples' mnist/main.py split as a user would (``Net``, ``train``, ``test``,
Adadelta, StepLR), on a small synthetic dataset in place of MNIST's download; run through a real
``InteractiveShell`` and through a real Jupyter kernel (nbclient).
"""
from __future__ import annotations

import re
import warnings

import pytest

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.notebook_helpers import run_notebook, stream_text
from tests.tutorial_mnist import MNIST_NET, MNIST_TEST

MNIST_DATA = """
from torch.utils.data import DataLoader

torch.manual_seed(1)
args = argparse.Namespace(log_interval=4, dry_run=False, epochs=2)
device = torch.device("cpu")
images = torch.randn(384, 1, 12, 12)
labels = (images[:, 0, :6, :].mean(dim=(1, 2)) > 0).long() + 2 * (images[:, 0, 6:, :].mean(dim=(1, 2)) > 0).long()
train_loader = DataLoader(TensorDataset(images[:256], labels[:256]), batch_size=32, shuffle=True)
test_loader = DataLoader(TensorDataset(images[256:], labels[256:]), batch_size=50)
model = Net().to(device)
optimizer = optim.Adadelta(model.parameters(), lr=1.0)
scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
"""

MNIST_SETUP = MNIST_NET + MNIST_TEST + MNIST_DATA

MNIST_LOOP = """%%dataparallel --devices cpu --nprocs 2
for epoch in range(1, args.epochs + 1):
    train(args, model, device, train_loader, optimizer, epoch)
    test(model, device, test_loader)
    scheduler.step()
"""

TEST_LINE = re.compile(r"Test set: Average loss: [\d.]+, Accuracy: \d+/128 \(\d+%\)")


def cell(shell, source: str) -> str:
    """Run a cell that must succeed; what it printed."""
    result, text, _ = run_cell(shell, source)
    assert result.success, (result.error_before_exec or result.error_in_exec, text)
    return text


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def test_mnist_evaluation_in_a_training_cell_prints_what_a_plain_cell_prints(shell):
    cell(shell, MNIST_SETUP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trained = cell(shell, MNIST_LOOP)
    evaluations = TEST_LINE.findall(trained)
    assert len(evaluations) == 2, trained          # one evaluation per epoch, over all 128 test images
    plain = cell(shell, "test(model, device, test_loader)")
    # The weights came back: the notebook's model scores exactly what the last epoch printed.
    assert TEST_LINE.findall(plain) == evaluations[-1:]
    assert "overridden" not in trained and not [w for w in caught if "overridden" in str(w.message)]
    assert "split across the ranks" not in trained
    assert not [w for w in caught if "split across the ranks" in str(w.message)]
    assert shell.user_ns["scheduler"].last_epoch == 2
    assert shell.user_ns["optimizer"].param_groups[0]["lr"] == pytest.approx(0.49)


def test_a_split_loader_no_step_follows_is_named_in_a_warning(shell):
    cell(shell, MNIST_SETUP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cell(shell, """%%dataparallel --devices cpu --nprocs 2
train(args, model, device, train_loader, optimizer, 1)
correct = 0
for data, target in test_loader:           # evaluation with gradients on: split, and rank 0's half
    correct += model(data).argmax(dim=1).eq(target).sum().item()
""")
    messages = [str(w.message) for w in caught if "split across the ranks" in str(w.message)]
    assert len(messages) == 1 and "DataLoader 'test_loader'" in messages[0], [str(w.message) for w in caught]
    assert shell.user_ns["correct"] <= 64     # rank 0's share of the 128 test images


def test_returned_values_keep_their_type(shell):
    cell(shell, MNIST_SETUP)
    cell(shell, """%%dataparallel --devices cpu --nprocs 2
from collections import namedtuple
Stats = namedtuple("Stats", "steps last_loss")
for data, target in train_loader:
    optimizer.zero_grad()
    loss = F.nll_loss(model(data), target)
    loss.backward()
    optimizer.step()
shape = data.shape
stats = Stats(len(train_loader), loss)
""")
    import torch
    shape, stats = shell.user_ns["shape"], shell.user_ns["stats"]
    assert type(shape) is torch.Size and shape == torch.Size([16, 1, 12, 12])   # rank 0's half batch
    assert type(stats).__name__ == "Stats" and stats.steps == 8 and stats.last_loss.dim() == 0


def test_mnist_in_a_jupyter_kernel_evaluates_whole(tmp_path):
    nb = run_notebook(("%load_ext gpumagic", MNIST_SETUP, MNIST_LOOP, "test(model, device, test_loader)",
                       "%dataparallel stop"), timeout=300)
    trained, plain = stream_text(nb.cells[2]), stream_text(nb.cells[3])
    evaluations = TEST_LINE.findall(trained)
    assert len(evaluations) == 2 and TEST_LINE.findall(plain) == evaluations[-1:], (trained, plain)
    # Batch 4 of 8: the progress is one process's; len(data) is rank 0's half of the batch of 32.
    assert "Train Epoch: 2 [64/256 (50%)]" in trained
    assert "overridden" not in trained + plain
