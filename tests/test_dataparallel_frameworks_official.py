"""The frameworks' own examples under %%dataparallel's launch mode, compared with one process (CPU, 2 ranks).

accelerate's ``nlp_example.py`` (``training_function`` with ``prepare``,
``gather_for_metrics``, ``save_model``, ``save_state``), the Hugging Face
``Trainer`` with evaluation, checkpoints, the best model at the end,
``evaluate``/``predict``/``save_model``, a Lightning ``Trainer`` with
``ModelCheckpoint``/``EarlyStopping`` and ``validate``/``test``, and Fabric's
``launch(fn)`` with ``save``/``load``: tiny random models, data in memory.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

CPU2 = "--nprocs 2"

BERT = """\
import os, copy, torch, numpy as np, transformers
OUT = {out!r}
config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=37, num_labels=2, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
torch.manual_seed(0)
model = transformers.BertForSequenceClassification(config)
g = torch.Generator().manual_seed(0)
train_ds = [{{"input_ids": torch.randint(0, 64, (12,), generator=g), "labels": torch.tensor(i % 2)}} for i in range(32)]
eval_ds = [{{"input_ids": torch.randint(0, 64, (12,), generator=g), "labels": torch.tensor(i % 2)}} for i in range(21)]
"""


def ok(shell, source):
    result, text, _ = run_cell(shell, source)
    assert result.success, text


def state_sum(module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def test_training_arguments_made_in_a_launch_cell_count_one_process_in_the_kernel(shell, tmp_path):
    """They came back holding the rank's accelerate state (two processes, a process group): a plain cell's
    Trainer using them then failed ("Default process group has not been initialized")."""
    ok(shell, BERT.format(out=str(tmp_path)))
    dp_cell(shell, CPU2, """\
        args = transformers.TrainingArguments(output_dir=OUT + "/o", per_device_train_batch_size=8, num_train_epochs=1,
                                              report_to="none", save_strategy="no", use_cpu=True)
        in_rank = args.world_size
        steps = transformers.Trainer(model=model, args=args, train_dataset=train_ds).train().global_step
        """)
    ns = shell.user_ns
    assert (ns["in_rank"], ns["steps"]) == (2, 2)
    assert (ns["args"].world_size, ns["args"].process_index) == (1, 0)
    ok(shell, "again = transformers.Trainer(model=model, args=args, train_dataset=train_ds).train().global_step")
    assert ns["again"] == 4                          # one process: all 32 samples at 8 a step
    # the Trainer's own save of them, in the cell, is as under torchrun: the rank's state
    dp_cell(shell, CPU2, """\
        args.save_strategy = "steps"
        args.save_steps = 2
        transformers.Trainer(model=model, args=args, train_dataset=train_ds).train()
        """)
    saved = torch.load(tmp_path / "o" / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert type(saved) is type(ns["args"]) and saved.world_size == 2


AGREE = """\
import torch.distributed as dist
_sums = [None] * dist.get_world_size()
dist.all_gather_object(_sums, [float(p.detach().double().sum()) for p in model.parameters()])
agree = all(s == _sums[0] for s in _sums)
"""


def test_a_model_a_plain_cell_trainer_prepared_is_wrapped_again_in_the_ranks(shell, tmp_path):
    """accelerate marks a model it prepared and leaves it unwrapped when asked again: trained by a plain
    cell's Trainer first, the model then trained in every rank on its share, unaveraged."""
    ok(shell, BERT.format(out=str(tmp_path)) + """\
args = transformers.TrainingArguments(output_dir=OUT + "/o", per_device_train_batch_size=8, num_train_epochs=1,
                                      report_to="none", save_strategy="no", use_cpu=True, seed=0)
plain = transformers.Trainer(model=model, args=args, train_dataset=train_ds).train().global_step
""")
    assert shell.user_ns["model"]._is_accelerate_prepared is True
    _, cap = dp_cell(shell, CPU2, """\
trainer = transformers.Trainer(model=model, args=args, train_dataset=train_ds)
steps = trainer.train().global_step
wrapped = type(trainer.model_wrapped).__name__
""" + AGREE)
    ns = shell.user_ns
    assert (ns["plain"], ns["steps"]) == (4, 2)
    assert ns["wrapped"] == "DistributedDataParallel" and ns["agree"] is True
    assert "nothing wrapped a model" not in cap.stderr


