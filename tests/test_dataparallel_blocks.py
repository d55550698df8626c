"""Which parts of a model --strategy fsdp shards as units (dataparallel.strategies.fsdp_blocks), and autocast."""
from __future__ import annotations

import ast

import pytest
import torch
from IPython.core.error import UsageError
from torch import nn

from gpumagic.dataparallel.strategies.fsdp_blocks import (
    autocast_dtype,
    block_instances,
    candidate_blocks,
    choose_blocks,
)


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Tiny(nn.Module):
    """A language model's shape: embedding, repeated blocks, a head tied to the embedding."""

    def __init__(self, layers=3, tie=True):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(layers)])
        self.head = nn.Linear(8, 11, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_repeated_blocks_are_the_units_not_the_layers_inside_them():
    model = Tiny()
    assert choose_blocks(model) == ["Block"]
    assert block_instances(model, ["Block"]) == list(model.blocks)
    # the Linears of each Block's Sequential repeat too, but they are inside the Block's unit
    assert block_instances(model, ["Block", "Linear"]) == [*model.blocks, model.head]


def test_torch_and_torchvision_shapes():
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 4,
                                    enable_nested_tensor=False)
    assert choose_blocks(encoder) == ["TransformerEncoderLayer"]
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert choose_blocks(mlp) == ["Linear"]
    assert choose_blocks(nn.Linear(3, 3)) == []      # nothing repeats: the whole model is one unit


def test_candidates_list_repeated_classes_first():
    names = candidate_blocks(Tiny())
    assert names[0] == "Block"
    assert {"Linear", "LayerNorm", "Sequential"} <= set(names)
    assert "Tiny" not in names and "GELU" not in names   # the root, and classes without parameters


def test_wrap_names_the_units_and_a_missing_class_names_the_candidates():
    model = Tiny(tie=False)
    assert choose_blocks(model, ["Block", "Linear"]) == ["Block", "Linear"]
    with pytest.raises(UsageError) as err:
        choose_blocks(model, ["GPT2Block"], name="model")
    text = str(err.value)
    assert "--wrap GPT2Block: model (Tiny) has no such submodule class" in text
    assert "candidate block classes are Block" in text and "valid choices: --wrap Block" in text


def test_tied_weights_across_units_are_refused_when_asked_and_avoided_when_not():
    model = Tiny(tie=True)
    with pytest.raises(UsageError) as err:
        choose_blocks(model, ["Embedding"], name="lm")
    assert "cannot shard lm with Embedding as a unit" in str(err.value)
    assert "tied weights" in str(err.value) and "--wrap Block" in str(err.value)

    class Shared(nn.Module):   # two repeated blocks sharing one Linear
        def __init__(self):
            super().__init__()
            inner = nn.Linear(4, 4)
            self.layers = nn.ModuleList([nn.Sequential(inner, nn.Tanh()), nn.Sequential(inner, nn.ReLU())])

    assert choose_blocks(Shared()) == []       # unasked: no unit rather than a broken one


@pytest.mark.parametrize("cell, dtype", [
    ("with torch.autocast('cuda', dtype=torch.bfloat16):\n    y = model(x)", "bfloat16"),
    ("with torch.amp.autocast(device_type='cuda', dtype=torch.float16):\n    y = model(x)", "float16"),
    ("with torch.autocast('cpu'):\n    y = model(x)", "bfloat16"),
    ("with torch.autocast('cuda'):\n    y = model(x)", "float16"),
    ("with torch.cuda.amp.autocast():\n    y = model(x)", "float16"),
    ("for x in loader:\n    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):\n        y = model(x)",
     "bfloat16"),
    ("y = model(x)", None),
    ("with torch.no_grad():\n    y = model(x)", None),
])
def test_autocast_dtype_read_from_the_cell(cell, dtype):
    assert autocast_dtype(ast.parse(cell)) == dtype
    if dtype:
        assert isinstance(getattr(torch, dtype), torch.dtype)


class _Config:
    dtype = torch.bfloat16
    amp = False


@pytest.mark.parametrize("cell, dtype", [
    ("with torch.autocast('cuda', dtype=DTYPE):\n    y = model(x)", "float16"),          # a notebook name
    ("with torch.autocast('cuda', dtype=cfg.dtype):\n    y = model(x)", "bfloat16"),    # an attribute chain
    ("with torch.autocast(DEVICE):\n    y = model(x)", "bfloat16"),                     # DEVICE = 'cpu'
    ("with torch.autocast('cuda', dtype=pick()):\n    y = model(x)", None),             # not settled: fp32
    ("with torch.autocast('cuda', dtype=torch.bfloat16, enabled=False):\n    y = model(x)", None),
    ("with torch.autocast('cuda', dtype=torch.bfloat16, enabled=cfg.amp):\n    y = model(x)", None),
    ("with torch.autocast('cuda', dtype=torch.bfloat16, enabled=AMP):\n    y = model(x)", "bfloat16"),
    ("with torch.autocast('cuda', dtype=torch.bfloat16, enabled=unknown):\n    y = model(x)", None),
])
def test_autocast_dtype_reads_the_notebooks_names(cell, dtype):
    namespace = {"torch": torch, "DTYPE": torch.float16, "cfg": _Config, "DEVICE": "cpu", "AMP": True,
                 "pick": lambda: torch.float16}
    assert autocast_dtype(ast.parse(cell), namespace) == dtype
