"""Tutorials run first on one device with %%ondevice, then further: plain cells, other %%ondevice cells,
%%dataparallel and %%sharedtrain.

The cells are the PyTorch quickstart (FashionMNIST replaced by a small synthetic set of the same
shape) and pytorch/examples' mnist main.py (``torch.accelerator``), split as a user would; run through
a real ``InteractiveShell`` and through a real Jupyter kernel (nbclient).
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from gpumagic.cell.device_values import DeviceName, stands_for_cell_device
from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.notebook_helpers import run_notebook, stream_text
from tests.tutorial_mnist import MNIST_NET

DATA = """%%ondevice cpu
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# FashionMNIST's shape (1x28x28 images, 10 classes): noise around one pattern per class
torch.manual_seed(0)
labels = torch.randint(0, 10, (320,))
images = torch.randn(320, 1, 28, 28) + torch.randn(10, 1, 28, 28)[labels]
training_data = TensorDataset(images[:256], labels[:256])
test_data = TensorDataset(images[256:], labels[256:])

batch_size = 64

# Create data loaders.
train_dataloader = DataLoader(training_data, batch_size=batch_size)
test_dataloader = DataLoader(test_data, batch_size=batch_size)

for X, y in test_dataloader:
    print(f"Shape of X [N, C, H, W]: {X.shape}")
    print(f"Shape of y: {y.shape} {y.dtype}")
    break
"""

# The current quickstart asks torch.accelerator; the one in the issue asked torch.cuda.
DEVICES = {
    "accelerator": 'device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() '
                   'else "cpu"',
    "cuda": 'device = "cuda" if torch.cuda.is_available() else "cpu"',
}

MODEL = """%%ondevice cpu
{device_line}
print(f"Using {{device}} device")

# Define model
class NeuralNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28*28, 64),
            nn.ReLU(),
            nn.Linear(64, 64),
            nn.ReLU(),
            nn.Linear(64, 10)
        )

    def forward(self, x):
        x = self.flatten(x)
        logits = self.linear_relu_stack(x)
        return logits

model = NeuralNetwork().to(device)
print(model)
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
"""

FUNCTIONS = """%%ondevice cpu
def train(dataloader, model, loss_fn, optimizer):
    size = len(dataloader.dataset)
    model.train()
    for batch, (X, y) in enumerate(dataloader):
        X, y = X.to(device), y.to(device)

        # Compute prediction error
        pred = model(X)
        loss = loss_fn(pred, y)

        # Backpropagation
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        if batch % 100 == 0:
            loss, current = loss.item(), (batch + 1) * len(X)
            print(f"loss: {loss:>7f}  [{current:>5d}/{size:>5d}]")

def test(dataloader, model, loss_fn):
    size = len(dataloader.dataset)
    num_batches = len(dataloader)
    model.eval()
    test_loss, correct = 0, 0
    with torch.no_grad():
        for X, y in dataloader:
            X, y = X.to(device), y.to(device)
            pred = model(X)
            test_loss += loss_fn(pred, y).item()
            correct += (pred.argmax(1) == y).type(torch.float).sum().item()
    test_loss /= num_batches
    correct /= size
    print(f"Test Error: \\n Accuracy: {(100*correct):>0.1f}%, Avg loss: {test_loss:>8f} \\n")

def batch_device(dataloader):
    X, y = next(iter(dataloader))
    return str(X.to(device).device)
"""

EPOCHS = """%%ondevice cpu
epochs = 3
for t in range(epochs):
    print(f"Epoch {t+1}\\n-------------------------------")
    train(train_dataloader, model, loss_fn, optimizer)
    test(test_dataloader, model, loss_fn)
