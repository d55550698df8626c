"""Tutorials set up under %%ondevice cpu on a GPU machine, then run on the GPUs; the seed article's CUDA
queries on a real GPU.

Run on the GPU machine: ``python -m pytest tests/test_tutorials_ondevice_gpu.py -m gpu -q``.
"""
from __future__ import annotations

import pytest
import torch

from gpumagic.cell.device_values import DeviceName
from gpumagic.cell.rewrite.cuda_calls import HostStream
from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.test_magics_ondevice import ARTICLE_STREAM
from tests.test_tutorials_ondevice import (
    DATA,
    DEVICES,
    FUNCTIONS,
    MNIST_MAIN,
    MNIST_NET,
    MODEL,
    avg_loss,
    cell,
    weights,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def set_up_on_cpu(shell, device_line: str = "accelerator"):
    cell(shell, DATA)
    out = cell(shell, MODEL.format(device_line=DEVICES[device_line]))
    assert ("Using cpu device" if device_line == "accelerator" else "Using cuda device") in out
    cell(shell, FUNCTIONS)
    assert all(p.device.type == "cpu" for p in shell.user_ns["model"].parameters())


def test_quickstart_set_up_on_cpu_trains_on_the_gpu(shell):
    set_up_on_cpu(shell)
    ns = shell.user_ns
    loss_before = avg_loss(shell)
    out = cell(shell, "%%ondevice cuda:0 --move model\nfor t in range(3):\n"
                      "    train(train_dataloader, model, loss_fn, optimizer)\n"
                      "where = batch_device(train_dataloader)\n")
    assert "moved to cuda:0: model" in out
    assert ns["where"] == "cuda:0" and all(p.device == torch.device("cuda:0") for p in ns["model"].parameters())
    assert ns["device"] == "cpu" and type(ns["device"]) is DeviceName        # not rebound by the cuda cell
    cell(shell, "%%ondevice cpu --move model\npass\n")
    assert avg_loss(shell) < loss_before                   # a plain cell: the functions' own device, cpu


@pytest.mark.parametrize("device_line", list(DEVICES))
def test_quickstart_set_up_on_cpu_trains_under_dataparallel_on_the_gpus(shell, device_line):
    set_up_on_cpu(shell, device_line)
    ns = shell.user_ns
    before, loss_before = weights(shell), avg_loss(shell)
    out = cell(shell, "%%dataparallel\nfor t in range(3):\n    train(train_dataloader, model, loss_fn, optimizer)\n"
                      "where = batch_device(train_dataloader)\n")
    assert "(nccl)" in out, out
    assert ns["where"] == "cuda:0"                          # rank 0's batches went to rank 0's GPU
    assert not torch.equal(weights(shell), before) and avg_loss(shell) < loss_before
    assert all(p.device.type == "cpu" for p in ns["model"].parameters())    # the notebook's model stays put
    assert ns["device"] == "cpu" and type(ns["device"]) is DeviceName


def test_mnist_set_up_on_cpu_trains_under_dataparallel_on_the_gpus(shell):
    cell(shell, MNIST_NET)
    cell(shell, MNIST_MAIN.format(device="cpu"))
    ns = shell.user_ns
    assert ns["device"] == torch.device("cpu")
    before = [p.detach().clone() for p in ns["model"].parameters()]
    cell(shell, "%%dataparallel\nfor epoch in range(1, args.epochs + 1):\n"
                "    train(args, model, device, train_loader, optimizer, epoch)\n    scheduler.step()\n"
                "where = str(device)\n")
    assert ns["where"] == "cuda:0"                          # the notebook's torch.device('cpu') meant the rank's GPU
    assert all(not torch.equal(a, b) for a, b in zip(before, ns["model"].parameters()))
    assert ns["device"] == torch.device("cpu")


def test_quickstart_set_up_on_cpu_trains_under_sharedtrain_on_a_gpu(shell):
    set_up_on_cpu(shell)
    ns = shell.user_ns
    loss_before = avg_loss(shell)
    out = cell(shell, "%%sharedtrain --nprocs 2 --device cuda:0\nfor t in range(3):\n"
                      "    train(train_dataloader, model, loss_fn, optimizer)\n"
                      "report(where=batch_device(train_dataloader))\n")
    assert "on cuda:0" in out, out
    assert [r["where"] for rank in (0, 1) for r in ns["sharedtrain"].history[rank]] == ["cuda:0", "cuda:0"]
    cell(shell, "%%ondevice cpu --move model\npass\n")
    assert avg_loss(shell) < loss_before


def test_sharedtrain_after_a_backward_pass_in_the_kernel(shell):
    from gpumagic.errors import UsageError
    from gpumagic.procs.start import autograd_threads_started
    set_up_on_cpu(shell)
    cell(shell, "train(train_dataloader, model, loss_fn, optimizer)")       # a plain cell: a backward pass here
    assert autograd_threads_started()
    out = cell(shell, "%%sharedtrain --nprocs 2\ntrain(train_dataloader, model, loss_fn, optimizer)\n")
    assert "2 workers (spawn) on cpu" in out or "2 workers (forkserver) on cpu" in out, out
    reason = shell.user_ns["sharedtrain"].start_reason    # CUDA may be initialised by earlier tests already
    assert "autograd's GPU threads" in reason or "CUDA is initialised" in reason, reason
    result, _, _ = run_cell(shell, "%%sharedtrain --nprocs 2 --start-method fork\npass\n")
    assert isinstance(result.error_in_exec, UsageError)


def test_seed_article_queries_on_the_gpu(shell):
    cell(shell, "import torch")
    cell(shell, "%%ondevice cuda:0\nname = torch.cuda.get_device_name(0)\na = torch.cuda.FloatTensor([1., 2.])\n"
                "index = a.get_device()\nallocated = torch.cuda.memory_allocated()\ns = torch.cuda.Stream()\n"
                "acc = torch.accelerator.current_accelerator()\n")
    ns = shell.user_ns
    assert ns["name"] == torch.cuda.get_device_name(0) and ns["index"] == 0 and ns["allocated"] > 0
    assert isinstance(ns["s"], torch.cuda.Stream) and ns["acc"] == torch.device("cuda:0")
    cell(shell, ARTICLE_STREAM.format(line="cuda:0 --stream"))   # the article's race is its own: no values read
    assert ns["B"].device == torch.device("cuda:0") and isinstance(ns["s"], torch.cuda.Stream)
    assert ns["s"].device == torch.device("cuda:0")


def test_seed_article_queries_under_cpu_on_a_gpu_machine(shell):
    from gpumagic.devices.facts import cpu_facts
    cell(shell, "import torch")
    cell(shell, "%%ondevice cpu\nname = torch.cuda.get_device_name(0)\ns = torch.cuda.Stream()\n"
                "allocated = torch.cuda.memory_allocated()\n")
    ns = shell.user_ns
    assert ns["name"] == cpu_facts()["name"] and isinstance(ns["s"], HostStream) and ns["allocated"] == 0


@pytest.mark.gpu2
def test_functions_made_on_the_second_gpu(shell):
    cell(shell, "import torch")
    out = cell(shell, "%%ondevice cuda:1\n"
                      "device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() "
                      "else 'cpu'\n"
                      "name = torch.cuda.get_device_name(0)\ns = torch.cuda.Stream()\nx = torch.ones(4).to(device)\n"
                      "allocated = torch.cuda.memory_allocated()\n"
                      "def make():\n    return torch.zeros(2).cuda()\n")
    ns = shell.user_ns
    assert "device is 'cuda:1' (what 'cuda' meant in it)" in out
    assert ns["name"] == torch.cuda.get_device_name(1) and ns["s"].device == torch.device("cuda:1")
    assert ns["x"].device == torch.device("cuda:1") and ns["allocated"] == torch.cuda.memory_allocated(1) > 0
    cell(shell, "y = torch.ones(2).to(device)\nz = make()\n")             # a plain cell, current device 0
    assert ns["y"].device == torch.device("cuda:1") and ns["z"].device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0
    cell(shell, "%%ondevice cuda:0\nw = make()\nv = torch.ones(1).to(device)\n")
    assert ns["w"].device == torch.device("cuda:0") and ns["v"].device == torch.device("cuda:0")