ACCELERATE = """\
from torch.utils.data import DataLoader
from accelerate import Accelerator
from accelerate.utils import set_seed

def collate_fn(examples):
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}

def training_function(config, args):
    accelerator = Accelerator(cpu=args["cpu"], mixed_precision=args["mixed_precision"])
    set_seed(int(config["seed"]))
    train_dataloader = DataLoader(train_ds, shuffle=True, collate_fn=collate_fn, batch_size=config["batch_size"])
    eval_dataloader = DataLoader(eval_ds, shuffle=False, collate_fn=collate_fn, batch_size=8)
    model = transformers.BertForSequenceClassification(config_m).to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=config["lr"])
    lr_scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=1, num_training_steps=len(train_dataloader) * config["num_epochs"])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    history = []
    for epoch in range(config["num_epochs"]):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        model.eval()
        seen = []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions, references = accelerator.gather_for_metrics((outputs.logits.argmax(dim=-1), batch["labels"]))
            seen.append((predictions == references).float())
        accelerator.print(f"epoch {epoch}: evaluated", len(torch.cat(seen)))
        history.append({"accuracy": float(torch.cat(seen).mean()), "n": len(torch.cat(seen))})
    accelerator.wait_for_everyone()
    accelerator.save_model(model, OUT + "/saved_model")
    accelerator.save_state(OUT + "/state")
    return history, accelerator.unwrap_model(model), accelerator.num_processes, lr_scheduler.scheduler.last_epoch

config_m = config
config = {"lr": 2e-4, "num_epochs": 2, "seed": 42, "batch_size": 8}
args = {"cpu": True, "mixed_precision": "no"}
"""