print("Done!")
"""

AVG_LOSS = re.compile(r"Avg loss: ([\d.]+)")


def cell(shell, source: str) -> str:
    """Run a cell that must succeed; what it printed."""
    result, text, _ = run_cell(shell, source)
    assert result.success, (result.error_before_exec or result.error_in_exec, text)
    return text


def weights(shell) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in shell.user_ns["model"].parameters()])


def avg_loss(shell) -> float:
    found = AVG_LOSS.findall(cell(shell, "test(test_dataloader, model, loss_fn)"))
    assert len(found) == 1
    return float(found[0])


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


@pytest.fixture
def quickstart(shell, request):
    """The quickstart's set-up cells, run under %%ondevice cpu."""
    out = cell(shell, DATA)
    assert "Shape of X [N, C, H, W]: torch.Size([64, 1, 28, 28])" in out
    out = cell(shell, MODEL.format(device_line=DEVICES[request.param]))
    assert "Using cpu device" in out if request.param == "accelerator" else "Using cuda device" in out
    cell(shell, FUNCTIONS)
    return shell


@pytest.mark.parametrize("quickstart", list(DEVICES), indirect=True)
def test_quickstart_device_holds_what_it_meant(quickstart):
    ns = quickstart.user_ns
    assert ns["device"] == "cpu" and type(ns["device"]) is DeviceName and stands_for_cell_device(ns["device"])
    assert "__gpumagic_device__" not in ns
    # A plain cell written as the tutorial's: the device the set-up ran on.
    cell(quickstart, "X, y = next(iter(test_dataloader))\nX, y = X.to(device), y.to(device)\nlogits = model(X)")
    assert ns["logits"].device.type == "cpu" and ns["logits"].shape == (64, 10)


@pytest.mark.parametrize("quickstart", ["cuda"], indirect=True)
def test_quickstart_train_in_a_plain_cell_and_in_ondevice_cells(quickstart):
    shell, ns = quickstart, quickstart.user_ns
    before, loss_before = weights(shell), avg_loss(shell)
    out = cell(shell, "train(train_dataloader, model, loss_fn, optimizer)")
    assert re.search(r"loss: +[\d.]+ +\[ +64/ +256\]", out), out
    assert not torch.equal(weights(shell), before)
    out = cell(shell, EPOCHS)
    assert out.count("Test Error") == 3 and "Done!" in out
    assert avg_loss(shell) < loss_before
    assert ns["batch_device"](ns["train_dataloader"]) == "cpu"
    # Under another %%ondevice cell the functions follow that cell's device: a dry run on meta.
    cell(shell, "%%ondevice meta\nwhere = batch_device(train_dataloader)\nfresh = NeuralNetwork()\n")
    assert ns["where"] == "meta" and all(p.is_meta for p in ns["fresh"].parameters())
    cell(shell, "again = NeuralNetwork()")         # a plain cell: the device the class was made for
    assert all(p.device.type == "cpu" for p in ns["again"].parameters())
    assert ns["device"] == "cpu"


@pytest.mark.parametrize("quickstart", list(DEVICES), indirect=True)
def test_quickstart_train_under_dataparallel(quickstart):
    shell, ns = quickstart, quickstart.user_ns
    before, loss_before = weights(shell), avg_loss(shell)
    out = cell(shell, "%%dataparallel --devices cpu --nprocs 2\n"
                      "for t in range(3):\n    train(train_dataloader, model, loss_fn, optimizer)\n"
                      "where = batch_device(train_dataloader)\n")
    assert re.search(r"loss: +[\d.]+ +\[ +32/ +256\]", out), out      # rank 0's half of the batch of 64
    assert "2 ranks (gloo), 12 optimizer steps each" in out
    assert not torch.equal(weights(shell), before) and torch.isfinite(weights(shell)).all()
    assert avg_loss(shell) < loss_before                                 # the trained weights came back
    assert ns["where"] == "cpu" and ns["device"] == "cpu" and type(ns["device"]) is DeviceName


