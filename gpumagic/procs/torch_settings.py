"""torch's process-wide settings, kept alike in the kernel and the ranks, both ways.

The matmul precision, the cuDNN and TF32 switches, the default dtype and device, deterministic
algorithms and anomaly detection decide what a cell computes as much as its code does, and a
notebook sets them in any cell: ``torch.set_default_dtype(torch.float64)`` at the top (a rank
left at float32 then made float32 data for a float64 model), or ``torch.autograd.set_detect_anomaly
(True)`` while hunting a NaN. Before each cell every rank takes the kernel's (:func:`current` in
the kernel, :func:`apply` on the rank); after it, what the cell changed on rank 0 is set in the
kernel (:func:`changed`), as after a plain cell.

In a notebook::

    torch.set_default_dtype(torch.float64)     # a plain cell: the ranks' default from the next cell on
    %%dataparallel
    torch.use_deterministic_algorithms(True)   # in the notebook too once the cell ends
"""
from __future__ import annotations

from collections.abc import Callable

__all__ = ["current", "apply", "changed"]


def current() -> dict:
    """This process's settings, as plain values."""
    import torch
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            "default_device": torch.get_default_device().type,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "detect_anomaly": torch.is_anomaly_enabled()}


def apply(settings: dict, device=None) -> None:
    """Take ``settings`` (all of :func:`current`'s, or some); a default device of type ``cuda`` means
    ``device`` where given (a rank's own GPU)."""
    import torch
    handlers: dict[str, Callable] = {
        "float32_matmul_precision": torch.set_float32_matmul_precision,
        "cudnn_benchmark": lambda v: setattr(torch.backends.cudnn, "benchmark", v),
        "cudnn_deterministic": lambda v: setattr(torch.backends.cudnn, "deterministic", v),
        "cudnn_allow_tf32": lambda v: setattr(torch.backends.cudnn, "allow_tf32", v),
        "matmul_allow_tf32": lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v),
        "default_dtype": lambda v: torch.set_default_dtype(getattr(torch, v)),
        # (None, not "cpu": no device context left installed where the default is the plain one)
        "default_device": lambda v: torch.set_default_device(
            None if v == "cpu" else (device if v == "cuda" and device is not None else v)),
        "detect_anomaly": torch.autograd.set_detect_anomaly,
    }
    now = current()
    # Only what differs: each cell's start pays nothing for settings left alone (and
    # use_deterministic_algorithms imports torch._dynamo, a second in a fresh worker).
    for key, value in settings.items():
        if key in handlers and now.get(key) != value:
            handlers[key](value)
    deterministic = (settings.get("deterministic", now["deterministic"]),
                     settings.get("deterministic_warn_only", now["deterministic_warn_only"]))
    if deterministic != (now["deterministic"], now["deterministic_warn_only"]):
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


def changed(before: dict, after: dict) -> dict:
    """The settings ``after`` holds otherwise than ``before``."""
    return {key: value for key, value in after.items() if before.get(key) != value}
