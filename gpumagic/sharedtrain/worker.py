"""Inside a ``%%sharedtrain`` worker: the cell as the body of its training function.

:func:`train` is the task each worker runs (through the :mod:`gpumagic.procs.worker`
loop): it takes the notebook values (inherited under fork, unpacked from
:mod:`gpumagic.procs.wire` otherwise, the model's tensors shared), splits the
notebook's DataLoaders by sample so workers see different samples, seeds the
worker with ``seed + rank``, gives the cell ``rank``, ``world_size`` and
``report``, and runs it. A :class:`Channel` sends step counts and reports to
the kernel in batches.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import builtins
import gc
import numbers
import os
import sys
import time
from types import CodeType

import torch
from torch.utils.data import DataLoader

from ..cell.main_module import main_is_cell
from ..cell.module_settings import module_settings
from ..cell.rewrite.workers import bind_placement
from ..cell.trees import room_for, shipped
from ..memory.oom import reporting_out_of_memory
from ..procs import torch_settings
from ..procs.compile_settings import apply_compile_settings
from ..procs.display_relay import relay_in
from ..procs.loaders import shard_loader
from ..procs.relays import rank_relays
from ..procs.seeding import seed_all
from .changes import changed_names, snapshot
from .sharing import match_optimizer_devices, private_state

__all__ = ["train", "TASK", "Channel", "leave_kernels_loader_workers"]

TASK = "gpumagic.sharedtrain.worker:train"
FLUSH_INTERVAL = 0.5       # seconds between a worker's messages to the kernel
_READ_LATER = ("cuda",)    # devices whose reported tensors are read when sent, not when reported


class Channel:
    """A worker's line to the kernel: counters and reports, sent in batches through ``send``."""

    def __init__(self, send, t0: float):
        self._send, self.t0 = send, t0
        self.batches = self.optimizer_steps = self.samples = self.reports = 0
        self.counting = False
        self.first: float | None = None
        self.buffer: list = []
        self.last_flush = 0.0

    @property
    def steps(self) -> int:
        """Optimizer steps taken; where the cell steps no optimizer (updates by hand), training batches."""
        return self.optimizer_steps or self.batches

    def step(self, batch) -> None:
        """A batch from a notebook loader."""
        if not torch.is_grad_enabled():
            return   # an evaluation pass: no training step
        self.batches += 1
        self.samples += _batch_len(batch)
        self.counting = True   # (updates by hand count by the batches, as :attr:`steps` says)
        self._stepped()

    def optimizer_step(self, *args) -> None:
        """Any optimizer's step (a global hook: the cell's own optimizers count too)."""
        self.optimizer_steps += 1
        self.counting = True
        self._stepped()

    def _stepped(self) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now - self.t0
            self.flush(now)
        elif now - self.last_flush >= FLUSH_INTERVAL:
            self.flush(now)

    def report(self, step=None, **values) -> None:
        """Send ``values`` (numbers, strings, lists of them, 0-d tensors) to the notebook."""
        entry = {k: _plain(k, v, defer=True) for k, v in values.items()}
        self.reports += 1
        now = time.monotonic()
        if step is None:
            step = self.steps if self.counting else self.reports
        self.buffer.append({"step": _plain("step", step), "time": now - self.t0, **entry})
        if self.first is None and not self.counting:
            self.first = now - self.t0
        if now - self.last_flush >= FLUSH_INTERVAL:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.last_flush = now
        entries, self.buffer = self.buffer, []
        _resolve(entries)
        steps = self.steps if self.counting else self.reports
        self._send(("tick", steps, self.samples, self.first, now - self.t0, entries, self.optimizer_steps))


