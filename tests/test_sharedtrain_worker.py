"""Inside a Hogwild worker (gpumagic.sharedtrain.worker): the channel that sends counters and reports."""
from __future__ import annotations

import time

import torch

from gpumagic.sharedtrain import worker as sharedtrain_worker


def test_gpu_values_reported_are_read_when_sent(monkeypatch):
    # report() keeps a copy of a CUDA tensor and reads it at the next send (no wait for the GPU
    # every step); CPU tensors become numbers at once.
    sent = []
    channel = sharedtrain_worker.Channel(sent.append, t0=time.monotonic())
    channel.report(loss=torch.tensor(0.5), ids=torch.arange(3), note="x")
    entry = channel.buffer[-1] if channel.buffer else sent[-1][5][-1]
    assert entry["loss"] == 0.5 and entry["ids"] == [0, 1, 2] and entry["note"] == "x"
    entries = [{"step": 1, "time": 0.0, "loss": torch.tensor([1.5, 2.5]), "one": torch.tensor([4.0])}]
    sharedtrain_worker._resolve(entries)
    assert entries == [{"step": 1, "time": 0.0, "loss": [1.5, 2.5], "one": 4.0}]
    # Without a GPU here, stand in the meta device for CUDA: a copy is kept, not the tensor itself.
    monkeypatch.setattr(sharedtrain_worker, "_READ_LATER", ("meta",))
    meta = torch.ones((), device="meta")
    kept = sharedtrain_worker._plain("loss", meta, defer=True)
    assert isinstance(kept, torch.Tensor) and kept is not meta and kept.device.type == "meta"
    channel.last_flush = time.monotonic() + 3600  # nothing is sent (and read) during this check
    channel.report(loss=meta)
    assert isinstance(channel.buffer[-1]["loss"], torch.Tensor)


def test_report_steps_count_optimizer_steps_else_training_batches_else_reports():
    def steps_reported(actions) -> list:
        sent: list = []
        channel = sharedtrain_worker.Channel(sent.append, t0=time.monotonic())
        for action in actions:
            if action == "batch":
                channel.step(torch.zeros(4, 2))
            elif action == "eval-batch":
                with torch.no_grad():
                    channel.step(torch.zeros(4, 2))
            elif action == "opt":
                channel.optimizer_step()
            else:
                channel.report(loss=1.0)
        entries = [entry for tick in sent for entry in tick[5]] + channel.buffer
        return [entry["step"] for entry in entries]
    assert steps_reported(["batch", "opt", "report", "batch", "opt", "report"]) == [1, 2]
    # updates by hand (no optimizer): the training batches taken so far; an evaluation pass counts none
    assert steps_reported(["batch", "batch", "report", "eval-batch", "batch", "report"]) == [2, 3]
    assert steps_reported(["report", "report"]) == [1, 2]   # neither: the reports so far
