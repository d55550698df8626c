"""Hogwild: several processes train one model in shared memory, without locks.

:func:`train_shared` runs a cell as the body of each worker's training
function, as PyTorch's ``mnist_hogwild`` example does by hand:

* the model's parameters and buffers are moved into shared memory once
  (in place, so the notebook's ``model`` *is* the trained model afterwards);
* every worker runs the cell with ``rank``, ``world_size`` and ``report``
  defined, and with one thread (``torch.set_num_threads(1)``): the
  parallelism is the processes, so threads inside them would only
  oversubscribe the cores;
* DataLoaders the cell reads from the notebook (itself, or through the
  notebook functions it calls) are split by sample, so workers see
  different samples;
* tensors already in shared memory (or on a GPU) stay shared; everything
  else a worker sees is its own copy. That one rule decides optimizers: a
  notebook optimizer becomes a per-worker copy (same class, hyperparameters
  and state as in the notebook) stepping the shared parameters, and one
  whose state tensors were put in shared memory (``SharedAdam``-style) is
  shared. Per-worker copies are Hogwild's usual choice: Adam's moments
  updated by several processes without locks would be a race on every
  element, and each worker's moments describe its own gradient stream.

Workers are gpumagic's process layer (:mod:`gpumagic.procs`): they start with
``fork`` where that is safe, otherwise from the kept fork server or with
``spawn`` (:func:`.plan.choose_method`). Fresh workers get the notebook values
through :mod:`gpumagic.procs.wire`: the shared tensors by torch's reducers,
the others' bytes once in anonymous shared memory that every worker maps (a
notebook tensor over 1 MiB, a dataset, is mapped rather than copied into
each; the notebook's own tensor is never touched). What runs in a worker is
:mod:`.worker`.

In a notebook the magic is the way in::

    %%sharedtrain --nprocs 4
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        report(loss=loss)

From plain Python::

    result = train_shared(namespace, cell_source, nprocs=4)
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ..cell.compile import compile_cell, compile_plain, is_empty, refuse_shell_calls
from ..cell.definitions import define_in_notebook, definitions
from ..cell.module_settings import apply_settings
from ..cell.names import names_assigned, names_tree, notebook_names, used_names
from ..cell.rewrite.workers import rewrite_for_cpu_workers
from ..cell.trees import Flat, room_for
from ..cell.values import find_loaders, find_modules, find_optimizers, instead_of_sending
from ..cell.with_targets import quiet_targets
from ..errors import usage_error
from ..procs import forkserver, torch_settings
from ..procs.compile_settings import notebook_compile_settings
from ..procs.failures import primary_error
from ..procs.follow_kernel import where_now
from ..procs.group import WorkerGroup
from ..procs.output import RankOutput
from ..procs.relays import Relays, is_relayed
from ..procs.seeding import check_seed, draw_seed
from ..procs.start import import_lazily_imported
from ..procs.teardown import no_interrupts
from ..procs.worker import WorkerConfig
from .changes import watched_names
from .plan import (
    FORKSERVER_PRELOAD,
    check_nprocs,
    check_trainable,
    choose_method,
    held_items,
    held_modules,
    held_optimizers,
    loader_shardable,
    resolve_device,
)
from .results import History, SharedTrainResult, WorkerStats
from .sharing import match_optimizer_devices, share_modules, share_optimizer_state, travels_shared
from .worker import TASK

logger = logging.getLogger(__name__)

__all__ = ["train_shared"]

PROGRESS_INTERVAL = 0.5    # seconds between progress callbacks in the kernel
EXIT_GRACE = 10.0          # seconds a worker that finished the cell may take to exit


class _Run:
    """The kernel's side of one run: turns workers' messages into the result's counters and history."""

    def __init__(self, result: SharedTrainResult, progress, output, relays: Relays | None = None):
        self.result = result
        self.relays = relays   # the notebook's loggers, which take the workers' calls
        self.progress = progress
        self.own_output = RankOutput(prefix=True) if output is None else None
        self.output = output or self.own_output.write  # type: ignore[union-attr]
        self.last_progress = 0.0
        self.settings: dict = {}   # rank 0's module settings after the cell (eval(), attributes)
        self.changed: dict = {}    # notebook values the workers changed in place, each its own copy

    def on_message(self, rank: int, message) -> None:
        stats = self.result.workers[rank]
        if message[0] == "tick":
            _, steps, samples, first, now, entries, optimizer_steps = message
            stats.steps, stats.samples, stats.last_time = steps, samples, now
            stats.optimizer_steps = optimizer_steps
            if first is not None:
                stats.first_step = first
            if stats.state == "starting":
                stats.state = "running"
            if entries:
                stats.reports += len(entries)
                stats.last.update({k: v for k, v in entries[-1].items() if k not in ("step", "time")})
                self.result.history.extend(rank, entries)
        elif message[0] == "settings":
            self.settings = message[1]
        elif message[0] == "changed":
            self.changed.update(dict.fromkeys(message[1]))
        elif message[0] == "relay" and self.relays is not None:
            said = self.relays.replay(message[1]) if message[1].get("kind") == "relay" else message[1]["text"]
            if said and said not in self.result.notes:
                self.result.notes.append(said)
        elif message[0] == "done":
            stats.state = "done"

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.progress is not None and (force or now - self.last_progress >= PROGRESS_INTERVAL):
            self.last_progress = now
            try:
                self.progress(self.result)
            except Exception:  # a display problem must not stop training
                logger.debug("the progress display failed", exc_info=True)


