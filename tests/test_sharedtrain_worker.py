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