def _plain(key, value, defer: bool = False):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if defer and value.device.type in _READ_LATER:
            # Reading a GPU value waits for the GPU: a copy taken now (queued, not waited for) is
            # read when the reports are sent, so report(loss=loss) every step does not stall each step.
            return value.clone()
        return value.item() if value.numel() == 1 else value.cpu().tolist()
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalars and arrays
        return value.item() if getattr(value, "size", 2) == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(key, v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(key, v) for k, v in value.items()}
    if isinstance(value, numbers.Number):
        return float(value)  # type: ignore[arg-type]
    raise TypeError(f"report({key}=...) takes numbers, strings, tensors or lists of them, "
                    f"not {type(value).__name__}")


def _resolve(entries: list) -> None:
    """Turn the GPU tensors ``report()`` kept into numbers and lists, in place."""
    for entry in entries:
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                entry[key] = _plain(key, value)


def _batch_len(batch) -> int:
    for _ in range(4):
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() else 1
        if isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        elif isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        else:
            break
    try:
        return len(batch)
    except TypeError:
        return 1


class _CountingLoader(DataLoader):
    """A DataLoader that tells its worker's channel about every batch it yields."""

    _channel: Channel | None = None

    def __iter__(self):
        channel = self._channel
        for batch in super().__iter__():
            if channel is not None:
                channel.step(batch)
            yield batch


def _prepare_loader(loader, rank: int, world: int, seed: int, reason: str | None, channel: Channel):
    if reason is None:
        # an evaluation pass (gradients off) reads the whole loader: its accuracy is over every sample
        loader = shard_loader(loader, rank, world, split="dataset", seed=seed, whole_without_grad=True)
    else:
        import copy
        loader = copy.copy(loader)
    try:
        loader.__class__ = _CountingLoader
    except TypeError:
        return loader  # a DataLoader subclass with its own layout: no step counts, training is unaffected
    loader._channel = channel
    channel.counting = True
    return loader


def _no_shell():
    """``get_ipython()`` in a worker: None, as in any process that is not IPython (the kernel refuses
    magics and !commands in the cell before it starts)."""
    return None


def leave_kernels_loader_workers() -> None:
    """Under fork, let the copies of the notebook's DataLoader iterators drop without stopping their workers.

    A forked worker holds copies of every iterator the notebook keeps (a loader's persistent
    workers, ``dataiter = iter(loader)``). Their workers are the kernel's children, reached through
    queues and an event shared with it: when a copy is dropped here (the cell rebinds the name, the
    namespace is cleared), torch's shutdown would stop them under the notebook's loader, whose next
    pass then fails. An iterator whose workers another process started is marked shut down instead.
    """
    from torch.utils.data import dataloader
    cls = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    if cls is None or not hasattr(cls, "_shutdown_workers"):   # (a torch without it: nothing to leave)
        return
    if getattr(cls._shutdown_workers, "_gpumagic_leaves_kernels", False):
        return
    own_shutdown = cls._shutdown_workers
    pid = os.getpid()

    def _shutdown_workers(self) -> None:
        if any(getattr(w, "_parent_pid", pid) != pid for w in getattr(self, "_workers", ())):
            self._shutdown = True   # the kernel's workers: not this process's to stop
            return
        own_shutdown(self)

    _shutdown_workers._gpumagic_leaves_kernels = True  # type: ignore[attr-defined]
    cls._shutdown_workers = _shutdown_workers


def _namespace(meta: dict, data, stand_ins: dict) -> tuple[dict, CodeType]:
    """The cell's namespace and code: inherited under fork, unpacked otherwise; the notebook's loggers
    replaced by ``stand_ins``, which send the calls on them to the kernel."""
    if meta["method"] == "fork":
        leave_kernels_loader_workers()
        ns = meta["namespace"]
        for name, token in meta.get("relayed", {}).items():
            ns[name] = stand_ins[token]
        relay_in(ns)   # the notebook's display() and clear_output() reach the cell
        return ns, meta["code"]
    from ..procs.wire import LARGE_TENSOR_BYTES, unpack_namespace
    # Large notebook tensors (datasets) stay mapped: one copy for every worker, not one in each.
    ns, _ = unpack_namespace(meta["header"], data, device=meta["device"], views_from=LARGE_TENSOR_BYTES,
                             shared=meta["shared"], stand_ins=stand_ins)
    ns.update({"__name__": "__main__", "__builtins__": builtins})
    tree = shipped(meta["tree"])
    with room_for(tree):   # (a deep cell, which the kernel took, compiles here too)
        return ns, compile(tree, meta["filename"], "exec")