def _shell_and_ns(target):
    if isinstance(target, dict):
        return None, target
    ns = getattr(target, "user_ns", None)
    if ns is None:
        raise TypeError("train_shared needs an IPython shell or a namespace dict")
    return target, ns


def _loaders(probe, ns: dict, notes: list[str]) -> dict:
    """The notebook DataLoaders the cell uses: name -> None (split by sample) or why it cannot be."""
    loaders = {name: loader_shardable(loader) for name, loader in find_loaders(probe, ns).items()}
    for name, why in loaders.items():
        if why is not None:
            notes.append(f"{name!r} cannot be sharded ({why}): every worker reads all of it, with its random "
                         "generators seeded per rank (seed + rank)")
    return loaders


def _share(modules: dict, optimizers: dict, device_name: str, move: bool) -> tuple[str, list[str]]:
    """Move the model (if asked) and put it in shared memory: the notebook changes from here on."""
    notes: list[str] = []
    if move:
        for module in modules.values():
            module.to(torch.device(device_name))
        for optimizer in optimizers.values():
            match_optimizer_devices(optimizer)
    strategy = share_modules(modules, notes)
    for name, optimizer in optimizers.items():
        notes.append(share_optimizer_state(name, optimizer, on_gpu=device_name.startswith("cuda")))
    return strategy, notes


@contextlib.contextmanager
def _without_iterators(loaders: list):
    """The notebook's ``loaders`` without their running iterators (persistent workers cannot be pickled)."""
    kept = [(loader, loader._iterator) for loader in loaders]
    try:
        for loader, _ in kept:
            loader._iterator = None
        yield
    finally:
        for loader, iterator in kept:
            loader._iterator = iterator


def _ship(method: str, ns: dict, used: list, loaders: dict, compiled, relays: Relays):
    """What the workers get: the namespace itself under fork, else the packed values; the notebook's
    loggers (a SummaryWriter) stay in the kernel, ``relays`` taking the workers' calls on them.

    Returns ``(meta, data, outgoing)``; ``outgoing`` (the shared memory, or None) is closed
    by the caller once every worker has started.
    """
    if method == "fork":
        # (a forked copy of a writer has no writing thread: its calls would wait for ever)
        relayed = {n: relays.stand_in_for(ns[n]) for n in used if is_relayed(ns[n])}
        return {"namespace": ns, "code": compile(compiled.tree, compiled.filename, "exec"),
                "relayed": relayed, "relays": relays.found}, None, None
    from ..procs.bulk import Outgoing
    from ..procs.wire import Unshippable, pack_namespace
    values = {n: ns[n] for n in used}
    for name in loaders:
        # Loaders travel without a running iterator (persistent workers cannot be pickled).
        values[name] = copy.copy(ns[name])
        values[name]._iterator = None
    outgoing = Outgoing(shared=True)
    try:
        # A notebook function that reads a loader carries the notebook's own object: it too travels
        # without its iterator, which is given back as soon as the values are packed.
        with _without_iterators([ns[name] for name in loaders]):
            packed, _ = pack_namespace(values, ns, droppable=set(names_assigned(compiled.tree)),
                                       share=travels_shared, fingerprint=False, scratch=outgoing,
                                       sources={compiled.filename: compiled.source}, stand_in_for=relays.stand_in_for)
    except Unshippable as exc:
        outgoing.close()
        name, value, error = exc.problems[0]
        if isinstance(value, torch.nn.Module):   # a copy made in each worker would share nothing
            advice = "use --start-method fork, whose workers share the notebook's module"
        else:
            advice = f"{instead_of_sending(name, value) or 'create it inside the cell'}, or use --start-method fork"
        raise usage_error(f"{name!r} ({type(value).__name__}) cannot be sent to spawned workers "
                          f"({type(error).__name__}: {error}); {advice}") from None
    # (Flat: a deep cell's tree pickles without recursion, and unpickles as the tree)
    meta = {"header": packed.header, "shared": packed.shared, "tree": Flat(compiled.tree),
            "filename": compiled.filename, "relays": relays.found}
    return meta, outgoing.handle(packed.data()), outgoing


