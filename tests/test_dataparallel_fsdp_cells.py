"""%%dataparallel --strategy fsdp with cells written as PyTorch's FSDP2 material writes them (CPU, gloo, 2 ranks).

A small language model with tied input and output embeddings and a repeated block;
cells clip gradients, keep the total norm, take a ``state_dict()``, switch the
model to ``eval()``; a model built on the meta device computes a buffer in
``__init__``. Each must behave as a plain cell would.
"""
from __future__ import annotations

import copy

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, dp_pool

FSDP2 = "--strategy fsdp --devices cpu --nprocs 2"

SETUP = """
import math
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))

class TinyLM(nn.Module):
    def __init__(self, vocab=32, dim=16, depth=2):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.5]))     # the model's own parameter, listed first
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.tok.weight                   # tied, as GPT-2's
    def forward(self, tokens):
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h) * self.scale

torch.manual_seed(0)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
tokens = torch.randint(0, 32, (32, 9))
loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
"""

TRAIN = """
norms = []
for x, y in loader:
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    norms.append(norm)
    opt.step()
    opt.zero_grad()
"""


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def _setup(shell, source=SETUP):
    result, text, _ = run_cell(shell, source)
    assert result.success, text
    return shell.user_ns


def _reference(ns):
    model = copy.deepcopy(ns["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for x, y in ns["loader"]:
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)))
        opt.step()
        opt.zero_grad()
    return model, norms


def test_tied_weights_beside_a_parameter_of_the_model_train_as_in_one_process(shell):
    ns = _setup(shell)
    ref, ref_norms = _reference(ns)
    dp_cell(shell, FSDP2, TRAIN)
    assert ns["model"].out.weight is ns["model"].tok.weight
    for (name, a), b in zip(ns["model"].state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), name
    assert [float(n) for n in ns["norms"]] == pytest.approx(ref_norms, abs=1e-5)


def test_sharded_values_the_cell_keeps_come_back_whole(shell):
    ns = _setup(shell)
    _, ref_norms = _reference(ns)
    last, cap = dp_cell(shell, FSDP2, TRAIN + (
        "sd = model.state_dict()\n"
        "w = model.layers[0].fc.weight\n"
        "total = model.layers[0].fc.weight.sum()\n"          # a partial sum on each rank
        "import torch.distributed as dist\n"
        "if dist.get_rank() == 0:\n"
        "    only_here = model.layers[1].fc.weight\n"        # rank 0 alone holds it: not gathered
        "norm\n"))
    dtensor = torch.distributed.tensor.DTensor
    values = [ns["norm"], *ns["norms"], *ns["sd"].values(), ns["w"], ns["total"], last]
    assert not any(isinstance(v, dtensor) for v in values)
    assert ns["norm"] + 1 == pytest.approx(ref_norms[-1] + 1, abs=1e-5)     # usable in the kernel
    assert float(last) == pytest.approx(ref_norms[-1], abs=1e-5)
    mine = ns["model"].state_dict()
    assert list(ns["sd"]) == list(mine) and all(torch.equal(ns["sd"][k], v) for k, v in mine.items())
    assert torch.equal(ns["w"], ns["model"].layers[0].fc.weight)
    assert float(ns["total"]) == pytest.approx(float(ns["model"].layers[0].fc.weight.detach().sum()), abs=1e-5)
    assert "only_here" not in ns
    assert "only_here (holds sharded tensors that differ between the ranks)" in cap.stderr


def test_eval_and_attributes_come_back_and_the_notebooks_reach_the_kept_shards(shell):
    ns = _setup(shell)
    dp_cell(shell, FSDP2, TRAIN + "model.eval()\nmodel.temperature = 0.5\nmodel.layers[0].requires_grad_(False)\n")
    model = ns["model"]
    assert not model.training and not model.layers[1].training and model.temperature == 0.5
    assert not any(p.requires_grad for p in model.layers[0].parameters())
    assert not any(k.startswith("fsdp") or "FSDP" in k for k in vars(model))   # nothing of FSDP's came along
    frozen = {k: v.clone() for k, v in model.layers[0].state_dict().items()}
    run_cell(shell, "model.train()\nmodel.temperature = 2.0\nmodel.layers[0].requires_grad_(True)\n"
                    "model.layers[1].requires_grad_(False)")
    _, cap = dp_cell(shell, FSDP2, TRAIN + "seen = (model.training, model.layers[1].training, model.temperature)\n")
    assert "sharded over the ranks" not in cap.stderr             # the ranks' own shards, kept
    assert ns["seen"] == (True, True, 2.0)
    assert model.training and model.temperature == 2.0
    assert not any(p.requires_grad for p in model.layers[1].parameters())
    # the layer unfrozen in the notebook trained
    assert any(not torch.equal(v, frozen[k]) for k, v in model.layers[0].state_dict().items())


def test_a_meta_models_buffer_without_an_initialiser_is_named(shell):
    ns = _setup(shell, SETUP + """
class Positions(nn.Module):
    def __init__(self, dim, length=16):
        super().__init__()
        table = torch.arange(length).unsqueeze(1) / 10000 ** (torch.arange(dim) / dim)
        self.register_buffer("table", torch.sin(table))
    def forward(self, h):
        return h + self.table[: h.shape[1]]

class PositionalLM(TinyLM):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(16, 32, bias=False)
        self.pos = Positions(16)
    def forward(self, tokens):
        h = self.pos(self.tok(tokens))
        for layer in self.layers:
            h = layer(h)
        return self.out(h)

with torch.device("meta"):
    model = PositionalLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
""")
    with pytest.warns(UserWarning) as warned:
        dp_cell(shell, FSDP2, "for x, y in loader:\n    break\nfilled = float(model.pos.table.abs().sum())\n")
    text = " ".join(str(w.message) for w in warned)
    assert "so they start at zero: PositionalLM, Positions (buffer table)." in text, text
    assert ns["filled"] == 0.0


def test_a_0d_parameter_is_refused_before_anything_starts(shell):
    _setup(shell, SETUP + "model.temp = nn.Parameter(torch.tensor(1.0))\n")
    poolmod.stop_pool(POOL_NAME)
    with pytest.raises(UsageError) as err:
        dp_cell(shell, FSDP2, TRAIN)
    assert "FSDP2 (fully_shard) cannot shard 0-d parameters, and model has model.temp" in str(err.value)
    assert "--strategy ddp" in str(err.value)
    assert dp_pool() is None


def test_a_failure_after_rank0_wrote_into_the_notebook_says_what_it_wrote(shell):
    ns = _setup(shell, SETUP + """
class Meter:                   # its state comes back after the weights were written in place
    def __init__(self):
        self.n = 0
    def state_dict(self):
        return {"n": self.n}
    def load_state_dict(self, sd):
        raise RuntimeError("the meter cannot load")
meter = Meter()
""")
    before = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    with pytest.raises(RuntimeError, match="the meter cannot load"):
        with capture_output() as cap:
            shell.run_cell_magic("dataparallel", FSDP2, TRAIN + "meter.n += 1\n")
    assert any(not torch.equal(v, before[k]) for k, v in ns["model"].state_dict().items())
    # (a fresh optimizer's state is gathered by the kernel afterwards: not written, so not named)
    assert "loading the cell's result failed after rank 0 had written the trained tensors of model into the " \
           "notebook's in place" in cap.stderr
