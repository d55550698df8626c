"""Notebook cells that train with each framework under %%dataparallel, shared by the CPU and GPU tests.

Every case trains the notebook's ``model`` (or a Hugging Face ``bert``) the
way the framework's own examples do. ``on_step()``, defined in the set-up
cell, runs once per optimizer step: ``MODE = "train"`` does nothing,
``"fail"`` raises on rank 1, ``"hang"`` touches ``MARKER`` and sleeps, so a
test can interrupt a cell that is surely training.

The loop cases see the same samples per step as one process at twice the
batch (accelerate gives rank r batches r, r+2, ...; Fabric's and the
hand-written DistributedSampler give rank r samples r, r+2, ...), so their
weights must equal ``reference``, trained in the kernel at batch 16.
Lightning's Trainer shuffles what it distributes, and the Hugging Face
Trainer shuffles anyway: those are checked against rank 0's weights.
"""
from __future__ import annotations

SETUP = """\
import copy, os, time, tempfile
import torch
torch.manual_seed(0)
X = torch.randn(64, 8)
Y = X @ torch.randn(8, 1)
ds = torch.utils.data.TensorDataset(X, Y)
loader = torch.utils.data.DataLoader(ds, batch_size=8)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
reference = copy.deepcopy(model)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
for x, y in torch.utils.data.DataLoader(ds, batch_size=16):
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
before = copy.deepcopy(model.state_dict())
MODE, MARKER, EPOCHS = {mode!r}, {marker!r}, {epochs}

def on_step():
    if MODE == "fail" and os.environ["RANK"] == "1":
        raise ValueError("rank one fails")
    if MODE == "hang":
        open(MARKER, "w").close()
        time.sleep(0.05)
"""

LIGHTNING_SETUP = """\
import lightning as L

class Regressor(L.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

class StepHook(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        on_step()

lit = Regressor(model)
"""

HF_SETUP = """\
import transformers
config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=37, num_labels=2, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
torch.manual_seed(0)
bert = transformers.BertForSequenceClassification(config)
bert_before = copy.deepcopy(bert.state_dict())
texts = [{"input_ids": torch.randint(0, 64, (12,)), "labels": torch.tensor(i % 2)} for i in range(64)]
args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8,
                                      num_train_epochs=EPOCHS, report_to=[], save_strategy="no",
                                      logging_strategy="no", seed=0)

class StepHook(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        on_step()
"""

# What the cell binds, checked by the tests: world (processes the framework saw), batches (this
# rank's optimizer steps), agree (every rank ended with the same weights), final (rank 0's weights,
# summed per parameter).
AGREE = """\
import torch.distributed as dist
_sums = [None] * dist.get_world_size()
dist.all_gather_object(_sums, [float(p.detach().double().sum()) for p in {model}.parameters()])
agree = all(s == _sums[0] for s in _sums)
final = _sums[0]
"""

ACCELERATE = """\
from accelerate import Accelerator
accelerator = Accelerator()
m, o, dl = accelerator.prepare(model, opt, loader)
batches = 0
for epoch in range(EPOCHS):
    for x, y in dl:
        o.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(m(x), y))
        o.step()
        batches += 1
        on_step()
world = accelerator.num_processes
""" + AGREE.format(model="model")

FABRIC = """\
import lightning as L
fabric = L.Fabric(accelerator="cpu", devices=2)
fabric.launch()
m, o = fabric.setup(model, opt)
dl = fabric.setup_dataloaders(loader)
batches = 0
for epoch in range(EPOCHS):
    for x, y in dl:
        o.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(m(x), y))
        o.step()
        batches += 1
        on_step()
world = fabric.world_size
""" + AGREE.format(model="model")

HAND_DDP = """\
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
dist.init_process_group()
ddp_model = DDP(model)
device = next(model.parameters()).device
sampler = DistributedSampler(ds, shuffle=False)
batches = 0
for epoch in range(EPOCHS):
    for x, y in torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler):
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp_model(x), y).backward()
        opt.step()
        batches += 1
        on_step()
world = dist.get_world_size()
""" + AGREE.format(model="model") + "dist.destroy_process_group()\n"

LIGHTNING = """\
trainer = L.Trainer(accelerator="cpu", devices=2, strategy={strategy!r}, max_epochs=EPOCHS, logger=False,
                    enable_checkpointing=False, enable_model_summary=False, callbacks=[StepHook()])
trainer.fit(lit, loader)
world, batches = trainer.world_size, trainer.global_step
""" + AGREE.format(model="lit")

HF_TRAINER = """\
trainer = transformers.Trainer(model=bert, args=args, train_dataset=texts, callbacks=[StepHook()])
result = trainer.train()
world = trainer.args.world_size
""" + AGREE.format(model="bert")

# name -> (extra set-up, the training cell)
CASES = {
    "accelerate": ("", ACCELERATE),
    "fabric": (LIGHTNING_SETUP, FABRIC),
    "hand-ddp": ("", HAND_DDP),
    "lightning-ddp": (LIGHTNING_SETUP, LIGHTNING.format(strategy="ddp")),
    "lightning-ddp_notebook": (LIGHTNING_SETUP, LIGHTNING.format(strategy="ddp_notebook")),
    "lightning-auto": (LIGHTNING_SETUP, LIGHTNING.format(strategy="auto")),
    "hf-trainer": (HF_SETUP, HF_TRAINER),
}