def train_shared(target, cell: str, *, nprocs: int | None = None, model: str | None = None,
                 device: str | None = None, start_method: str | None = None, seed: int | None = None,
                 header: str = "%%sharedtrain", progress: Callable | None = None,
                 output: Callable | None = None, oversubscribe: bool = False) -> SharedTrainResult:
    """Run ``cell`` in ``nprocs`` processes that train the notebook's model in shared memory.

    Parameters
    ----------
    target : InteractiveShell or dict
        The shell (its ``user_ns`` is the notebook) or a namespace dict.
    cell : str
        The body of each worker's training function; ``rank``, ``world_size``
        and ``report(**values)`` are defined in it.
    nprocs : int, optional
        Worker processes; default one per physical core.
    model : str, optional
        The notebook name of the module to share; default the modules the cell uses.
    device : str, optional
        ``cpu`` or ``cuda:N``; the shared model moves there (CUDA workers use
        CUDA IPC and start from a fork server or with spawn). Default: where the model is.
    start_method : {"fork", "spawn", "forkserver"}, optional
        Default fork where safe, else forkserver on Linux and spawn elsewhere.
    seed : int, optional
        Worker ``rank`` seeds torch, random and numpy with ``seed + rank``;
        loaders shuffle with ``seed``. Default: drawn from the notebook's torch generator.
    progress : callable, optional
        Called with the :class:`~.results.SharedTrainResult` about twice a second while workers run.
    output : callable, optional
        ``output(rank, stream, text)`` for what workers print; default prints
        it here with a ``[rank r]`` prefix.
    oversubscribe : bool
        Start ``nprocs`` workers even above what the machine has room for.

    Returns
    -------
    SharedTrainResult
        On a worker error or an interrupt the exception (``WorkerError`` or
        ``KeyboardInterrupt``) carries the partial result as ``.result``.

    Examples
    --------
    ::

        result = train_shared(get_ipython(), "for x, y in loader:\\n    ...", nprocs=2)
        result.history.series("loss")
    """
    __tracebackhide__ = True
    import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory reductions

    started = time.monotonic()
    shell, ns = _shell_and_ns(target)
    if is_empty(cell):
        raise usage_error("the cell is empty: write the training loop each worker runs")
    nprocs, crowded = check_nprocs(nprocs, oversubscribe)
    check_seed(seed, offset=nprocs)
    compiled = compile_cell(shell, cell, header=header) if shell is not None else \
        compile_plain(cell, header, label="sharedtrain")
    # (what reads the cell walks its tree recursively: a deep cell needs room; not while workers fork)
    with room_for(compiled.tree):
        ready = _prepare(shell, ns, compiled, _Asked(nprocs, model, device, start_method, seed, crowded, started))
    result = ready.result
    try:
        _run_workers(result, ready.meta, ready.data, ready.outgoing, progress, output, ready.relays)
    finally:
        if ready.fork_server == "after":
            forkserver.start_in_background(list(FORKSERVER_PRELOAD))
    if ready.definable:
        defined, not_defined = define_in_notebook(ns, ready.written, compiled.filename, ready.definable)
        if defined:
            result.notes.append(f"defined in the notebook too, as after a plain cell: {', '.join(defined)}")
        if not_defined:
            result.notes.append(f"not defined in the notebook: {'; '.join(not_defined)}")
    return result


