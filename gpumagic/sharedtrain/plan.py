"""What a ``%%sharedtrain`` cell will do, decided before anything changes in the notebook.

How many workers, on which device, started how, and which loaders can be
split by sample. Bad input raises ``UsageError`` naming what would work.
"""
from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..errors import UsageError, usage_error
from ..procs import forkserver
from ..procs.cpus import check_process_count, physical_cores, usable_cpus
from ..procs.start import choose_start_method

__all__ = ["check_nprocs", "resolve_device", "held_items", "held_modules", "held_optimizers", "check_trainable",
           "loader_shardable", "choose_method", "FORKSERVER_PRELOAD"]

# What the fork server imports once for every later cell's workers: torch, the worker's side, and
# what a first optimizer call imports.
FORKSERVER_PRELOAD = ("gpumagic.procs.worker", "gpumagic.sharedtrain.worker", "torch._dynamo")


def check_nprocs(nprocs, oversubscribe: bool = False) -> tuple[int, str | None]:
    """``(nprocs, warning)``: one worker per physical core by default; a warning above the core count,
    and ``UsageError`` above what the machine has room for (unless ``oversubscribe``)."""
    if nprocs is None:
        return physical_cores(), None
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise usage_error(f"--nprocs must be a positive number of processes, not {nprocs!r}",
                          sorted({1, physical_cores(), usable_cpus()}))
    return nprocs, check_process_count(nprocs, oversubscribe)


def _hogwild_devices() -> list[str]:
    from ..devices import available_devices
    return [d for d in available_devices() if d == "cpu" or d.startswith("cuda")]


def resolve_device(spec, modules: dict) -> tuple[str, bool]:
    """The device the shared model lives on, and whether it has to move there."""
    from ..devices import parse_device
    tensors = [t for m in modules.values() for t in itertools.chain(m.parameters(), m.buffers())]
    here = sorted({_device_name(t.device) for t in tensors})
    if spec is not None:
        try:
            device = parse_device(spec)
        except UsageError as exc:  # name the devices Hogwild can use, not every device
            raise usage_error(str(exc).split("; valid choices")[0], _hogwild_devices()) from None
        if device != "cpu" and not device.startswith("cuda"):
            raise usage_error(f"--device {device}: Hogwild shares memory on the CPU or a CUDA GPU",
                              _hogwild_devices())
        usable = _hogwild_devices()
        if device not in usable:   # a GPU NVML sees that a torch built without CUDA cannot use
            import torch
            raise usage_error(f"--device {device} is not usable by this torch ({torch.__version__}, "
                              "CUDA not built)", usable)
        return device, here != [device]
    if not here:
        return "cpu", False
    if len(here) > 1:
        raise usage_error(f"the model's tensors are on several devices ({', '.join(here)}); "
                          "choose one with --device", _hogwild_devices())
    device = here[0]
    if device != "cpu" and not device.startswith("cuda"):
        raise usage_error(f"the model is on {device}; Hogwild shares memory on the CPU or a CUDA GPU, "
                          "choose one with --device", _hogwild_devices())
    return device, False


def held_items(ns: dict, used: list[str], kind: type) -> dict:
    """Objects of ``kind`` the cell reaches in a notebook list, tuple or dict, by the expression naming each
    (``nets['g']``): ``{expression: (name, key)}``, each object once."""
    found: dict = {}
    seen: list = []
    for name in used:
        value = ns.get(name)
        items = value.items() if isinstance(value, dict) else \
            enumerate(value) if isinstance(value, (list, tuple)) else ()
        for key, item in items:
            if isinstance(item, kind) and all(item is not other for other in seen):
                seen.append(item)
                found[f"{name}[{key!r}]"] = (name, key)
    return found


def held_modules(ns: dict, used: list[str]) -> dict:
    """Modules the cell reaches in a notebook list, tuple or dict (``nets["g"]``), by the expression naming
    each: shared in place like a module bound to a name."""
    return {expr: ns[name][key] for expr, (name, key) in held_items(ns, used, torch.nn.Module).items()}


def held_optimizers(ns: dict, used: list[str], modules: dict, named: dict) -> dict:
    """Optimizers of ``modules``' parameters the cell reaches in a notebook list, tuple or dict
    (``opts['g']``), by the expression naming each; those in ``named`` (bound to a name) left out."""
    params = {id(p) for m in modules.values() for p in m.parameters()}
    found = {}
    for expr, (name, key) in held_items(ns, used, torch.optim.Optimizer).items():
        optimizer = ns[name][key]
        if all(optimizer is not other for other in named.values()) and \
                any(id(p) in params for g in optimizer.param_groups for p in g["params"]):
            found[expr] = optimizer
    return found


def _holds_tensors(module: torch.nn.Module) -> bool:
    return any(True for _ in itertools.chain(module.parameters(), module.buffers()))


def check_trainable(modules: dict, ns: dict, assigned) -> None:
    """Refuse a cell whose notebook modules hold no weights (a loss function, an activation): nothing
    would be shared, and a model the cell builds itself is each worker's own and ends with it."""
    if any(_holds_tensors(m) for m in modules.values()):
        return
    models = sorted(n for n, v in ns.items()
                    if isinstance(v, torch.nn.Module) and not n.startswith("_") and _holds_tensors(v))
    rebound = [n for n in models if n in assigned]
    why = (f"the cell binds {', '.join(rebound)} itself, so each worker would train a new one of its own, "
           "gone with it" if rebound else "a model the cell builds itself is each worker's own, gone with it")
    raise usage_error(f"the notebook modules the cell uses ({', '.join(modules)}) have no weights, so nothing "
                      f"would be shared or trained; {why}: build the model in an earlier cell and train that "
                      "one (or name it with --model NAME)", models)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def loader_shardable(loader: DataLoader) -> str | None:
    """``None`` when ``loader`` can be sharded by sample, else the reason it cannot."""
    if isinstance(loader.dataset, IterableDataset):
        return "it reads an IterableDataset"
    if loader.batch_sampler is None:
        return "it has batch_size=None"
    try:
        len(loader.batch_sampler)  # type: ignore[arg-type]
    except TypeError:
        return "its sampler has no length"
    return None


def choose_method(requested: str | None, device: str, nprocs: int) -> tuple[str, str, str | None]:
    """``(method, reason, fork_server)``: how workers start, and when to start the fork server.

    Where the fork server would be best but is not running yet, this cell's
    workers spawn (sooner than waiting for the server to import torch) and
    ``fork_server`` says to start it ``"now"`` (a core is free for it) or
    ``"after"`` the cell; otherwise it is None.
    """
    from ..devices import torch_cuda_initialized
    method, reason = choose_start_method(requested, device)
    if method == "fork" and requested == "fork" and torch_cuda_initialized():
        reason = "requested; CUDA is initialised in this kernel, so workers must not touch CUDA"
    if method != "forkserver" or requested is not None or forkserver.running():
        return method, reason, None
    reason += "; it is not running yet, so this cell's workers start with spawn meanwhile"
    return "spawn", reason, "now" if usable_cpus() > nprocs else "after"
