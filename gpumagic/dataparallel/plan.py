"""The plan of a ``%%dataparallel`` cell (:class:`Plan`): which devices and backend, and which strategy with its own
options.

:func:`make_plan` checks the magic's options against the machine, raising ``UsageError`` that names what would
work, before anything starts. The options every strategy shares (devices, backend, timeout, seed, output,
the cluster) are checked here; each strategy checks its own (:mod:`.strategies`: DDP's wrapper options,
FSDP's units, DP's lack of processes) and refuses another's.

In a notebook::

    make_plan(nprocs=2, gpus=[]).devices       # ['cpu', 'cpu']
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import usage_error
from ..procs.cpus import check_process_count
from ..procs.seeding import check_seed
from .strategies.base import Strategy
from .strategies.ddp import Ddp
from .strategies.dp import Dp
from .strategies.fsdp import Fsdp

__all__ = ["Plan", "make_plan", "STRATEGIES", "BACKENDS", "flag"]

# each with its own options (OPTIONS), checked by its from_options; another's refused by its refuse
STRATEGIES: dict[str, Any] = {"ddp": Ddp, "fsdp": Fsdp, "dp": Dp}
BACKENDS = ("nccl", "gloo")
CPU_DEFAULT_NPROCS = 2
MIN_TIMEOUT = 1.0               # seconds: --timeout below this times out forming the group
MAX_TIMEOUT = 365 * 24 * 3600   # seconds: --timeout above this is no timeout, and overflows clocks


@dataclass
class Plan:
    """What a ``%%dataparallel`` cell will do."""
    strategy: Strategy
    devices: list[str]                  # one per rank (or per replica, dp); a cluster's: once formed
    backend: str | None = None          # worker processes only
    timeout: float = 1800.0
    models: list[str] | None = None
    all_output: bool = False
    seed: int | None = None
    notes: list[str] = field(default_factory=list)
    cluster: str | None = None          # the ipyparallel cluster whose engines are the ranks (None: this machine)
    nprocs: int | None = None           # on a cluster: how many of its engines (None: all)

    @property
    def world_size(self) -> int:
        return len(self.devices)


def flag(option: str) -> str:
    """An option's flag: ``static_graph`` is ``--static-graph``."""
    return "--" + option.replace("_", "-")