def _named(ns: dict, name: str, held: dict):
    """What ``name`` stands for in the cell: a notebook name, or an item of a notebook list or dict
    (``opts['g']``, found through ``held``); None where the cell's namespace has no such value."""
    if name not in held:
        return ns.get(name)
    container, key = held[name]
    try:
        return ns[container][key]
    except (KeyError, IndexError, TypeError):
        return None


def train(ctx, meta: dict, data) -> None:
    """Run the cell as worker ``ctx.rank`` of ``ctx.world_size`` (the task of every Hogwild worker)."""
    rank, world = ctx.rank, ctx.world_size
    channel = Channel(ctx.send, meta["t0"])
    relays = rank_relays(meta.get("relays") or {}, lambda msg: ctx.send(("relay", msg)), active=True)
    ns, code = _namespace(meta, data, relays)
    ns["get_ipython"] = _no_shell   # (under fork the notebook's own is the kernel's shell, not ours to use)
    torch_settings.apply(meta.get("torch_settings") or {}, device=meta["device"])   # the kernel's default dtype...
    apply_compile_settings(meta.get("compile_settings") or {})   # ...and torch._dynamo.config settings
    del data
    seed_all(meta["seed"] + rank)
    on_gpu = meta["device"].startswith("cuda")
    for name, reason in meta["loaders"].items():
        if isinstance(ns.get(name), DataLoader):
            ns[name] = _prepare_loader(ns[name], rank, world, meta["seed"], reason, channel)
    held = meta.get("held") or {}
    for name in meta["optimizers"]:
        optimizer = _named(ns, name, held)
        if isinstance(optimizer, torch.optim.Optimizer):
            match_optimizer_devices(optimizer)
            if on_gpu:
                private_state(optimizer)  # CUDA tensors always arrive shared; an optimizer's state must not
    ns["rank"], ns["world_size"], ns["report"] = rank, world, channel.report
    bind_placement(ns, meta.get("placement"), meta["device"])   # the cell rewritten for CPU workers
    if meta["set_device_name"]:
        ns["device"] = torch.device(meta["device"])
    from torch.optim.optimizer import register_optimizer_step_post_hook
    hook = register_optimizer_step_post_hook(channel.optimizer_step)
    before = snapshot(ns, meta.get("watched") or [])
    try:
        # the notebook's classes pickle as __main__.X (torch.save(model, PATH)); an out-of-memory error
        # leaves with this worker's report
        with main_is_cell(ns), reporting_out_of_memory(ns, rank, world):
            exec(code, ns)
        if on_gpu:
            torch.cuda.synchronize()
        changed = changed_names(ns, before)
        if changed:   # (this worker's copies: the kernel says the notebook's are as they were)
            ctx.send(("changed", changed))
        if rank == 0:   # what the cell set on the model besides its shared tensors (model.eval())
            ctx.send(("settings", {n: module_settings(_named(ns, n, held)) for n in meta.get("modules", [])
                                   if isinstance(_named(ns, n, held), torch.nn.Module)}))
    finally:
        hook.remove()
        channel.flush()
        # Let go of the namespace (and the CUDA IPC handles of shared tensors) before saying done.
        # torch.compile put globals into it with hooks that delete them when its code dies: cleared
        # first, each hook printed a KeyError into the cell, so its code goes first.
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            dynamo.reset()
        ns.clear()
        meta.clear()
        del ns, code
        gc.collect()
    ctx.send(("done",))
