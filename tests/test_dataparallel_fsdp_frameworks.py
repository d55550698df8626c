"""Framework FSDP runs unchanged in %%dataparallel's launch mode (CPU, gloo, 2 processes).

Of the frameworks' FSDP, only FSDP2 (``fully_shard``, parameters as DTensors)
runs on the CPU: Lightning's ``FSDPStrategy`` and Fabric's refuse
``accelerator="cpu"``, torch's FSDP1 underneath them wants an accelerator, and
accelerate (hence the Hugging Face Trainer's ``fsdp=``) keeps a CPU run
``MULTI_CPU``, which is DDP, whatever FSDP plugin it is given. So the CPU test
trains with Lightning's FSDP2 recipe (``ModelParallelStrategy``, the model
sharded in ``configure_model``), and with torch's own ``fully_shard`` as the
FSDP2 tutorial writes it.

Each cell records, on every rank, what the ranks hold (DTensor shards, about
half the parameters each) and gathers the full state with
``torch.distributed.checkpoint``'s ``get_model_state_dict``; rank 0 saves it.
The notebook's model must then hold exactly those weights, in its own
parameter objects, and compute the loss the ranks computed after training.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell

pytest.importorskip("lightning")

CPU2 = "--devices cpu --nprocs 2"
EPOCHS = 3
BATCHES = 64 // 8 // 2          # per rank and epoch: 8 batches of 8, shared by two ranks

SETUP = """\
import torch
torch.manual_seed(0)
X = torch.randn(64, 8)
Y = torch.tanh(X @ torch.randn(8, 1))
ds = torch.utils.data.TensorDataset(X, Y)
loader = torch.utils.data.DataLoader(ds, batch_size=8)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                            torch.nn.Linear(32, 1))
params = list(model.parameters())
before = {{k: v.clone() for k, v in model.state_dict().items()}}
FULL, EPOCHS = {full!r}, {epochs}
"""

LIGHTNING_SETUP = """\
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

