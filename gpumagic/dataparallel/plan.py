"""The plan of a ``%%dataparallel`` cell: which devices, which strategy, which backend.

:func:`make_plan` turns the magic's options into a :class:`Plan`, raising
``UsageError`` that names what would work, before anything starts.

In a notebook::

    make_plan(nprocs=2, gpus=[]).devices       # ['cpu', 'cpu']
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import usage_error
from ..procs.cpus import check_process_count
from ..procs.seeding import check_seed

__all__ = ["Plan", "make_plan", "check_launch", "STRATEGIES", "BACKENDS", "POOL_NAME"]

STRATEGIES = ("ddp", "fsdp", "dp")
BACKENDS = ("nccl", "gloo")
POOL_NAME = "dataparallel"
CPU_DEFAULT_NPROCS = 2
MIN_TIMEOUT = 1.0               # seconds: --timeout below this times out forming the group
MAX_TIMEOUT = 365 * 24 * 3600   # seconds: --timeout above this is no timeout, and overflows clocks
MAX_BUCKET_MB = 1 << 20         # MB: --bucket-mb above this overflows DDP's byte count


@dataclass
class Plan:
    """What a ``%%dataparallel`` cell will do."""
    strategy: str                       # "ddp" | "fsdp" | "dp"
    devices: list[str]                  # one per rank (ddp) or per replica (dp); a cluster's: once formed
    backend: str | None = None          # ddp only
    timeout: float = 1800.0
    models: list[str] | None = None
    all_output: bool = False
    seed: int | None = None
    static_graph: bool = False
    find_unused: bool = False
    bucket_mb: float | None = None
    notes: list[str] = field(default_factory=list)
    grad_dtype: str = "fp32"            # the dtype gradients are all-reduced in
    compile: str | None = None          # torch.compile mode for the cell's models; None: eager
    launch: bool = False                # --launch: every rank as a torchrun process, whatever the cell
    wrap: list[str] | None = None       # fsdp: the block classes sharded as units (None: the repeated blocks)
    keep_optimizer: bool = False        # fsdp: the optimizer's state stays in the workers
    cluster: str | None = None          # the ipyparallel cluster whose engines are the ranks (None: this machine)
    nprocs: int | None = None           # on a cluster: how many of its engines (None: all)

    @property
    def processes(self) -> bool:
        """Worker processes, one per device (ddp, fsdp), rather than the kernel alone (dp)."""
        return self.strategy != "dp"

    @property
    def world_size(self) -> int:
        return len(self.devices)


def _split(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def make_plan(*, devices: str | None = None, nprocs: int | None = None, strategy: str | None = None,
              models: str | None = None, backend: str | None = None, timeout: float | None = None,
              all_output: bool = False, seed: int | None = None, static_graph: bool = False,
              find_unused: bool = False, bucket_mb: float | None = None, cluster: str | None = None,
              oversubscribe: bool = False, grad_dtype: str | None = None,
              compile: str | None = None, launch: bool = False, wrap: str | None = None,
              keep_optimizer: bool = False, gpus=None) -> Plan:
    """Check the options against the machine; returns a :class:`Plan` or raises ``UsageError``.

    ``gpus`` (a list of :class:`gpumagic.devices.Gpu`) defaults to the visible ones.
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
    strategy = (strategy or "ddp").lower()
    backend = _check_options(strategy, nprocs, timeout, backend, bucket_mb, len(gpus))
    _check_fsdp_options(strategy, wrap, keep_optimizer, static_graph=static_graph, find_unused=find_unused,
                        bucket_mb=bucket_mb, grad_dtype=grad_dtype, compile=compile, launch=launch)
    check_seed(seed)
    grad_dtype = _check_grad_dtype(grad_dtype, strategy)
    compile_mode = _check_compile(compile, strategy)
    if cluster is not None:
        _check_cluster_options(cluster, strategy, devices, oversubscribe)
        return Plan(strategy, [], backend, float(timeout or 1800.0), _split(models) or None, all_output, seed,
                    static_graph, find_unused, bucket_mb, [], grad_dtype, compile_mode, bool(launch),
                    cluster=cluster, nprocs=nprocs)
    notes: list[str] = []
    listed = _listed_devices(devices, gpus)
    chosen = _choose_devices(listed, nprocs, strategy, [g.device for g in gpus], notes)
    if strategy != "dp" and chosen[0] == "cpu":
        crowded = check_process_count(len(chosen), oversubscribe)
        if crowded:
            notes.append(crowded)
    if strategy == "dp":
        if launch:
            raise usage_error("--launch runs the cell in worker processes, as torchrun would; --strategy dp runs "
                              "it in the kernel", ["--strategy ddp --launch", "--strategy dp"])
        ignored = [flag for flag, given in (("--timeout", timeout is not None), ("--all-output", all_output),
                                            ("--seed", seed is not None), ("--static-graph", static_graph),
                                            ("--find-unused", find_unused), ("--bucket-mb", bucket_mb is not None),
                                            ("--oversubscribe", oversubscribe)) if given]
        if ignored:
            raise usage_error(f"{', '.join(ignored)} appl{'ies' if len(ignored) == 1 else 'y'} to worker processes "
                              "(--strategy ddp or fsdp); --strategy dp runs the cell in the kernel",
                              ["--strategy ddp " + " ".join(ignored), "--strategy dp"])
        return _dp_plan(chosen, backend, timeout, models, all_output, seed, notes)
    on_gpu = chosen[0] != "cpu"
    backend = _check_backend(backend, on_gpu)
    if on_gpu and len(chosen) == 1:
        notes.append(f"one device ({chosen[0]}): a single worker process, no speed-up")
    plan = Plan(strategy, chosen, backend, float(timeout or 1800.0), _split(models) or None, all_output, seed,
                static_graph, find_unused, bucket_mb, notes, grad_dtype, compile_mode,
                bool(launch), _split(wrap) or None, bool(keep_optimizer))
    if launch:
        check_launch(plan, "--launch")
    return plan