@dataclasses.dataclass
class _Asked:
    """What train_shared was asked for, checked."""
    nprocs: int
    model: str | None
    device: str | None
    start_method: str | None
    seed: int | None
    crowded: str | None
    started: float


@dataclasses.dataclass
class _Prepared:
    """A cell ready for its workers: what they get, and what the kernel does after them."""
    result: SharedTrainResult
    meta: dict
    data: Any
    outgoing: Any
    relays: Relays
    fork_server: str | None
    definable: list
    written: Any   # the tree as the user wrote it: what the kernel defines again


def _definable(tree, assigned: set, notes: list) -> list:
    """The def, class and import statements' names, which run again in the kernel after the workers;
    the other names the cell binds stay in the workers, and a note says so."""
    definable = [n for n in definitions(tree) if n in assigned]
    kept_in_workers = [n for n in names_assigned(tree) if n not in set(quiet_targets(tree)) and n not in definable]
    if kept_in_workers:
        notes.append(f"bound in the workers only, each its own, gone with them: {', '.join(kept_in_workers)}; "
                     "report(name=value) sends values back (sharedtrain.history)")
    return definable


def _prepare(shell, ns: dict, compiled, asked: _Asked) -> _Prepared:
    """What the cell trains and reads, how its workers start, and what they are sent."""
    refuse_shell_calls(compiled.tree, "%%sharedtrain")
    used = notebook_names(used_names(compiled.tree, ns), ns, getattr(shell, "user_ns_hidden", {}))
    probe = names_tree(used)
    model, device, nprocs = asked.model, asked.device, asked.nprocs
    if device is not None:
        resolve_device(device, {})   # a bad --device is said first: the model may be missing only because of it
    modules = find_modules(probe, ns, [model] if model else None, required=False)
    if not modules:   # models kept in a list or dict; where there are none either, the error naming the choices
        modules = held_modules(ns, used) or find_modules(probe, ns)
    check_trainable(modules, ns, set(names_assigned(compiled.tree)))
    unused_model = model if model and model not in used else None
    device_name, move = resolve_device(device, modules)
    method, reason, fork_server = choose_method(asked.start_method, device_name, nprocs)
    if fork_server == "now":
        forkserver.start_in_background(list(FORKSERVER_PRELOAD))
    notes = [asked.crowded] if asked.crowded else []
    if asked.crowded:
        from ..display import note
        note(asked.crowded)
    loaders = _loaders(probe, ns, notes)
    if unused_model:
        read = [n for n in used if isinstance(ns.get(n), torch.nn.Module)]
        notes.append(f"--model {unused_model}: the cell does not use {unused_model}, so nothing trains it"
                     + (f"; what it trains of {', '.join(read)} stays in the workers (--model {read[0]} shares "
                        "it)" if read else ""))
    assigned = set(names_assigned(compiled.tree))
    definable = _definable(compiled.tree, assigned, notes)
    optimizers = find_optimizers(probe, ns, modules)
    optimizers.update(held_optimizers(ns, used, modules, optimizers))   # opts['g'] in a notebook dict
    # where the workers find modules and optimizers kept in a notebook list or dict
    held = {expr: where for kind in (torch.nn.Module, torch.optim.Optimizer)
            for expr, where in held_items(ns, used, kind).items() if expr in modules or expr in optimizers}

    strategy, sharing_notes = _share(modules, optimizers, device_name, move)
    notes += sharing_notes
    seed = draw_seed() if asked.seed is None else int(asked.seed)
    placement = None
    written = compiled.tree   # as the user wrote it: what the kernel defines again
    if device_name == "cpu":   # CPU workers run code written for .cuda() there (the %%ondevice rewrite)
        tree, placement = rewrite_for_cpu_workers(compiled.tree, ns)
        compiled = dataclasses.replace(compiled, tree=tree)
    relays = Relays()
    meta, data, outgoing = _ship(method, ns, used, loaders, compiled, relays)
    meta.update({"method": method, "t0": asked.started, "seed": seed, "device": device_name, "all_output": True,
                 "notebook": getattr(shell, "kernel", None) is not None,   # (tqdm bars as HTML: procs.tqdm_relay)
                 "placement": placement,
                 "set_device_name": device is not None,
                 # (a spawned worker starts with torch's defaults, not the kernel's float64, say)
                 "torch_settings": torch_settings.current(), "compile_settings": notebook_compile_settings(),
                 "loaders": loaders, "optimizers": list(optimizers),
                 "modules": list(modules), "held": held,
                 # what a worker changes in place of these stays in its copy: the kernel says so
                 "watched": watched_names(ns, [n for n in used if n not in modules and n not in optimizers
                                               and n not in loaders and n not in assigned
                                               and not is_relayed(ns[n])])})
    result = SharedTrainResult(modules=modules, nprocs=nprocs, start_method=method, start_reason=reason,
                               device=device_name, seed=seed, sharing_strategy=strategy, history=History(nprocs),
                               workers=[WorkerStats(rank=r) for r in range(nprocs)], notes=notes)
    return _Prepared(result, meta, data, outgoing, relays, fork_server, definable, written)


