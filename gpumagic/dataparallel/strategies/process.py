"""What the strategies with worker processes share in the kernel (:class:`ProcessStrategy`): DDP, FSDP, launch mode.

In a notebook::

    %%dataparallel --backend gloo        # a backend, checked against where the ranks are
"""
from __future__ import annotations

from ...errors import usage_error
from .base import Strategy

__all__ = ["ProcessStrategy"]


class ProcessStrategy(Strategy):
    """A strategy whose ranks are worker processes (or a cluster's engines) joined in a process group."""

    def on_cluster(self) -> None:
        """``UsageError`` where the strategy cannot run on a cluster's engines (DDP and launch mode can)."""
        raise usage_error(f"--cluster: the engines run --strategy ddp (and launch mode); --strategy {self.name} runs "
                          "on this machine", ["--cluster with --strategy ddp",
                                              f"--strategy {self.name} without --cluster"])

    def place(self, devices: list[str], backend: str | None, notes: list[str]) -> str:
        """The process group's backend for ranks on ``devices`` (nccl on GPUs, gloo on the CPU)."""
        import torch.distributed as dist
        on_gpu = devices[0] != "cpu"
        if not dist.is_available():
            raise usage_error("torch.distributed is not available in this torch build; use --strategy dp",
                              ["--strategy dp"])
        backend = backend or ("nccl" if on_gpu else "gloo")
        if backend == "nccl" and not on_gpu:
            raise usage_error("--backend nccl needs GPUs, and the ranks here are on the CPU", ["gloo"])
        if backend == "nccl" and not dist.is_nccl_available():
            raise usage_error("--backend nccl: this torch was built without NCCL", ["gloo"])
        if on_gpu and len(devices) == 1:
            notes.append(f"one device ({devices[0]}): a single worker process, no speed-up")
        return backend

    def devices_for(self, placed: list[str]) -> list[str]:
        return placed

    def check_cell(self, read) -> None:
        """``UsageError`` for a model on the meta device, which only fsdp can train (it has no weights to copy)."""
        meta = [n for n, m in read.survey.modules.items() if any(t.is_meta for t in [*m.parameters(), *m.buffers()])]
        if meta:
            raise usage_error(f"{', '.join(meta)} is on the meta device (it has no weights to copy to the ranks): "
                              "--strategy fsdp initialises such a model on the ranks and trains it there",
                              ["--strategy fsdp"])