def _split(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _strategy(name: str | None, options: dict, worker_only: dict) -> Strategy:
    """The strategy named, with its own options checked; ``UsageError`` for an unknown one, or for options that
    belong to another (``worker_only``: the shared options that need worker processes, given or not)."""
    name = (name or "ddp").lower()
    if name not in STRATEGIES:
        raise usage_error(f"--strategy {name!r} is not a strategy", STRATEGIES)
    cls = STRATEGIES[name]
    known = {o for c in STRATEGIES.values() for o in c.OPTIONS}
    unknown = [o for o in options if o not in known]
    if unknown:
        raise TypeError(f"make_plan() got unexpected options: {', '.join(unknown)}")
    given = [flag(o) for o, v in {**worker_only, **options}.items()
             if v not in (None, False) and not (o == "grad_dtype" and str(v).lower() == "fp32")
             and o not in cls.OPTIONS and (o in options or not cls.processes)]
    if given:
        cls.refuse(given)
    return cls.from_options(**{o: v for o, v in options.items() if o in cls.OPTIONS})


def _check_shared(nprocs, timeout, backend, gpu_count: int) -> str | None:
    """The options every strategy shares that are wrong whatever the machine; returns the backend, lower-cased."""
    if nprocs is not None and nprocs < 1:
        raise usage_error(f"--nprocs {nprocs}: need at least one process",
                          [f"--nprocs {n}" for n in range(1, max(2, gpu_count) + 1)])
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise usage_error(f"--timeout {timeout}: must be a positive, finite number of seconds",
                          ["--timeout 1800 (default)", "--timeout 600"])
    if timeout is not None and timeout < MIN_TIMEOUT:
        raise usage_error(f"--timeout {timeout:g}: at least {MIN_TIMEOUT:.0f} second: forming the process group "
                          "waits on it too, and gloo rounds a shorter one to 0 ms",
                          ["--timeout 1800 (default)", "--timeout 60"])
    if timeout is not None and timeout > MAX_TIMEOUT:
        # (torch's timedelta overflows past 8.6e13 s, gloo's clock arithmetic past about 9e9 s)
        raise usage_error(f"--timeout {timeout:g}: at most {MAX_TIMEOUT} seconds (a year); a collective "
                          "waiting longer is stuck", ["--timeout 1800 (default)", f"--timeout {MAX_TIMEOUT}"])
    if backend is None:
        return None
    backend = backend.lower()
    if backend not in BACKENDS:
        raise usage_error(f"--backend {backend!r} is not a torch.distributed backend here", BACKENDS)
    return backend


def make_plan(*, devices: str | None = None, nprocs: int | None = None, strategy: str | None = None,
              models: str | None = None, backend: str | None = None, timeout: float | None = None,
              all_output: bool = False, seed: int | None = None, cluster: str | None = None,
              oversubscribe: bool = False, launch: bool = False, gpus=None, **options) -> Plan:
    """Check the options against the machine; returns a :class:`Plan` or raises ``UsageError``.

    ``options`` are the strategies' own (``static_graph=True``, ``wrap="Block"``...); ``gpus`` (a list of
    :class:`gpumagic.devices.Gpu`) defaults to the visible ones.
    """
    from .. import devices as devmod
    gpus = devmod.visible_gpus() if gpus is None else gpus
    if gpus and devmod.torch_cpu_only():
        # GPUs this torch cannot use hold no rank: ranks go where they would on a machine without them.
        if any(d != "cpu" for d in _listed_devices(devices, gpus)):
            import torch
            raise usage_error(f"--devices {devices}: GPUs are not usable by this torch ({torch.__version__}, "
                              "CUDA not built)", ["cpu"])
        gpus = []
    backend = _check_shared(nprocs, timeout, backend, len(gpus))
    chosen = _strategy(strategy, options, {"timeout": timeout, "all_output": all_output, "seed": seed,
                                           "oversubscribe": oversubscribe})
    check_seed(seed)
    timeout, listed_models = float(timeout or 1800.0), _split(models) or None
    if cluster is not None:
        _check_cluster_options(cluster, chosen, devices, oversubscribe)
        if launch:
            chosen = chosen.for_launch("--launch", [], on_cluster=True)
        return Plan(chosen, [], backend, timeout, listed_models, all_output, seed, cluster=cluster, nprocs=nprocs)
    notes: list[str] = []
    placed = _choose_devices(_listed_devices(devices, gpus), nprocs, chosen, [g.device for g in gpus], notes)
    backend = chosen.place(placed, backend, notes)
    if chosen.processes and placed[0] == "cpu":
        crowded = check_process_count(len(placed), oversubscribe)
        if crowded:
            notes.append(crowded)
    if launch:
        chosen = chosen.for_launch("--launch", placed)
    return Plan(chosen, chosen.devices_for(placed), backend, timeout, listed_models, all_output, seed, notes)


def _check_cluster_options(cluster: str, strategy: Strategy, devices, oversubscribe: bool) -> None:
    """On a cluster the engines are the ranks: what this machine's options choose does not apply."""
    strategy.on_cluster()
    if devices is not None:
        raise usage_error("--cluster: each engine's device is its host's GPU LOCAL_RANK (or the CPU); --devices "
                          "names this machine's", ["--cluster --nprocs N (the first N engines)", "drop --cluster"])
    if oversubscribe:
        raise usage_error("--oversubscribe is about this machine's cores; the cluster places its engines",
                          ["drop --oversubscribe"])
    if not cluster:
        raise usage_error("--cluster: name the cluster", ["--cluster (the one started here)", "--cluster PROFILE"])


def _listed_devices(devices: str | None, gpus) -> list[str]:
    """``--devices`` as canonical names: one kind (CPU or GPUs), no GPU twice."""
    from .. import devices as devmod
    gpu_names = [g.device for g in gpus]
    listed: list[str] = []
    for spec in _split(devices):
        name = devmod.parse_device(spec, gpus)
        if name != "cpu" and not name.startswith("cuda:"):
            raise usage_error(f"--devices: {name!r} cannot hold a rank", ["cpu"] + gpu_names)
        listed.append(name)
    if devices is not None and not listed:
        raise usage_error("--devices is empty", ["cpu"] + gpu_names)
    gpu_listed = [d for d in listed if d != "cpu"]
    if gpu_listed and len(gpu_listed) != len(listed):
        raise usage_error("--devices mixes cpu and GPUs; one kind per run", [",".join(gpu_names) or "cpu", "cpu"])
    if len(set(gpu_listed)) != len(gpu_listed):
        raise usage_error(f"--devices names a GPU twice ({','.join(listed)})", gpu_names)
    return listed


def _choose_devices(listed: list[str], nprocs, strategy: Strategy, gpu_names: list[str], notes: list[str]) -> list[str]:
    """One device per rank, from ``--devices``, ``--nprocs`` and what the machine has."""
    if listed and listed == ["cpu"] * len(listed):
        count = nprocs if nprocs is not None else max(len(listed), CPU_DEFAULT_NPROCS if strategy.processes else 1)
        return ["cpu"] * count
    if listed:
        if nprocs is not None and nprocs != len(listed):
            raise usage_error(f"--nprocs {nprocs} does not match --devices {','.join(listed)} "
                              f"({len(listed)} devices); give one of them", [f"--nprocs {len(listed)}"])
        return listed
    if nprocs is not None:
        if not gpu_names:
            return ["cpu"] * nprocs
        if nprocs > len(gpu_names):
            raise usage_error(f"--nprocs {nprocs}: only {len(gpu_names)} GPU(s) visible; one process per GPU, "
                              f"or CPU processes with --devices cpu --nprocs {nprocs}",
                              [f"--nprocs {n}" for n in range(1, len(gpu_names) + 1)]
                              + [f"--devices cpu --nprocs {nprocs}"])
        return gpu_names[:nprocs]
    if gpu_names:
        return list(gpu_names)
    if strategy.processes:
        notes.append(f"no GPU visible: {CPU_DEFAULT_NPROCS} CPU processes (gloo); --nprocs N for another count")
        return ["cpu"] * CPU_DEFAULT_NPROCS
    return ["cpu"]