@pytest.mark.parametrize("quickstart", ["accelerator"], indirect=True)
@pytest.mark.parametrize("flags", ["", "--start-method spawn"])
def test_quickstart_train_under_sharedtrain(quickstart, flags):
    shell, ns = quickstart, quickstart.user_ns
    before, loss_before = weights(shell), avg_loss(shell)
    out = cell(shell, f"%%sharedtrain --nprocs 2 {flags}\n"
                      "for t in range(3):\n    train(train_dataloader, model, loss_fn, optimizer)\n"
                      "report(where=batch_device(train_dataloader), kind=type(device).__name__)\n")
    assert out.count("[rank 0] loss:") == 3 and out.count("[rank 1] loss:") == 3, out
    method = re.search(r"2 workers \((\w+)\) on cpu", out)
    assert method and method.group(1) == ("spawn" if flags else ns["sharedtrain"].start_method), out
    assert not torch.equal(weights(shell), before) and torch.isfinite(weights(shell)).all()
    assert avg_loss(shell) < loss_before
    history = ns["sharedtrain"].history
    for rank in (0, 1):
        assert [(r["where"], r["kind"]) for r in history[rank]] == [("cpu", "DeviceName")]


def test_sharedtrain_does_not_fork_once_autograd_threads_run():
    # Where torch sees a GPU, the kernel's first backward pass starts autograd's device threads, and a
    # forked worker's own backward pass then fails: train() in a plain cell, then %%sharedtrain.
    from gpumagic.errors import UsageError
    from gpumagic.procs.start import autograd_threads_started, choose_start_method
    assert choose_start_method(None, "cpu", False, [], "linux", autograd_threads=False)[0] == "fork"
    method, why = choose_start_method(None, "cpu", False, [], "linux", autograd_threads=True)
    assert method == "forkserver" and "autograd's GPU threads" in why
    with pytest.raises(UsageError, match="autograd's threads do not survive fork"):
        choose_start_method("fork", "cpu", False, [], "linux", autograd_threads=True)
    torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum().backward()
    assert autograd_threads_started() == (torch.cuda.device_count() > 0)


# -- pytorch/examples mnist: torch.accelerator ------------------------------------------------------

MNIST_MAIN = """%%ondevice {device}
parser = argparse.ArgumentParser(description='PyTorch MNIST Example')
parser.add_argument('--batch-size', type=int, default=32)
parser.add_argument('--test-batch-size', type=int, default=50)
parser.add_argument('--epochs', type=int, default=1)
parser.add_argument('--lr', type=float, default=1.0)
parser.add_argument('--gamma', type=float, default=0.7)
parser.add_argument('--no-accel', action='store_true')
parser.add_argument('--dry-run', action='store_true')
parser.add_argument('--seed', type=int, default=1)
parser.add_argument('--log-interval', type=int, default=4)
args = parser.parse_args([])

use_accel = not args.no_accel and torch.accelerator.is_available()

torch.manual_seed(args.seed)

if use_accel:
    device = torch.accelerator.current_accelerator()
else:
    device = torch.device("cpu")

train_kwargs = {{'batch_size': args.batch_size}}
test_kwargs = {{'batch_size': args.test_batch_size}}
if use_accel:
    accel_kwargs = {{'num_workers': 0,
                    'shuffle': True}}
    train_kwargs.update(accel_kwargs)
    test_kwargs.update(accel_kwargs)

images = torch.randn(256, 1, 12, 12)
labels = (images[:, 0, :6, :].mean(dim=(1, 2)) > 0).long()
dataset1 = TensorDataset(images[:192], labels[:192])
dataset2 = TensorDataset(images[192:], labels[192:])
train_loader = torch.utils.data.DataLoader(dataset1,**train_kwargs)
test_loader = torch.utils.data.DataLoader(dataset2, **test_kwargs)

model = Net().to(device)
optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
"""

MNIST_LOOP = """%%ondevice {device}
for epoch in range(1, args.epochs + 1):
    train(args, model, device, train_loader, optimizer, epoch)
    scheduler.step()
"""


