"""Launch mode in the kernel (:class:`Launch`): every rank runs the cell as a process ``torchrun`` started, and the
cell's framework (a Hugging Face ``Trainer``, accelerate, Lightning, its own DDP) distributes.

Chosen with ``--launch``, or when reading the cell shows such a framework (:mod:`..kernel.detect`). Nothing is
wrapped or split; each rank's environment is torchrun's (:mod:`.launch_rank`), rank 0 listening at a port
free on its host. After the cell the notebook's modules, optimizers and schedulers take rank 0's trained
state, as after a DDP cell (a module a framework sharded, gathered whole first).

In a notebook::

    %%dataparallel --launch
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train_set)
    result = trainer.train()
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import usage_error
from .base import Prepared
from .ddp_grads import not_carried
from .launch_rank import LaunchRank
from .process import ProcessStrategy
from .trained import Loaded, load_into_notebook, tensor_targets

__all__ = ["Launch"]


@dataclass
class Launch(ProcessStrategy):
    """Launch mode; ``why``: what chose it (``"--launch"``, or what the cell builds)."""
    why: str = "--launch"

    name = "launch"
    splits = False

    def _reason(self) -> str:
        return "with --launch" if self.why == "--launch" else f"in launch mode ({self.why})"

    def check_devices(self, devices: list[str], on_cluster: bool) -> None:
        """Rank k uses GPU ``LOCAL_RANK=k`` as under torchrun: the ranks need ``cuda:0`` to ``cuda:N-1`` in order
        (on a cluster each host numbers its own GPUs from 0)."""
        gpus = [d for d in devices if d != "cpu"]
        if gpus and not on_cluster and gpus != [f"cuda:{i}" for i in range(len(gpus))]:
            raise usage_error(f"--devices {','.join(devices)}: {self._reason()}, rank k uses GPU LOCAL_RANK=k as "
                              "under torchrun, so the ranks need cuda:0 to cuda:N-1 in order; to train on other "
                              "GPUs, start the kernel with CUDA_VISIBLE_DEVICES naming them",
                              [f"--nprocs {len(gpus)}", ",".join(f"cuda:{i}" for i in range(len(gpus)))])

    def for_launch(self, why: str, devices=(), on_cluster: bool = False) -> Launch:
        return self

    def on_cluster(self) -> None:
        """Launch mode runs on a cluster's engines, as torchrun runs on several hosts."""

    def check_cell(self, read) -> None:
        """Nothing to refuse: the cell's framework decides what to do with its models (one on the meta device
        too)."""

    def before(self, read, ranks) -> Prepared:
        address, port = ranks.launch_address()
        rank = LaunchRank(address, port, f"gpumagic-{os.getpid()}-{ranks.pids[0]}", read.notebook.is_kernel)
        return Prepared(rank, tensor_targets(read),
                        not_carried(read.survey.modules, "in launch mode the cell's framework owns them"))

    def after(self, read, returned, done, buffer, ranks) -> Loaded:
        return load_into_notebook(read, returned)