def check_launch(plan: Plan, why: str) -> None:
    """``UsageError`` when launch mode (chosen because of ``why``) cannot honour the plan's options."""
    ours = [flag for flag, given in (("--static-graph", plan.static_graph), ("--find-unused", plan.find_unused),
                                     ("--bucket-mb", plan.bucket_mb is not None),
                                     ("--grad-dtype", plan.grad_dtype != "fp32"), ("--compile", plan.compile))
            if given]
    reason = "with --launch" if why == "--launch" else f"in launch mode ({why})"
    if ours:
        verb = "configures" if len(ours) == 1 else "configure"
        raise usage_error(f"{', '.join(ours)} {verb} gpumagic's DDP wrapper, and {reason} the cell's own code "
                          "distributes: set them there (for example DistributedDataParallel(static_graph=True), "
                          "torch.compile(model)), or drop them", ["--devices", "--nprocs", "--backend", "--timeout",
                                                                   "--all-output", "--seed", "--model"])
    gpus = [d for d in plan.devices if d != "cpu"]
    # (on a cluster each host numbers its own GPUs from LOCAL_RANK 0, as torchrun does)
    if gpus and plan.cluster is None and gpus != [f"cuda:{i}" for i in range(len(gpus))]:
        raise usage_error(f"--devices {','.join(plan.devices)}: {reason}, rank k uses GPU LOCAL_RANK=k as under "
                          "torchrun, so the ranks need cuda:0 to cuda:N-1 in order; to train on other GPUs, start "
                          "the kernel with CUDA_VISIBLE_DEVICES naming them",
                          [f"--nprocs {len(gpus)}", ",".join(f"cuda:{i}" for i in range(len(gpus)))])


def _check_cluster_options(cluster: str, strategy: str, devices, oversubscribe: bool) -> None:
    """On a cluster the engines are the ranks: what this machine's options choose does not apply."""
    if strategy != "ddp":
        raise usage_error(f"--cluster: the engines run --strategy ddp (and launch mode); --strategy {strategy} runs "
                          "on this machine",
                          ["--cluster with --strategy ddp", f"--strategy {strategy} without --cluster"])
    if devices is not None:
        raise usage_error("--cluster: each engine's device is its host's GPU LOCAL_RANK (or the CPU); --devices "
                          "names this machine's", ["--cluster --nprocs N (the first N engines)", "drop --cluster"])
    if oversubscribe:
        raise usage_error("--oversubscribe is about this machine's cores; the cluster places its engines",
                          ["drop --oversubscribe"])
    if not cluster:
        raise usage_error("--cluster: name the cluster", ["--cluster (the one started here)", "--cluster PROFILE"])


def _check_fsdp_options(strategy: str, wrap, keep_optimizer: bool, **ddp_options) -> None:
    """--wrap and --keep-optimizer belong to fsdp; DDP's wrapper options and --launch do not."""
    if strategy != "fsdp":
        given = [flag for flag, value in (("--wrap", wrap), ("--keep-optimizer", keep_optimizer)) if value]
        if given:
            raise usage_error(f"{', '.join(given)} configure(s) the sharding of --strategy fsdp", ["--strategy fsdp"])
        return
    if wrap is not None and not _split(wrap):
        raise usage_error("--wrap is empty: name the model's block classes, comma-separated",
                          ["--wrap TransformerEncoderLayer", "drop --wrap (the repeated blocks are found)"])
    ours = [f"--{name.replace('_', '-')}" for name, value in ddp_options.items()
            if value and not (name == "grad_dtype" and str(value).lower() == "fp32")]
    if ours:
        why = ("--launch runs the cell's own distribution, not gpumagic's FSDP" if "--launch" in ours
               else "they configure the DDP wrapper, which --strategy fsdp does not use")
        raise usage_error(f"{', '.join(ours)} with --strategy fsdp: {why}",
                          ["--strategy fsdp --wrap CLASS", "--strategy fsdp --keep-optimizer", "--strategy ddp"])


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _check_compile(mode: str | None, strategy: str) -> str | None:
    if mode is None:
        return None
    if mode not in COMPILE_MODES:
        raise usage_error(f"--compile {mode!r} is not a torch.compile mode", COMPILE_MODES)
    if strategy != "ddp":
        raise usage_error("--compile compiles the models in the worker processes: it needs --strategy ddp",
                          ["--strategy ddp"])
    return mode