def test_mnist_accelerator_code_runs_on_cpu(shell):
    cell(shell, MNIST_NET)
    cell(shell, MNIST_MAIN.format(device="cpu"))
    ns = shell.user_ns
    assert ns["use_accel"] is True                      # DEVICE is the accelerator the code asks for
    assert ns["device"] == torch.device("cpu") and stands_for_cell_device(ns["device"])
    before = [p.detach().clone() for p in ns["model"].parameters()]
    out = cell(shell, MNIST_LOOP.format(device="cpu"))
    assert out.count("Train Epoch: 1") == 2, out         # batches 0 and 4 of 6
    assert all(not torch.equal(a, b) for a, b in zip(before, ns["model"].parameters()))
    cell(shell, "train(args, model, device, train_loader, optimizer, 2)")   # and in a plain cell
    assert ns["scheduler"].last_epoch == 1


def test_mnist_accelerator_code_on_meta_is_a_dry_run(shell):
    cell(shell, MNIST_NET)
    out = cell(shell, MNIST_MAIN.format(device="meta"))
    ns = shell.user_ns
    assert "Cannot copy out of meta tensor" not in out
    assert ns["device"] == torch.device("meta") and all(p.is_meta for p in ns["model"].parameters())
    cell(shell, """%%ondevice meta
data, target = next(iter(train_loader))
data, target = data.to(device), target.to(device)
optimizer.zero_grad()
loss = F.nll_loss(model(data), target)
loss.backward()
optimizer.step()
""")
    assert ns["loss"].is_meta and ns["data"].is_meta and ns["loss"].shape == ()
    # The tutorial's train() reads a value (loss.item()), which a meta tensor does not have: torch says so there.
    result, text, _ = run_cell(shell, MNIST_LOOP.format(device="meta"))
    err = result.error_in_exec
    assert isinstance(err, RuntimeError) and str(err) == "Tensor.item() cannot be called on meta tensors", text
    assert "Cannot copy out of meta tensor" not in text


# -- the same notebook in a Jupyter kernel -----------------------------------------------------------

CHECKS = """import json
print(json.dumps({"device": device, "device_type": type(device).__name__,
                  "weights": float(sum(p.detach().abs().sum() for p in model.parameters()))}))
"""


def test_quickstart_in_a_jupyter_kernel():
    sources = [
        "%load_ext gpumagic", DATA, MODEL.format(device_line=DEVICES["cuda"]), FUNCTIONS, CHECKS,
        "train(train_dataloader, model, loss_fn, optimizer)\ntest(test_dataloader, model, loss_fn)",
        EPOCHS,
        "%%dataparallel --devices cpu --nprocs 2\ntrain(train_dataloader, model, loss_fn, optimizer)\n"
        "where = batch_device(train_dataloader)",
        "%%sharedtrain --nprocs 2\ntrain(train_dataloader, model, loss_fn, optimizer)",
        "test(test_dataloader, model, loss_fn)\nprint(where)", CHECKS, "%dataparallel stop",
    ]
    nb = run_notebook(sources, timeout=300)

    def text(index):
        return stream_text(nb.cells[index])
    assert "Using cuda device" in text(2)                      # the cell printed what it saw, as written
    assert "after the cell on cpu, device is 'cpu' (what 'cuda' meant in it)" in text(2)
    first, last = (json.loads(text(i).strip().splitlines()[-1]) for i in (4, 10))
    assert first["device"] == last["device"] == "cpu" and last["device_type"] == "DeviceName"
    assert first["weights"] != last["weights"]
    losses = [float(x) for i in (5, 6, 9) for x in AVG_LOSS.findall(text(i))]
    assert len(losses) == 5 and losses[-1] < losses[0], losses
    assert "2 ranks (gloo)" in text(7) and "[rank 1] loss:" in text(8)
    assert text(9).strip().endswith("cpu")
    for index in range(len(sources)):
        assert not [o for o in nb.cells[index].outputs if o.output_type == "error"], index