class Regressor(L.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def configure_model(self):
        # Each layer sharded on its own, then the rest, over the data-parallel mesh
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

lit = Regressor(model)
"""

# Run on every rank after training: what each rank holds, the full state gathered with torch's own
# API (a collective: every rank takes part, rank 0 saves it), and the loss of the trained model.
RECORD = """\
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
sharded = all(isinstance(p, DTensor) for p in model.parameters())
numel = sum(p.numel() for p in model.parameters())
local = [None] * dist.get_world_size()
dist.all_gather_object(local, sum(p.to_local().numel() for p in model.parameters()))
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if dist.get_rank() == 0:
    torch.save(full, FULL)
with torch.no_grad():
    loss_after = float(torch.nn.functional.mse_loss(model(X), Y))
"""

LIGHTNING_FSDP2 = """\
loss_before = float(torch.nn.functional.mse_loss(model(X), Y))
trainer = L.Trainer(accelerator="cpu", devices=2,
                    strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                    max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_model_summary=False,
                    enable_progress_bar=False)
trainer.fit(lit, loader)
world, steps = trainer.world_size, trainer.global_step
""" + RECORD

TORCH_FSDP2 = """\
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data.distributed import DistributedSampler
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group()
# CPU ranks: the mesh says so (fully_shard's default mesh is on the GPU wherever CUDA exists)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
loss_before = float(torch.nn.functional.mse_loss(model(X), Y))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sampler = DistributedSampler(ds, shuffle=False)
steps = 0
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    for x, y in torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        steps += 1
world = dist.get_world_size()
""" + RECORD

# name -> (extra set-up, the training cell, why launch mode is chosen)
CASES = {
    "lightning-fsdp2": (LIGHTNING_SETUP, LIGHTNING_FSDP2, "the cell builds a Lightning Trainer"),
    "torch-fully_shard": ("", TORCH_FSDP2, "the cell calls init_process_group"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_trains_sharded_on_two_ranks_and_the_full_weights_come_back(shell, case, tmp_path):
    extra, cell, why = CASES[case]
    full_path = tmp_path / "full.pt"
    for source in (SETUP.format(full=str(full_path), epochs=EPOCHS), extra):
        if source:
            result, text, _ = run_cell(shell, source)
            assert result.success, text
    ns = shell.user_ns
    model, params = ns["model"], ns["params"]

    _, cap = dp_cell(shell, CPU2, cell)

    assert f"launch mode, because {why}" in cap.stderr, cap.stderr
    # The framework saw two processes, each taking its share of the steps ...
    assert ns["world"] == 2
    assert ns["steps"] == EPOCHS * BATCHES
    # ... and sharded: every parameter a DTensor, each rank holding part of them, together all.
    assert ns["sharded"] is True
    assert sum(ns["local"]) == ns["numel"] and all(0 < n < ns["numel"] for n in ns["local"]), ns["local"]
    assert ns["loss_after"] < ns["loss_before"] / 2, (ns["loss_before"], ns["loss_after"])

    # The notebook's model: the same object with the same parameter objects, plain tensors again,
    # holding the full state the ranks gathered.
    assert ns["model"] is model
    assert all(p is q for p, q in zip(model.parameters(), params)) and len(list(model.parameters())) == len(params)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    full = torch.load(full_path)
    state = model.state_dict()
    assert state.keys() == full.keys()
    for k, v in state.items():
        assert type(v) is torch.Tensor, (k, type(v))
        assert torch.equal(v, full[k]), k
        assert not torch.equal(v, ns["before"][k]), k
    # It computes what the trained ranks computed.
    result, text, _ = run_cell(shell, "with torch.no_grad():\n"
                                      "    loss_here = float(torch.nn.functional.mse_loss(model(X), Y))\n")
    assert result.success, text
    assert ns["loss_here"] == pytest.approx(ns["loss_after"], rel=1e-5)


# On GPUs the frameworks' own FSDP runs as their docs write it (torch's FSDP1 underneath):
# Lightning's strategy="fsdp", accelerate's FullyShardedDataParallelPlugin, the Hugging Face
# Trainer's fsdp= argument. Run on the GPU machine: pytest -m gpu2 tests/test_dataparallel_fsdp_frameworks.py

GPU_LIGHTNING_SETUP = """\
import lightning as L

class Regressor(L.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

lit = Regressor(model)
"""

GPU_HF_SETUP = """\
import tempfile
import transformers
config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=37, num_labels=2, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
torch.manual_seed(0)
bert = transformers.BertForSequenceClassification(config)
params = list(bert.parameters())
before = {k: v.clone() for k, v in bert.state_dict().items()}
texts = [{"input_ids": torch.randint(0, 64, (12,)), "labels": torch.tensor(i % 2)} for i in range(64)]
IDS = torch.stack([t["input_ids"] for t in texts])
LABELS = torch.stack([t["labels"] for t in texts])
"""

# Every rank after training: what it holds of the FSDP-wrapped model ``wrapped``; rank 0 saves the
# full state the cell gathered with the framework's own API (``full``) under the notebook model's keys.
# FSDP1 (a FullyShardedDataParallel wrapper) or FSDP2 (parameters as DTensors: the Hugging Face Trainer's
# fsdp= default since transformers 5). Recorded before the cell's no-grad forward, after which FSDP2's root
# module keeps its parameters unsharded.
GPU_RECORD = """\
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor
sharded = isinstance(wrapped, FSDP) or all(isinstance(p, DTensor) for p in wrapped.parameters())
local = [None] * dist.get_world_size()
dist.all_gather_object(local, sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                               for p in wrapped.parameters()))
if dist.get_rank() == 0:
    torch.save({k.removeprefix(PREFIX): v for k, v in full.items()}, FULL)
"""

GPU_LIGHTNING = """\
PREFIX = "net."
loss_before = float(torch.nn.functional.mse_loss(model(X.cuda()), Y.cuda()))   # the model is on the rank's GPU
trainer = L.Trainer(accelerator="gpu", devices=2, strategy="fsdp", max_epochs=EPOCHS, logger=False,
                    enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
trainer.fit(lit, loader)
world, steps = trainer.world_size, trainer.global_step
wrapped = trainer.strategy.model
full = trainer.strategy.lightning_module_state_dict()
""" + GPU_RECORD + """\
with torch.no_grad():
    loss_after = float(torch.nn.functional.mse_loss(wrapped(X.cuda()), Y.cuda()))
"""

GPU_ACCELERATE = """\
from accelerate import Accelerator, FullyShardedDataParallelPlugin
PREFIX = ""
loss_before = float(torch.nn.functional.mse_loss(model(X.cuda()), Y.cuda()))   # the model is on the rank's GPU
accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
wrapped = accelerator.prepare(model)
optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
optimizer, dl = accelerator.prepare(optimizer, loader)
steps = 0
for epoch in range(EPOCHS):
    for x, y in dl:
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(wrapped(x), y))
        optimizer.step()
        steps += 1
world = accelerator.num_processes
full = accelerator.get_state_dict(wrapped)
""" + GPU_RECORD + """\
with torch.no_grad():
    loss_after = float(torch.nn.functional.mse_loss(wrapped(X.to(accelerator.device)), Y.to(accelerator.device)))
"""

GPU_HF = """\
PREFIX = ""
with torch.no_grad():
    loss_before = float(bert(input_ids=IDS.cuda(), labels=LABELS.cuda()).loss)   # bert is on the rank's GPU
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8,
                                      num_train_epochs=EPOCHS, learning_rate=1e-3, report_to=[], save_strategy="no",
                                      logging_strategy="no", seed=0, fsdp="full_shard",
                                      fsdp_config={"transformer_layer_cls_to_wrap": ["BertLayer"]})