def test_accelerate_nlp_example(shell, tmp_path):
    ok(shell, BERT.format(out=str(tmp_path)) + ACCELERATE)
    _, cap = dp_cell(shell, CPU2, "history, trained, nproc, sched_steps = training_function(config, args)\n")
    ns = shell.user_ns
    assert "launch mode, because the cell builds an accelerate Accelerator" in cap.stderr
    assert cap.stdout.count("epoch 0: evaluated 21") == 1           # accelerator.print: once, all 21 samples
    assert ns["nproc"] == 2 and ns["sched_steps"] == 2 * 2 * 2     # the scheduler steps once per process
    assert [h["n"] for h in ns["history"]] == [21, 21]              # gather_for_metrics drops the padding
    import safetensors.torch
    saved = safetensors.torch.load_file(str(tmp_path / "saved_model" / "model.safetensors"))
    trained = ns["trained"].state_dict()
    assert all(torch.equal(saved[k], trained[k]) for k in saved) and len(saved) > 10
    # each rank's random state, as under torchrun; the rest once
    assert sorted(os.listdir(tmp_path / "state")) == [
        "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]
    # one process: twice the batches, the same code
    ok(shell, "history1, trained1, nproc1, sched1 = training_function(config, args)")
    assert (ns["nproc1"], ns["sched1"], [h["n"] for h in ns["history1"]]) == (1, 8, [21, 21])


HF_TRAINER = """\
from transformers import Trainer, TrainingArguments, EarlyStoppingCallback

def compute_metrics(eval_pred):
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean()), "n": len(labels)}

class Collect(transformers.TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))

collect = Collect()
training_args = TrainingArguments(output_dir=OUT + "/hf", learning_rate=2e-4, per_device_train_batch_size=8,
    per_device_eval_batch_size=8, num_train_epochs=2, eval_strategy="epoch", save_strategy="epoch",
    load_best_model_at_end=True, metric_for_best_model="accuracy", report_to="none", logging_steps=1, seed=0,
    use_cpu=True)
"""

HF_CELL = """\
trainer = Trainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                  compute_metrics=compute_metrics,
                  callbacks=[collect, EarlyStoppingCallback(early_stopping_patience=3)])
train_result = trainer.train()
metrics = trainer.evaluate()
preds = trainer.predict(eval_ds)
trainer.save_model(OUT + "/final")
best = trainer.state.best_model_checkpoint
"""


def test_hf_trainer_with_evaluation_checkpoints_and_the_best_model(shell, tmp_path):
    ok(shell, BERT.format(out=str(tmp_path)) + HF_TRAINER)
    _, cap = dp_cell(shell, CPU2, HF_CELL)
    ns = shell.user_ns
    assert ns["train_result"].global_step == 4                      # 32 samples, 8 a step, 2 ranks, 2 epochs
    assert ns["metrics"]["eval_n"] == 21 and ns["preds"].predictions.shape == (21, 2)
    assert ns["preds"].metrics["test_n"] == 21
    # two epochs' evaluations and evaluate()'s in the notebook's callback (rank 0's); the epochs' printed
    # once each (the Trainer prints logs only while its training bar is up)
    assert sum("eval_accuracy" in log for log in ns["collect"].logs) == 3
    assert cap.stdout.count("'eval_accuracy'") == 2
    assert sorted(os.listdir(tmp_path / "hf")) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(os.listdir(tmp_path / "hf" / "checkpoint-2")) == [
        "config.json", "model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
        "trainer_state.json", "training_args.bin"]
    assert ns["best"] in (str(tmp_path / "hf" / "checkpoint-2"), str(tmp_path / "hf" / "checkpoint-4"))
    import safetensors.torch
    for path in (tmp_path / "final", ns["best"]):                   # the best model is the one at the end
        saved = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
        assert all(torch.equal(saved[k], v) for k, v in ns["model"].state_dict().items() if k in saved)
    assert state_sum(ns["model"]) != state_sum(transformers_fresh(ns))


def transformers_fresh(ns):
    torch.manual_seed(0)
    return type(ns["model"])(ns["config"])


LIGHTNING = """\
import os, torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset, random_split
from lightning.pytorch.callbacks import ModelCheckpoint, EarlyStopping
OUT = {out!r}

class LitModel(L.LightningModule):
    def __init__(self, lr=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

class Data(L.LightningDataModule):
    def setup(self, stage):
        g = torch.Generator().manual_seed(0)
        X = torch.randn(96, 8, generator=g)
        full = TensorDataset(X, X.sum(1, keepdim=True))
        self.train_set, self.val_set, self.test_set = random_split(full, [64, 16, 16], generator=g)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=8)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=8)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=8)

L.seed_everything(0)
lit, dm = LitModel(), Data()
checkpoint = ModelCheckpoint(dirpath=OUT + "/ckpts", monitor="val_loss", save_top_k=1, filename="best-{{epoch}}")
stopper = EarlyStopping(monitor="val_loss", patience=5)
"""

LIGHTNING_CELL = """\
trainer = L.Trainer(accelerator="cpu", devices={devices}, max_epochs=2, callbacks=[checkpoint, stopper],
                    default_root_dir=OUT, enable_progress_bar=False, enable_model_summary=False, logger=False)
trainer.fit(lit, datamodule=dm)
val = trainer.validate(lit, datamodule=dm, verbose=False)
test = trainer.test(lit, datamodule=dm, verbose=False)
steps = trainer.global_step
"""


def test_lightning_example_with_checkpoints_validate_and_test(shell, tmp_path):
    ok(shell, LIGHTNING.format(out=str(tmp_path)))
    dp_cell(shell, CPU2, LIGHTNING_CELL.format(devices=2))
    ns = shell.user_ns
    assert ns["steps"] == 8                                         # 64 samples, 8 a step, 2 ranks, 2 epochs
    assert sorted(ns["val"][0]) == ["val_loss"] and sorted(ns["test"][0]) == ["test_loss"]
    # the notebook's callbacks hold what they found
    best = ns["checkpoint"].best_model_path
    assert os.path.dirname(best) == str(tmp_path / "ckpts")
    assert os.listdir(tmp_path / "ckpts") == [os.path.basename(best)]        # written once
    callbacks = torch.load(best, weights_only=False)["callbacks"]
    saved_score = next(v["best_model_score"] for k, v in callbacks.items() if k.startswith("ModelCheckpoint"))
    assert float(ns["checkpoint"].best_model_score) == float(saved_score)
    reloaded = type(ns["lit"]).load_from_checkpoint(best)
    assert reloaded.hparams.lr == 0.05
    if best.endswith("epoch=1.ckpt"):                              # the last epoch's: the notebook's weights
        assert state_sum(reloaded) == state_sum(ns["lit"])


FABRIC = """\
import os, torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset
OUT = {out!r}
g = torch.Generator().manual_seed(0)
X = torch.randn(64, 8, generator=g)
ds = TensorDataset(X, X.sum(1, keepdim=True))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

def train(fabric, model, optimizer, epochs=2):
    dataloader = fabric.setup_dataloaders(DataLoader(ds, batch_size=8))
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for epoch in range(epochs):
        for x, y in dataloader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        fabric.print(f"epoch {{epoch}} loss {{losses[-1]:.4f}}")
    fabric.barrier()
    fabric.save(OUT + "/fabric.ckpt", {{"model": model, "optimizer": optimizer, "epoch": epochs}})
    fabric.barrier()
    remainder = fabric.load(OUT + "/fabric.ckpt", {{"model": model, "optimizer": optimizer}})
    return losses, remainder, fabric.world_size
"""


def test_fabric_launch_with_save_and_load(shell, tmp_path):
    ok(shell, FABRIC.format(out=str(tmp_path)))
    _, cap = dp_cell(shell, CPU2, """\
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
        losses, remainder, world = fabric.launch(train, model, optimizer)
        """)
    ns = shell.user_ns
    assert ns["world"] == 2 and ns["remainder"] == {"epoch": 2} and len(ns["losses"]) == 2
    assert cap.stdout.count("epoch 1 loss") == 1
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=False)
    assert all(torch.equal(saved["model"][k], v) for k, v in ns["model"].state_dict().items())
    momentum = saved["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(ns["optimizer"].state[next(ns["model"].parameters())]["momentum_buffer"], momentum)
