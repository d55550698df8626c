"""--strategy fsdp on one GPU (NCCL, one rank): the CUDA paths of sharding, meta init, bf16 and write-back.

One rank shards nothing away, but every step is the one two ranks take: the
notebook's CPU model copied to the GPU block by block, FSDP2 units, bf16
gathers under autocast, the gathered tensors written from the GPU into the
notebook's shared-memory tensors, the shards kept for the next cell.
Run on the GPU machine: ``pytest -m gpu tests/test_dataparallel_fsdp_onegpu.py``.
"""
from __future__ import annotations

import copy

import pytest
import torch

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, last_result
from tests.test_dataparallel_fsdp import SETUP, TRAIN

pytestmark = pytest.mark.gpu

ONE = "--strategy fsdp --devices cuda:0"


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def _setup(shell, extra=""):
    result, text, _ = run_cell(shell, SETUP + "\ntorch.backends.cuda.matmul.allow_tf32 = False\n"
                                              "torch.backends.cudnn.allow_tf32 = False\n" + extra)
    assert result.success, text
    return shell.user_ns


def test_one_gpu_trains_like_one_process_and_writes_the_weights_back_in_place(shell):
    ns = _setup(shell)
    ref = copy.deepcopy(ns["model"]).cuda()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    for _ in range(4):
        for x, y in ns["loader"]:
            ref_opt.zero_grad()
            ((ref(x.cuda()) - y.cuda()) ** 2).mean().backward()
            ref_opt.step()
    params = list(ns["model"].parameters())
    body = TRAIN.replace("model(x) - y", "model(x.cuda()) - y.cuda()") + \
        "where = str(next(model.parameters()).device)\n"
    _, cap = dp_cell(shell, ONE, body)
    assert "sharded over the ranks; blocks: Block" in cap.stderr and ns["where"] == "cuda:0"
    dp_cell(shell, ONE, body)
    assert last_result().shipped_bytes <= (ns["X"].numel() + ns["Y"].numel()) * 4   # the shards were kept
    assert list(ns["model"].parameters()) == params and all(p.is_shared() for p in params)
    for (name, a), b in zip(ns["model"].state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b.cpu(), atol=1e-5, rtol=0), name
    for p, q in zip(ns["model"].parameters(), ref.parameters()):
        got, want = ns["opt"].state[p], ref_opt.state[q]
        assert torch.allclose(got["exp_avg"], want["exp_avg"].cpu(), atol=1e-5, rtol=0)


def test_meta_model_and_bf16_autocast_on_the_gpu(shell):
    ns = _setup(shell, "with torch.device('meta'):\n    model = Net(width=256, depth=6)\n"
                       "opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n")
    body = ("for epoch in range(3):\n"
            "    for x, y in loader:\n"
            "        opt.zero_grad()\n"
            "        with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "            loss = ((model(x.cuda()) - y.cuda()) ** 2).mean()\n"
            "        loss.backward()\n"
            "        opt.step()\n"
            "        losses.append(loss.item())\n"
            "peak = torch.cuda.max_memory_allocated()\n"
            "kinds = sorted({str(p.dtype) for p in model.parameters()})\n")
    _, cap = dp_cell(shell, ONE, body)
    assert "gathered in bfloat16, gradients reduced in float32" in cap.stderr
    assert "kept sharded in the workers" in cap.stderr and last_result().stayed == ["model", "opt"]
    assert ns["kinds"] == ["torch.float32"]          # fp32 master weights; bf16 only while gathered
    losses = ns["losses"]
    assert all(v == v for v in losses) and sum(losses[-4:]) < sum(losses[:4])
    assert all(p.is_meta for p in ns["model"].parameters())
    assert 0 < ns["peak"] < 200 * 2 ** 20


def test_a_model_on_the_gpu_in_the_kernel_trains_and_comes_back_there_with_a_note(shell):
    ns = _setup(shell, "model = model.cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    params = list(ns["model"].parameters())
    before = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    body = TRAIN.replace("model(x) - y", "model(x.cuda()) - y.cuda()")
    _, cap = dp_cell(shell, ONE, body)
    assert "model is on cuda:0 in the kernel, which takes that GPU's memory" in cap.stderr
    assert list(ns["model"].parameters()) == params and all(p.is_cuda for p in params)
    assert all(not torch.equal(v, before[k]) for k, v in ns["model"].state_dict().items())
    assert last_result().returned_bytes >= sum(p.numel() * 4 for p in params)   # through the buffer