trainer = transformers.Trainer(model=bert, args=args, train_dataset=texts)
result = trainer.train()
world, steps = trainer.args.world_size, result.global_step
wrapped = trainer.model_wrapped
full = trainer.accelerator.get_state_dict(wrapped)
""" + GPU_RECORD + """\
with torch.no_grad():
    loss_after = float(wrapped(input_ids=IDS.to(trainer.args.device), labels=LABELS.to(trainer.args.device)).loss)
"""

# name -> (extra set-up, the training cell, why launch mode is chosen, the trained notebook model,
# how far the loss falls at least, the check in the kernel)
GPU_CASES = {
    "lightning-fsdp": (GPU_LIGHTNING_SETUP, GPU_LIGHTNING, "a Lightning Trainer", "model", 0.5,
                       "float(torch.nn.functional.mse_loss(model(X), Y))"),
    "accelerate-fsdp": ("", GPU_ACCELERATE, "an accelerate Accelerator", "model", 0.5,
                        "float(torch.nn.functional.mse_loss(model(X), Y))"),
    "hf-trainer-fsdp": (GPU_HF_SETUP, GPU_HF, "a Hugging Face Trainer", "bert", 1.0,
                        "float(bert(input_ids=IDS, labels=LABELS).loss)"),
}


@pytest.mark.gpu
@pytest.mark.gpu2
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_framework_fsdp_on_two_gpus_trains_sharded_and_the_full_weights_come_back(shell, case, tmp_path):
    if case == "accelerate-fsdp":
        pytest.importorskip("accelerate")
    if case == "hf-trainer-fsdp":
        pytest.importorskip("transformers")
    extra, cell, why, target, fall, loss_here = GPU_CASES[case]
    full_path = tmp_path / "full.pt"
    for source in (SETUP.format(full=str(full_path), epochs=EPOCHS), extra):
        if source:
            result, text, _ = run_cell(shell, source)
            assert result.success, text
    ns = shell.user_ns
    model, params = ns[target], ns["params"]
    numel = sum(p.numel() for p in params)

    _, cap = dp_cell(shell, "", cell)

    assert f"launch mode, because the cell builds {why}" in cap.stderr, cap.stderr
    assert ns["world"] == 2
    assert ns["steps"] == EPOCHS * BATCHES
    # FSDP-wrapped, each rank holding part of the parameters (flat shards may carry padding)
    assert ns["sharded"] is True
    assert numel <= sum(ns["local"]) < numel + 64 and all(0 < n < numel for n in ns["local"]), (numel, ns["local"])
    assert ns["loss_after"] < ns["loss_before"] * fall, (ns["loss_before"], ns["loss_after"])

    assert ns[target] is model
    assert all(p is q for p, q in zip(model.parameters(), params)) and len(list(model.parameters())) == len(params)
    assert all(type(p) is torch.nn.Parameter and p.device.type == "cpu" for p in model.parameters())
    full = torch.load(full_path)
    state = model.state_dict()
    assert state.keys() == full.keys()
    for k, v in state.items():
        assert torch.equal(v, full[k].to(v.device)), k
    assert any(not torch.equal(v, ns["before"][k]) for k, v in state.items())
    result, text, _ = run_cell(shell, f"with torch.no_grad():\n    loss_here = {loss_here}\n")
    assert result.success, text
    assert ns["loss_here"] == pytest.approx(ns["loss_after"], rel=1e-4)
