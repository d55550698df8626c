"""Training strategies for ``%%dataparallel``: the plan of a run, then ``ddp`` or ``dp``.

:func:`make_plan` turns the magic's options into a :class:`Plan` (devices,
backend, strategy), raising ``UsageError`` that names what would work.
``ddp.run_cell`` runs a cell on a worker pool, one process per device;
``dp.run_cell`` runs it in the kernel, splitting each call of the model over
the devices.

In a notebook::

    %%dataparallel --nprocs 2
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import usage_error

__all__ = ["Plan", "make_plan", "STRATEGIES", "BACKENDS", "POOL_NAME"]

STRATEGIES = ("ddp", "dp")
BACKENDS = ("nccl", "gloo")
POOL_NAME = "dataparallel"
CPU_DEFAULT_NPROCS = 2


@dataclass
class Plan:
    """What a ``%%dataparallel`` cell will do."""
    strategy: str                       # "ddp" | "dp"
    devices: list[str]                  # one per rank (ddp) or per replica (dp)
    backend: str | None = None          # ddp only
    timeout: float = 1800.0
    models: list[str] | None = None
    all_output: bool = False
    seed: int | None = None
    static_graph: bool = False
    find_unused: bool = False
    bucket_mb: float | None = None
    notes: list[str] = field(default_factory=list)
    remote: int = 0                     # ranks joining from other machines
    listen: str | None = None           # the address other machines reach this kernel at

    @property
    def world_size(self) -> int:
        return len(self.devices) + self.remote


def _split(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def make_plan(*, devices: str | None = None, nprocs: int | None = None, strategy: str | None = None,
              models: str | None = None, backend: str | None = None, timeout: float | None = None,
              all_output: bool = False, seed: int | None = None, static_graph: bool = False,
              find_unused: bool = False, bucket_mb: float | None = None, remote: int | None = None,
              listen: str | None = None, gpus=None) -> Plan:
    """Check the options against the machine; returns a :class:`Plan` or raises ``UsageError``.

    ``gpus`` (a list of :class:`gpumagic.devices.Gpu`) defaults to the visible ones.

    >>> make_plan(nprocs=2, gpus=[]).devices
    ['cpu', 'cpu']
    """
    from .. import devices as devmod

    gpus = devmod.visible_gpus() if gpus is None else gpus
    gpu_names = [g.device for g in gpus]
    notes: list[str] = []

    strategy = (strategy or "ddp").lower()
    if strategy not in STRATEGIES:
        raise usage_error(f"--strategy {strategy!r} is not a strategy", STRATEGIES)
    if nprocs is not None and nprocs < 1:
        raise usage_error(f"--nprocs {nprocs}: need at least one process",
                          [f"--nprocs {n}" for n in range(1, max(2, len(gpus)) + 1)])
    if timeout is not None and timeout <= 0:
        raise usage_error(f"--timeout {timeout}: must be a positive number of seconds")
    if backend is not None:
        backend = backend.lower()
        if backend not in BACKENDS:
            raise usage_error(f"--backend {backend!r} is not a torch.distributed backend here", BACKENDS)
    if bucket_mb is not None and bucket_mb <= 0:
        raise usage_error(f"--bucket-mb {bucket_mb}: must be positive")
    if remote is not None and remote < 0:
        raise usage_error(f"--remote {remote}: the number of ranks joining from other machines", ["--remote 8"])
    if remote and strategy == "dp":
        raise usage_error("--remote needs worker processes; --strategy dp runs in the kernel", ["--strategy ddp"])

    listed: list[str] = []
    for spec in _split(devices):
        name = devmod.parse_device(spec, gpus)
        if name not in ("cpu",) and not name.startswith("cuda:"):
            raise usage_error(f"--devices: {name!r} cannot hold a rank", ["cpu"] + gpu_names)
        listed.append(name)
    if devices is not None and not listed:
        raise usage_error("--devices is empty", ["cpu"] + gpu_names)
    gpu_listed = [d for d in listed if d != "cpu"]
    if gpu_listed and len(gpu_listed) != len(listed):
        raise usage_error("--devices mixes cpu and GPUs; one kind per run", [",".join(gpu_names) or "cpu", "cpu"])
    if len(set(gpu_listed)) != len(gpu_listed):
        raise usage_error(f"--devices names a GPU twice ({','.join(listed)})", gpu_names)

    if listed == ["cpu"] * len(listed) and listed:
        count = nprocs if nprocs is not None else max(len(listed), 1 if strategy == "dp" else CPU_DEFAULT_NPROCS)
        chosen = ["cpu"] * count
    elif listed:
        if nprocs is not None and nprocs != len(listed):
            raise usage_error(f"--nprocs {nprocs} does not match --devices {','.join(listed)} "
                              f"({len(listed)} devices); give one of them", [f"--nprocs {len(listed)}"])
        chosen = listed
    elif nprocs is not None:
        if gpus:
            if nprocs > len(gpus):
                raise usage_error(f"--nprocs {nprocs}: only {len(gpus)} GPU(s) visible; one process per GPU, "
                                  f"or CPU processes with --devices cpu --nprocs {nprocs}",
                                  [f"--nprocs {n}" for n in range(1, len(gpus) + 1)] + [f"--devices cpu --nprocs {nprocs}"])
            chosen = gpu_names[:nprocs]
        else:
            chosen = ["cpu"] * nprocs
    else:
        if gpus:
            chosen = list(gpu_names)
        else:
            chosen = ["cpu"] * (1 if strategy == "dp" else CPU_DEFAULT_NPROCS)
            if strategy == "ddp":
                notes.append(f"no GPU visible: {CPU_DEFAULT_NPROCS} CPU processes (gloo); "
                             "--nprocs N for another count")

    on_gpu = chosen[0] != "cpu"
    if strategy == "dp":
        if backend is not None:
            raise usage_error("--backend applies to --strategy ddp (worker processes); dp runs in the kernel",
                              ["--strategy ddp --backend " + (backend or "gloo")])
        if not on_gpu:
            if len(chosen) > 1:
                notes.append("--strategy dp on the CPU runs on one device: the cell runs as is, without splitting")
            chosen = ["cpu"]
            notes.append("--strategy dp on cpu: one device, so each call of the model runs whole (no parallelism)")
        elif len(chosen) == 1:
            notes.append(f"--strategy dp with one device ({chosen[0]}): each call runs whole on it")
        return Plan("dp", chosen, None, timeout or 1800.0, _split(models) or None, all_output, seed,
                    notes=notes)

    if backend is None:
        backend = "nccl" if on_gpu else "gloo"
    if backend == "nccl":
        if not on_gpu:
            raise usage_error("--backend nccl needs GPUs, and the ranks here are on the CPU", ["gloo"])
        import torch.distributed as dist
        if not dist.is_nccl_available():
            raise usage_error("--backend nccl: this torch was built without NCCL", ["gloo"])
    try:
        import torch.distributed as dist
        if not dist.is_available():
            raise usage_error("torch.distributed is not available in this torch build; use --strategy dp",
                              ["--strategy dp"])
    except ImportError:  # pragma: no cover
        raise usage_error("torch.distributed is not available; use --strategy dp", ["--strategy dp"]) from None
    if on_gpu and len(chosen) == 1 and not remote:
        notes.append(f"one device ({chosen[0]}): a single worker process, no speed-up")
    if remote:
        listen = listen or os.environ.get("GPUMAGIC_LISTEN_ADDR") or os.environ.get("MASTER_ADDR") or _host_address()
    return Plan("ddp", chosen, backend, float(timeout or 1800.0), _split(models) or None, all_output, seed,
                static_graph, find_unused, bucket_mb, notes, int(remote or 0), listen)


def _host_address() -> str:
    """This machine's address as other machines would reach it (the hostname's)."""
    import socket
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
