"""``--strategy ddp`` in the kernel (:class:`Ddp`): gpumagic's own DistributedDataParallel, the default.

It owns the options of its DDP wrapper: ``--static-graph``, ``--find-unused``, ``--bucket-mb``, ``--grad-dtype``
and ``--compile``, checked here before anything starts. Before the cell the trained modules' tensors and the
notebook's gradients are bound for each rank's device (the optimizers' state stays where it is until each
optimizer places it); the ranks' side is :class:`~.ddp_rank.DdpRank`; after it, rank 0's trained state goes
into the notebook's objects in place (:func:`~.trained.load_trained`). A cell that distributes by itself
turns this into launch mode (:class:`~.launch.Launch`).

In a notebook::

    %%dataparallel --static-graph --bucket-mb 50
    for x, y in loader: ...
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import usage_error
from .base import Prepared
from .ddp_grads import notebook_grads
from .ddp_rank import DdpRank
from .ddp_wrapper import GRAD_DTYPES
from .process import ProcessStrategy
from .trained import Loaded, load_into_notebook, tensor_targets

__all__ = ["Ddp", "COMPILE_MODES", "MAX_BUCKET_MB"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MAX_BUCKET_MB = 1 << 20         # MB: --bucket-mb above this overflows DDP's byte count


@dataclass
class Ddp(ProcessStrategy):
    """gpumagic's DDP, with the options of its wrapper."""
    static_graph: bool = False
    find_unused: bool = False
    bucket_mb: float | None = None
    grad_dtype: str = "fp32"
    compile: str | None = None

    name = "ddp"
    OPTIONS = ("static_graph", "find_unused", "bucket_mb", "grad_dtype", "compile")

    @classmethod
    def from_options(cls, *, static_graph: bool = False, find_unused: bool = False, bucket_mb: float | None = None,
                     grad_dtype: str | None = None, compile: str | None = None) -> Ddp:
        """The options checked: ``UsageError`` naming what would work."""
        if bucket_mb is not None and not (math.isfinite(bucket_mb) and bucket_mb > 0):
            raise usage_error(f"--bucket-mb {bucket_mb}: must be a positive, finite number of MB",
                              ["--bucket-mb 25 (default)", "--bucket-mb 100"])
        if bucket_mb is not None and bucket_mb > MAX_BUCKET_MB:
            # (DDP takes it in bytes as a C++ integer, which a larger one overflows)
            raise usage_error(f"--bucket-mb {bucket_mb:g}: at most {MAX_BUCKET_MB} MB (1 TiB); a bucket larger "
                              "than the model holds the whole model", ["--bucket-mb 25 (default)",
                                                                       f"--bucket-mb {MAX_BUCKET_MB}"])
        grad_dtype = (grad_dtype or "fp32").lower()
        if grad_dtype not in GRAD_DTYPES:
            raise usage_error(f"--grad-dtype {grad_dtype!r} is not a gradient dtype", GRAD_DTYPES)
        if compile is not None and compile not in COMPILE_MODES:
            raise usage_error(f"--compile {compile!r} is not a torch.compile mode", COMPILE_MODES)
        return cls(bool(static_graph), bool(find_unused), bucket_mb, grad_dtype, compile)

    @classmethod
    def refuse(cls, flags: list[str]) -> None:
        raise usage_error(f"{', '.join(flags)} configure(s) the sharding of --strategy fsdp", ["--strategy fsdp"])

    def on_cluster(self) -> None:
        """DDP runs on a cluster's engines."""

    def given(self) -> list[str]:
        """The wrapper's options given, as flags."""
        return [flag for flag, given in (("--static-graph", self.static_graph), ("--find-unused", self.find_unused),
                                         ("--bucket-mb", self.bucket_mb is not None),
                                         ("--grad-dtype", self.grad_dtype != "fp32"), ("--compile", self.compile))
                if given]

    def for_launch(self, why: str, devices=(), on_cluster: bool = False):
        from .launch import Launch
        ours = self.given()
        reason = "with --launch" if why == "--launch" else f"in launch mode ({why})"
        if ours:
            verb = "configures" if len(ours) == 1 else "configure"
            raise usage_error(f"{', '.join(ours)} {verb} gpumagic's DDP wrapper, and {reason} the cell's own code "
                              "distributes: set them there (for example DistributedDataParallel(static_graph=True), "
                              "torch.compile(model)), or drop them", ["--devices", "--nprocs", "--backend", "--timeout",
                                                                       "--all-output", "--seed", "--model"])
        launch = Launch(why)
        launch.check_devices(list(devices), on_cluster)
        return launch

    def before(self, read, ranks) -> Prepared:
        # the trained modules' tensors and gradients go to each rank's device; each rank starts from the
        # notebook's gradients, as a plain cell adds to them
        return Prepared(DdpRank(self.static_graph, self.find_unused, self.bucket_mb, self.grad_dtype, self.compile),
                        tensor_targets(read), notebook_grads(read.survey.modules))

    def after(self, read, returned, done, buffer, ranks) -> Loaded:
        return load_into_notebook(read, returned)