def _check_grad_dtype(grad_dtype: str | None, strategy: str) -> str:
    from .wrapping import GRAD_DTYPES
    grad_dtype = (grad_dtype or "fp32").lower()
    if grad_dtype not in GRAD_DTYPES:
        raise usage_error(f"--grad-dtype {grad_dtype!r} is not a gradient dtype", GRAD_DTYPES)
    if grad_dtype != "fp32" and strategy != "ddp":
        raise usage_error(f"--grad-dtype {grad_dtype} compresses DDP's all-reduce: it needs --strategy ddp",
                          ["--strategy ddp"])
    return grad_dtype


def _check_options(strategy, nprocs, timeout, backend, bucket_mb, gpu_count: int) -> str | None:
    """Options that are wrong whatever the machine; returns the backend, lower-cased."""
    if strategy not in STRATEGIES:
        raise usage_error(f"--strategy {strategy!r} is not a strategy", STRATEGIES)
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
    if backend is not None:
        backend = backend.lower()
        if backend not in BACKENDS:
            raise usage_error(f"--backend {backend!r} is not a torch.distributed backend here", BACKENDS)
    if bucket_mb is not None and not (math.isfinite(bucket_mb) and bucket_mb > 0):
        raise usage_error(f"--bucket-mb {bucket_mb}: must be a positive, finite number of MB",
                          ["--bucket-mb 25 (default)", "--bucket-mb 100"])
    if bucket_mb is not None and bucket_mb > MAX_BUCKET_MB:
        # (DDP takes it in bytes as a C++ integer, which a larger one overflows)
        raise usage_error(f"--bucket-mb {bucket_mb:g}: at most {MAX_BUCKET_MB} MB (1 TiB); a bucket larger "
                          "than the model holds the whole model", ["--bucket-mb 25 (default)",
                                                                   f"--bucket-mb {MAX_BUCKET_MB}"])
    return backend


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


def _choose_devices(listed: list[str], nprocs, strategy: str, gpu_names: list[str], notes: list[str]) -> list[str]:
    """One device per rank, from ``--devices``, ``--nprocs`` and what the machine has."""
    if listed and listed == ["cpu"] * len(listed):
        count = nprocs if nprocs is not None else max(len(listed), 1 if strategy == "dp" else CPU_DEFAULT_NPROCS)
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
    if strategy != "dp":
        notes.append(f"no GPU visible: {CPU_DEFAULT_NPROCS} CPU processes (gloo); --nprocs N for another count")
        return ["cpu"] * CPU_DEFAULT_NPROCS
    return ["cpu"]


def _dp_plan(chosen, backend, timeout, models, all_output, seed, notes) -> Plan:
    if backend is not None:
        raise usage_error("--backend applies to --strategy ddp (worker processes); dp runs in the kernel",
                          ["--strategy ddp --backend " + backend])
    if chosen[0] == "cpu":
        if len(chosen) > 1:
            notes.append("--strategy dp on the CPU runs on one device: the cell runs as is, without splitting")
        chosen = ["cpu"]
        notes.append("--strategy dp on cpu: one device, so each call of the model runs whole (no parallelism)")
    elif len(chosen) == 1:
        notes.append(f"--strategy dp with one device ({chosen[0]}): each call runs whole on it")
    return Plan("dp", chosen, None, timeout or 1800.0, _split(models) or None, all_output, seed, notes=notes)


def _check_backend(backend: str | None, on_gpu: bool) -> str:
    import torch.distributed as dist
    if not dist.is_available():
        raise usage_error("torch.distributed is not available in this torch build; use --strategy dp",
                          ["--strategy dp"])
    if backend is None:
        backend = "nccl" if on_gpu else "gloo"
    if backend == "nccl":
        if not on_gpu:
            raise usage_error("--backend nccl needs GPUs, and the ranks here are on the CPU", ["gloo"])
        if not dist.is_nccl_available():
            raise usage_error("--backend nccl: this torch was built without NCCL", ["gloo"])
    return backend