def _run_workers(result: SharedTrainResult, meta: dict, data, outgoing, progress, output, relays: Relays) -> None:
    """Start the workers, hear from them until each is done, and end them, whatever happens."""
    method, nprocs, started = meta["method"], result.nprocs, meta["t0"]
    configs = [WorkerConfig(rank=r, world_size=nprocs, device=result.device, method=method,
                            parent_pid=os.getpid(), threads=1,
                            environ=dict(os.environ) if method == "forkserver" else None,
                            kernel=where_now() if method == "forkserver" else None)
               for r in range(nprocs)]
    group = WorkerGroup([result.device] * nprocs, name="sharedtrain")
    run = _Run(result, progress, output, relays)
    try:
        server_before = None
        if method == "forkserver":
            import multiprocessing
            server_before = forkserver.prepare(multiprocessing.get_context("forkserver"), list(FORKSERVER_PRELOAD))
        group.start(method, configs, first=[TASK, meta, data])
        for stats, r in zip(result.workers, group.ranks):
            stats.pid = r.pid
        if outgoing is not None:
            outgoing.close()   # every worker has its own descriptor now
            outgoing = None
        if method == "forkserver":
            forkserver.adopt(server_before)
        elif method == "fork":
            import_lazily_imported()
        run.tick(force=True)
        _, errors, _ = group.collect(on_output=run.output, on_message=run.on_message, on_tick=run.tick)
        if errors:
            for rank in errors:
                result.workers[rank].state = "failed"
            raise primary_error(errors)
        for name, settings in run.settings.items():
            apply_settings(result.modules[name], settings)
        if run.changed:
            result.notes.append(f"changed in the workers only, each in its own copy (the notebook's "
                                f"{'is' if len(run.changed) == 1 else 'are'} as before the cell): "
                                f"{', '.join(sorted(run.changed))}; report(name=value) sends values back "
                                "(sharedtrain.history)")
        result.status = "done"
    except KeyboardInterrupt:
        result.status = "interrupted"
        # A fresh one: the notebook need not see where the kernel happened to be waiting.
        interrupt = KeyboardInterrupt()
        interrupt.result = result  # type: ignore[attr-defined]
        raise interrupt from None
    except BaseException as exc:
        result.status = "failed"
        exc.result = result  # type: ignore[attr-defined]
        raise
    finally:
        with no_interrupts():
            _end(group, result, outgoing, run, started)


def _end(group: WorkerGroup, result: SharedTrainResult, outgoing, run: _Run, started: float) -> None:
    for stats, rank in zip(result.workers, group.ranks):
        stats.pid = rank.pid   # also those an interrupt left half-started
        if stats.state in ("starting", "running"):
            stats.state = "stopped"
    codes = group.end(wait=EXIT_GRACE if result.status == "done" else 0.0)
    for code, stats in zip(codes, result.workers):
        if stats.exitcode is None:
            stats.exitcode = code
    if outgoing is not None:
        outgoing.close()
    if result.device.startswith("cuda"):
        torch.cuda.ipc_collect()
    result.seconds = time.monotonic() - started
    if run.own_output is not None:
        run.own_output.flush()
    run.tick(force=True)
