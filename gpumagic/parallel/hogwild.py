"""Hogwild: several processes train one model in shared memory, without locks.

:func:`train_shared` runs a cell as the body of each worker's training
function, as PyTorch's ``mnist_hogwild`` example does by hand:

* the model's parameters and buffers are moved into shared memory once
  (in place, so the notebook's ``model`` *is* the trained model afterwards);
* every worker runs the cell with ``rank``, ``world_size`` and ``report``
  defined, and with one thread (``torch.set_num_threads(1)``): the
  parallelism is the processes, so threads inside them would only
  oversubscribe the cores;
* DataLoaders the cell reads from the notebook are sharded by sample
  (``shard_loader(split="dataset")``), so workers see different samples;
* tensors already in shared memory (or on a GPU) stay shared; everything
  else a worker sees is its own copy. That one rule decides optimizers: a
  notebook optimizer becomes a per-worker copy (same class, hyperparameters
  and state as in the notebook) stepping the shared parameters, and one
  whose state tensors were put in shared memory (``SharedAdam``-style) is
  shared. Per-worker copies are Hogwild's usual choice: Adam's moments
  updated by several processes without locks would be a race on every
  element, and each worker's moments describe its own gradient stream.

Workers start with ``fork`` where that is safe; otherwise, on Linux, from a
fork server that imported torch (and ``torch._dynamo``, which a first
optimizer call imports) once and is kept for later cells, and elsewhere with
``spawn``. The choice is explicit, never the platform default. Spawned and
fork-server workers get the cell as an AST (tracebacks keep the user's line
numbers), notebook values by cloudpickle (notebook classes and functions
travel by value), the kernel's current environment, and shared tensors
through torch's multiprocessing reducers. A notebook tensor over 1 MiB (a
dataset) is copied once into shared memory and mapped by every such worker
instead of being pickled into each; the notebook's own tensor is never
touched. What runs inside a worker is in :mod:`gpumagic.sharedtrain_worker`,
which does not import IPython: a fresh worker's start-up is torch's import
and little else.

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

import ast
import io
import itertools
import linecache
import os
import pickle
import resource
import signal
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.data import DataLoader, IterableDataset

from .. import fresh, workers
from ..cell import compile as cells
from ..errors import UsageError, WorkerError, usage_error
from ..cell.names import find_loaders, find_modules, find_optimizers, names_assigned, names_read
# What runs in the workers lives apart, so a fresh worker imports neither IPython nor this module.
from ..sharedtrain_worker import _FdHandle, _match_optimizer_devices, _signal_group, _Spec, _worker_main
from .. import sharedtrain_worker as _worker_module

__all__ = [
    "train_shared", "SharedTrainResult", "History", "WorkerStats",
    "default_nprocs", "choose_start_method", "fork_unsafe_threads", "plan_sharing",
]

START_METHODS = ("fork", "spawn", "forkserver")
PROGRESS_INTERVAL = 0.5    # seconds between progress callbacks in the kernel
EXIT_GRACE = 10.0          # seconds a worker that finished the cell may take to exit
STOP_GRACE = 2.0           # SIGTERM, then SIGKILL after this long: well inside 5 s

# Threads from these packages only wait on sockets, pipes and timers; a forked
# child never runs their code, so they cannot leave it a held lock it needs.
_SAFE_THREAD_PACKAGES = ("IPython", "ipykernel", "zmq", "jupyter_client", "tornado", "comm",
                         "ipywidgets", "gpumagic", "tqdm", "debugpy", "_pydevd_bundle", "pydevd")
# Notebook names that belong to the shell, not to the user's training code.
_SHELL_NAMES = {"get_ipython", "In", "Out", "exit", "quit", "_ih", "_oh", "_dh"}


# --------------------------------------------------------------------------- results

@dataclass
class WorkerStats:
    """What one worker did: steps, samples, timing (seconds from cell start).

    ``steps`` counts batches taken from the notebook's loaders, or ``report()``
    calls when the cell reads no notebook loader (then ``samples`` is 0).
    """
    rank: int
    pid: int | None = None
    steps: int = 0
    samples: int = 0
    reports: int = 0
    first_step: float | None = None
    last_time: float | None = None
    last: dict = field(default_factory=dict)
    state: str = "starting"   # starting, running, done, failed, stopped
    exitcode: int | None = None

    @property
    def samples_per_s(self) -> float | None:
        if self.first_step is None or self.last_time is None or self.last_time <= self.first_step:
            return None
        return self.samples / (self.last_time - self.first_step)

    @property
    def steps_per_s(self) -> float | None:
        if self.first_step is None or self.last_time is None or self.last_time <= self.first_step:
            return None
        return self.steps / (self.last_time - self.first_step)


class History:
    """The values each worker passed to ``report()``, one list of dicts per rank.

    Every entry has ``step`` (batches the worker had taken from the notebook's
    loaders, or the report's number when the cell uses none; ``report(step=...)``
    sets it), ``time`` (seconds since the cell started) and the reported values.

    In a notebook::

        sharedtrain.history[0][-1]          # rank 0's last report
        sharedtrain.history.series("loss")  # [[(step, loss), ...] per rank]
        pd.DataFrame(sharedtrain.history.rows())
    """

    def __init__(self, world_size: int):
        self._ranks: list[list[dict]] = [[] for _ in range(world_size)]

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    def __getitem__(self, rank: int) -> list[dict]:
        return self._ranks[rank]

    def __len__(self) -> int:
        return len(self._ranks)

    def __iter__(self):
        return iter(self._ranks)

    def extend(self, rank: int, entries: list[dict]) -> None:
        self._ranks[rank].extend(entries)

    def keys(self) -> list[str]:
        """Reported value names, in order of first appearance."""
        seen: dict[str, None] = {}
        for entries in self._ranks:
            for entry in entries:
                for key in entry:
                    if key not in ("step", "time"):
                        seen.setdefault(key, None)
        return list(seen)

    def series(self, key: str, x: str = "step") -> list[list[tuple]]:
        """``[(x, value), ...]`` per rank for the reports that carry ``key``."""
        return [[(e[x], e[key]) for e in entries if key in e] for entries in self._ranks]

    def last(self, key: str):
        """Each rank's last reported ``key`` (``None`` where it never reported it)."""
        out = []
        for entries in self._ranks:
            values = [e[key] for e in entries if key in e]
            out.append(values[-1] if values else None)
        return out

    def rows(self) -> list[dict]:
        """All reports as flat dicts with ``rank``, ordered by time (for a DataFrame)."""
        rows = [{"rank": r, **e} for r, entries in enumerate(self._ranks) for e in entries]
        return sorted(rows, key=lambda row: row["time"])

    def __repr__(self) -> str:
        counts = ", ".join(str(len(e)) for e in self._ranks)
        keys = ", ".join(self.keys()) or "none"
        return f"History({self.world_size} workers; reports per rank: {counts}; keys: {keys})"

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))


@dataclass
class SharedTrainResult:
    """What a ``%%sharedtrain`` run did; the notebook gets it as ``sharedtrain``.

    ``modules`` are the notebook's own objects, trained in place; ``history``
    holds what the workers reported; ``workers`` has one :class:`WorkerStats`
    per rank. ``status`` is ``"done"``, ``"failed"`` or ``"interrupted"``.
    """
    modules: dict
    nprocs: int
    start_method: str
    start_reason: str
    device: str
    seed: int
    sharing_strategy: str
    history: History
    workers: list
    seconds: float = 0.0
    status: str = "running"
    notes: list = field(default_factory=list)

    @property
    def model(self):
        """The trained module (the first one with parameters when the cell used several)."""
        for module in self.modules.values():
            if any(True for _ in module.parameters()):
                return module
        return next(iter(self.modules.values()))

    @property
    def model_name(self) -> str:
        for name, module in self.modules.items():
            if module is self.model:
                return name
        return ""

    @property
    def steps(self) -> int:
        return sum(w.steps for w in self.workers)

    @property
    def samples(self) -> int:
        return sum(w.samples for w in self.workers)

    @property
    def first_step(self) -> float | None:
        """Seconds from the cell's start to the first step in any worker."""
        firsts = [w.first_step for w in self.workers if w.first_step is not None]
        return min(firsts) if firsts else None

    @property
    def samples_per_s(self) -> float | None:
        """All workers' samples over the time from the first step to the last report."""
        first = self.first_step
        lasts = [w.last_time for w in self.workers if w.last_time is not None]
        if first is None or not lasts or max(lasts) <= first:
            return None
        return self.samples / (max(lasts) - first)

    def plot(self, key: str = "loss", x: str = "step"):
        """A matplotlib figure of ``key`` per worker (needs matplotlib)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("sharedtrain.plot() needs matplotlib: pip install matplotlib") from exc
        fig, ax = plt.subplots(figsize=(6, 3))
        for rank, points in enumerate(self.history.series(key, x)):
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=f"rank {rank}")
        ax.set_xlabel(x)
        ax.set_ylabel(key)
        ax.legend()
        return fig

    def __repr__(self) -> str:
        rate = self.samples_per_s
        rate_text = f", {rate:.0f} samples/s" if rate else ""
        return (f"SharedTrainResult({self.model_name or 'model'}, {self.status}, {self.nprocs} workers "
                f"({self.start_method}) on {self.device}, {self.steps} steps in {self.seconds:.1f} s{rate_text})")

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))


# --------------------------------------------------------------------------- decisions

def default_nprocs() -> int:
    """Physical cores this process may use: one Hogwild worker per core."""
    try:
        import psutil
        physical = psutil.cpu_count(logical=False)
    except Exception:
        physical = None
    usable = _usable_cpus()
    logical = os.cpu_count() or 1
    if physical is None:
        physical = logical
    # In a container or under taskset, fewer logical CPUs may be ours than the machine has.
    if usable < logical:
        physical = max(1, min(physical, usable * physical // logical))
    return max(1, physical)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _thread_packages(thread: threading.Thread) -> set:
    mods = {type(thread).__module__}
    target = getattr(thread, "_target", None)
    if target is not None:
        mods.add(getattr(target, "__module__", None))
        owner = getattr(target, "__self__", None)
        if owner is not None:
            mods.add(type(owner).__module__)
    return {m.split(".")[0] for m in mods if m}


def fork_unsafe_threads(threads=None) -> list:
    """Running threads that could hold a lock at ``fork`` time (deadlocking a child).

    The main thread, the calling thread, and the kernel's and IPython's own
    threads (heartbeat, IOPub, control, history saver, gpumagic's gauge
    monitor...) are safe: a forked worker never runs their code.
    """
    current = threading.current_thread()
    unsafe = []
    for thread in threads if threads is not None else threading.enumerate():
        if thread is current or thread is threading.main_thread() or not thread.is_alive():
            continue
        packages = _thread_packages(thread)
        if packages and packages <= set(_SAFE_THREAD_PACKAGES) | {"threading"} and packages != {"threading"}:
            continue
        unsafe.append(thread)
    return unsafe


def choose_start_method(requested: str | None, device: str, cuda_initialized: bool | None = None,
                        threads=None, platform: str | None = None) -> tuple[str, str]:
    """``(method, reason)``: the requested method, else fork where safe, else a fresh process.

    Fork is safe when CUDA is not initialised in the kernel (a CUDA context
    does not survive fork), the model is on the CPU, no other thread could
    hold a lock, and the platform forks cleanly (not macOS). Otherwise workers
    need a fresh process: on Linux ``forkserver``, whose server imports torch
    once and then forks clean workers for this and every later cell (spawn
    imports torch again in every worker of every cell); elsewhere ``spawn``.
    """
    from ..devices import torch_cuda_initialized
    import multiprocessing as mp
    available = mp.get_all_start_methods()
    if requested is not None:
        if requested not in START_METHODS or requested not in available:
            raise usage_error(f"--start-method {requested!r} is not available here",
                              [m for m in START_METHODS if m in available])
        if requested == "fork" and device.startswith("cuda"):
            raise usage_error(f"--start-method fork cannot be used with a model on {device}: CUDA does not "
                              "survive fork", [m for m in ("spawn", "forkserver") if m in available])
        return requested, "requested"
    platform = platform or sys.platform
    fresh = "forkserver" if platform.startswith("linux") and "forkserver" in available else "spawn"
    how = ("a fork server that has torch imported starts them (kept for later cells)" if fresh == "forkserver"
           else "they start a fresh Python")
    if device.startswith("cuda"):
        return fresh, f"the model is on {device}: CUDA workers need a process of their own, so {how}"
    cuda_initialized = torch_cuda_initialized() if cuda_initialized is None else cuda_initialized
    if cuda_initialized:
        return fresh, f"CUDA is initialised in this kernel, and would be unusable after fork, so {how}"
    if platform == "darwin" or "fork" not in available:
        return "spawn", "fork is not safe on this platform"
    unsafe = fork_unsafe_threads(threads)
    if unsafe:
        names = ", ".join(repr(t.name) for t in unsafe[:3])
        return fresh, f"thread(s) {names} are running and could hold a lock across fork, so {how}"
    return "fork", "no CUDA in the kernel and no thread that could hold a lock across fork, so fork is safe and fastest"


def plan_sharing(new_storages: int, open_fds: int, soft: int, hard: int,
                 strategy: str = "file_descriptor", margin: int = 64) -> tuple[str, int | None, str | None]:
    """``(strategy, new_soft_limit, note)`` for sharing ``new_storages`` more storages.

    With torch's ``file_descriptor`` strategy every shared storage keeps a
    file open in every process that maps it. When that would pass the
    open-file limit, raise the soft limit up to the hard one; when even the
    hard limit is too low, use the ``file_system`` strategy (named
    ``/dev/shm`` files, cleaned up by torch's ``torch_shm_manager``).
    """
    if strategy != "file_descriptor":
        return strategy, None, None
    need = open_fds + new_storages + margin
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited or need <= soft:
        return strategy, None, None
    if hard == unlimited or need <= hard:
        target = 2 * need if hard == unlimited else min(hard, 2 * need)
        return strategy, target, f"raised this kernel's open-file limit from {soft} to {target} for {new_storages} shared tensors"
    return "file_system", None, (
        f"the open-file limit ({hard}) is too low to share {new_storages} tensors by file descriptor; "
        f"using torch's file_system sharing strategy for this kernel instead. To keep file descriptors, "
        f"start Jupyter with a higher limit (ulimit -n {2 * need}).")


def _check_nprocs(nprocs) -> tuple[int, str | None]:
    cores = _usable_cpus()
    if nprocs is None:
        return default_nprocs(), None
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise usage_error(f"--nprocs must be a positive number of processes, not {nprocs!r}",
                          sorted({1, default_nprocs(), cores}))
    if nprocs > cores:
        return nprocs, (f"Warning: {nprocs} processes on {cores} CPU core(s): workers will compete for cores; "
                        f"--nprocs {default_nprocs()} matches this machine")
    return nprocs, None


def _hogwild_devices() -> list[str]:
    from ..devices import available_devices
    return [d for d in available_devices() if d == "cpu" or d.startswith("cuda")]


def _resolve_device(spec, modules: dict) -> tuple[str, bool]:
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


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def _loader_shardable(loader: DataLoader) -> str | None:
    """``None`` when ``loader`` can be sharded by sample, else the reason it cannot."""
    if isinstance(loader.dataset, IterableDataset):
        return "it reads an IterableDataset"
    if loader.batch_sampler is None:
        return "it has batch_size=None"
    try:
        len(loader.batch_sampler)
    except TypeError:
        return "its sampler has no length"
    return None


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr(), t.device.type
    except Exception:
        return id(t), t.device.type


def _module_tensors(modules: dict) -> list:
    seen, out = set(), []
    for m in modules.values():
        for t in itertools.chain(m.parameters(), m.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _share_modules(modules: dict, notes: list) -> str:
    """Put every CPU parameter and buffer in shared memory (in place); returns the strategy."""
    import torch.multiprocessing as tmp
    tensors = [t for t in _module_tensors(modules) if t.device.type == "cpu" and not t.is_shared()]
    storages = {_storage_key(t): t for t in tensors}
    strategy = tmp.get_sharing_strategy()
    if not storages:
        return strategy
    nbytes = sum(t.untyped_storage().nbytes() for t in storages.values())
    _check_shm_space(nbytes)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    planned, new_soft, note = plan_sharing(len(storages), _open_fds(), soft, hard, strategy)
    if new_soft is not None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
        except (ValueError, OSError):
            planned, note = "file_system", ("could not raise the open-file limit; using torch's file_system "
                                            "sharing strategy for this kernel")
    if planned != strategy:
        tmp.set_sharing_strategy(planned)
    if note:
        notes.append(note)
    for t in tensors:
        if not t.is_shared():
            t.share_memory_()
    return planned


def _check_shm_space(nbytes: int) -> None:
    import shutil
    from ..display import fmt_bytes
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        return
    if nbytes > free:
        raise usage_error(f"the model needs {fmt_bytes(nbytes)} of shared memory but /dev/shm has "
                          f"{fmt_bytes(free)} free; in Docker start the container with a larger --shm-size "
                          "(or --ipc=host)")


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def _draw_seed() -> int:
    # From the notebook's own generator: reproducible when the notebook seeded torch.
    return int(torch.randint(0, 2 ** 31 - 1, (1,)).item())


# --------------------------------------------------------------------------- compiling

@dataclass
class _Cell:
    code: object
    tree: ast.Module
    filename: str
    source: str


_plain_counter = itertools.count(1)


def _compile(shell, cell: str, header: str) -> _Cell:
    if shell is not None:
        compiled = cells.compile_cell(shell, cell, header=header)
        source = "".join(linecache.cache.get(compiled.filename, (0, None, [], ""))[2])
        code = compile(compiled.tree, compiled.filename, "exec")
        return _Cell(code, compiled.tree, compiled.filename, source)
    # Without a shell: plain Python, under a name tracebacks show as a cell.
    offset = header.count("\n") + 1 if header else 0
    source = (header.rstrip("\n") + "\n" + cell) if header else cell
    filename = f"<cell-sharedtrain-{next(_plain_counter)}>"
    cells.register_source(filename, source)
    tree = ast.parse("\n" * offset + cell, filename=filename)
    return _Cell(compile(tree, filename, "exec"), tree, filename, source)


def _function_globals(func, ns: dict, depth: int = 0) -> set:
    """Notebook names a notebook function uses (``def step(x): return model(x)`` -> model)."""
    code = getattr(func, "__code__", None)
    if code is None or getattr(func, "__globals__", None) is not ns or depth > 3:
        return set()
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
    for name in list(names):
        if callable(ns.get(name)) and ns.get(name) is not func:
            names |= _function_globals(ns[name], ns, depth + 1)
    return names


def _with_function_globals(tree: ast.Module, ns: dict) -> ast.Module:
    """The cell's tree plus reads of the notebook names its notebook functions use.

    A cell that calls ``train_epoch()``, which trains the global ``model``,
    shares that model as if the cell named it.
    """
    extra = set()
    for name in names_read(tree):
        extra |= _function_globals(ns.get(name), ns)
    if not extra:
        return tree
    reads = [ast.Expr(ast.Name(id=n, ctx=ast.Load())) for n in sorted(extra) if n in ns]
    return ast.Module(body=list(tree.body) + reads, type_ignores=[])


def _cell_sources() -> dict:
    """linecache entries of notebook cells, so spawned workers can show their lines."""
    return {name: "".join(entry[2]) for name, entry in list(linecache.cache.items())
            if isinstance(name, str) and (name.startswith("<ipython-input-") or name.startswith("<cell"))
            and len(entry) >= 3}


# --------------------------------------------------------------------------- shipping (spawn)

def _travels_shared(obj) -> bool:
    try:
        return obj.device.type == "cuda" or obj.is_shared()
    except Exception:
        return False


LARGE_TENSOR = 1 << 20     # bytes: larger notebook tensors reach spawned workers through shared memory
MAX_SHM_COPIES = 256       # each shared copy holds a file descriptor in every process


def _pickler_class():
    import cloudpickle

    class SharedPickler(cloudpickle.Pickler):
        """cloudpickle, except shared, CUDA and large tensors become persistent ids.

        cloudpickle bypasses torch's shared-memory reductions (it would copy
        the weights); the ids are resolved against tensors sent through
        multiprocessing's own pickler, which shares them. A large private CPU
        tensor (a dataset) is copied once into shared memory and mapped by
        every worker rather than pickled into each; the notebook's tensor is
        not touched.
        """

        def __init__(self, file, copy_large: bool = True):
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self.shared: list = []
            self.copy_large = copy_large
            self._index: dict = {}
            self._keep: list = []        # what the ids stand for stays alive while pickling
            self._copies: dict = {}      # storage -> its shared copy, so views keep sharing it

        def persistent_id(self, obj):
            if not isinstance(obj, torch.Tensor):
                return None
            index = self._index.get(id(obj))
            if index is not None:
                return index
            if _travels_shared(obj):
                shared = obj
            else:
                shared = self._shared_copy(obj) if self.copy_large else None
                if shared is None:
                    return None
            index = self._index[id(obj)] = len(self.shared)
            self.shared.append(shared)
            self._keep.append(obj)
            return index

        def _shared_copy(self, t):
            if (type(t) is not torch.Tensor or t.device.type != "cpu" or t.requires_grad
                    or t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg()):
                return None
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes < LARGE_TENSOR:
                return None
            key = (storage.data_ptr(), nbytes)
            copy = self._copies.get(key)
            if copy is None:
                if len(self._copies) >= MAX_SHM_COPIES or not _shm_has_room(nbytes):
                    return None  # pickled by value instead: slower, never fails for lack of /dev/shm
                copy = torch.UntypedStorage._new_shared(nbytes)
                copy.copy_(storage)
                self._copies[key] = copy
            return torch.empty(0, dtype=t.dtype).set_(copy, t.storage_offset(), t.size(), t.stride())

    return SharedPickler


def _shm_has_room(nbytes: int) -> bool:
    import shutil
    try:
        return shutil.disk_usage("/dev/shm").free > nbytes + (64 << 20)
    except OSError:
        return False


def _dumps_shared(obj, copy_large: bool = True) -> tuple[bytes, list]:
    buffer = io.BytesIO()
    pickler = _pickler_class()(buffer, copy_large)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.shared


def _pack(names: list[str], ns: dict, assigned: set, extra: dict) -> tuple[bytes, list]:
    """Pickle the notebook values the cell reads, with ``extra``, for spawned workers.

    A value that cannot be pickled is left out when the cell assigns it
    itself; otherwise ``UsageError`` names it.
    """
    values = {n: ns[n] for n in names if n in ns and n not in _SHELL_NAMES}
    try:
        return _dumps_shared({"namespace": values, **extra})
    except Exception:
        pass
    kept = {}
    for name, value in values.items():
        try:
            _dumps_shared(value, copy_large=False)
        except Exception as exc:
            if name in assigned:
                continue  # the cell makes its own
            raise usage_error(
                f"{name!r} ({type(value).__name__}) cannot be sent to spawned workers ({exc.__class__.__name__}: "
                f"{exc}); create it inside the cell, or use --start-method fork") from None
        kept[name] = value
    return _dumps_shared({"namespace": kept, **extra})


def _blob_fd(data: bytes) -> int:
    """An anonymous file holding ``data``: freed with its last descriptor, so nothing can leak."""
    try:
        fd = os.memfd_create("gpumagic-sharedtrain", getattr(os, "MFD_CLOEXEC", 0))
    except (AttributeError, OSError):
        import tempfile
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
    return fd


# --------------------------------------------------------------------------- the kernel side

def _shell_and_ns(target):
    if isinstance(target, dict):
        return None, target
    ns = getattr(target, "user_ns", None)
    if ns is None:
        raise TypeError("train_shared needs an IPython shell or a namespace dict")
    return target, ns


@contextmanager
def _no_interrupts():
    """Let cleanup finish even when the user presses interrupt again."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def _stop_workers(processes: list, grace: float = STOP_GRACE) -> list:
    """SIGTERM each worker's process group, SIGKILL what is left after ``grace``, reap all.

    Returns the exit codes (negative: killed by that signal).
    """
    alive = [p for p in processes if p.exitcode is None and p.pid is not None]
    for p in alive:
        _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.exitcode is None:
            _signal_group(p.pid, signal.SIGKILL)
            p.join(2.0)
    codes = [p.exitcode for p in processes]
    workers.reap(processes, timeout=1.0)
    return codes


# What a worker's first optimizer call imports (``torch._dynamo``, over a second of CPU): the fork
# server imports it once up front, and a forking kernel imports it once for all later cells.
_LAZY_TORCH_MODULES = ("torch._dynamo",)
_forkserver_pid: int | None = None   # the fork server this module started, stopped on %unload_ext


def _prepare_forkserver(ctx) -> int | None:
    """Have the fork server start with torch, the worker module and torch._dynamo imported.

    The preload list only matters when the server starts: one that something
    else in the kernel started keeps its own, and workers then import what
    they need themselves. Returns the running server's pid (None: none yet).
    """
    from multiprocessing import forkserver
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        ctx.set_forkserver_preload([_worker_module.__name__, *_LAZY_TORCH_MODULES])
    return pid


def _adopt_forkserver(before: int | None) -> None:
    """Remember a fork server this run started, to stop it on ``%unload_ext gpumagic``.

    Ours when none ran before, or when ours had died and multiprocessing
    started another (with the same preload list).
    """
    global _forkserver_pid
    from multiprocessing import forkserver
    from .. import session
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None and pid != before and (before is None or before == _forkserver_pid):
        _forkserver_pid = pid
        session.register_closer("sharedtrain-forkserver", stop_forkserver)


def _forkserver_running() -> bool:
    from multiprocessing import forkserver
    return getattr(forkserver._forkserver, "_forkserver_pid", None) is not None


def _start_forkserver() -> None:
    """Start the fork server now, in the background: it imports torch while the notebook goes on."""
    import multiprocessing as mp
    from multiprocessing import forkserver
    try:
        before = _prepare_forkserver(mp.get_context("forkserver"))
        with fresh.starting("forkserver"):
            forkserver.ensure_running()
        _adopt_forkserver(before)
    except Exception:
        pass  # later cells start it when they need it, and report what goes wrong then


def stop_forkserver(timeout: float = 2.0) -> bool:
    """Stop the fork server ``%%sharedtrain`` started, if it still runs; True if one was stopped.

    Closing its "alive" pipe asks it to exit once no worker holds that pipe;
    one that is still up after ``timeout`` is terminated.
    """
    global _forkserver_pid
    from multiprocessing import forkserver
    from .. import session
    server = forkserver._forkserver
    pid, _forkserver_pid = _forkserver_pid, None
    session.unregister_closer("sharedtrain-forkserver")
    if pid is None or getattr(server, "_forkserver_pid", None) != pid:
        return False
    with getattr(server, "_lock", threading.Lock()):
        alive_fd = server._forkserver_alive_fd
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    try:
        os.close(alive_fd)
    except (OSError, TypeError):
        pass
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGTERM)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            return True
        time.sleep(0.02)


def _import_lazy_torch_modules() -> None:
    """Import in the kernel, once, what workers import on their first optimizer call.

    Run after the first forked workers started (they import it themselves,
    in parallel), so every later cell's workers inherit it instead of each
    paying over a second of CPU before their first update. An interrupt
    meanwhile is held until the import is over, then raised.
    """
    missing = [name for name in _LAZY_TORCH_MODULES if name not in sys.modules]
    if not missing:
        return
    main = threading.current_thread() is threading.main_thread()
    pending = []
    previous = signal.signal(signal.SIGINT, lambda *_: pending.append(True)) if main else None
    try:
        for name in missing:
            try:
                __import__(name)
            except Exception:
                pass  # an optional speed-up only
    finally:
        if main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt


def _start_worker(ctx, method: str, rank: int, world: int, spec: _Spec):
    recv, send = ctx.Pipe(duplex=False)
    parent = os.getpid() if method in ("fork", "spawn") else None
    process = ctx.Process(target=_worker_main, args=(rank, world, spec, send, parent),
                          name=f"sharedtrain-{rank}", daemon=False)
    try:
        with warnings.catch_warnings(), fresh.starting(method):
            # Python 3.12+ warns on fork with threads; the start method chose fork knowing which run.
            warnings.simplefilter("ignore", DeprecationWarning)
            process.start()
    except BaseException:
        recv.close()
        raise
    finally:
        send.close()
    return process, recv


class _Run:
    """The kernel's side of one run: reads workers' messages, tracks their state."""

    def __init__(self, result: SharedTrainResult, progress, output):
        self.result = result
        self.progress = progress
        self.output = output or _print_output
        self.last_progress = 0.0

    def handle(self, message) -> None:
        kind, rank, body = message
        stats = self.result.workers[rank]
        if kind == "tick":
            steps, samples, first, now, entries = body
            stats.steps, stats.samples, stats.last_time = steps, samples, now
            if first is not None:
                stats.first_step = first
            if stats.state == "starting":
                stats.state = "running"
            if entries:
                stats.reports += len(entries)
                stats.last.update({k: v for k, v in entries[-1].items() if k not in ("step", "time")})
                self.result.history.extend(rank, entries)
        elif kind == "out":
            self.output(rank, *body)
        elif kind == "done":
            stats.state = "done"
        elif kind == "error":
            stats.state = "failed"
            workers.raise_worker_error(body)

    def drain(self, conn) -> bool:
        """Read every waiting message; False once the worker closed its end."""
        try:
            while conn.poll():
                self.handle(conn.recv())
        except (EOFError, OSError):
            return False
        return True

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.progress is not None and (force or now - self.last_progress >= PROGRESS_INTERVAL):
            self.last_progress = now
            try:
                self.progress(self.result)
            except Exception:
                pass  # a display problem must not stop training


def _print_output(rank: int, stream: str, text: str) -> None:
    target = sys.stderr if stream == "stderr" else sys.stdout
    lines = text.splitlines(keepends=True)
    target.write("".join(f"[rank {rank}] {line}" for line in lines))
    target.flush()


def _wait(run: _Run, processes: list, conns: list) -> None:
    from multiprocessing.connection import wait
    open_conns = dict(enumerate(conns))
    pending = set(range(len(processes)))
    stats = run.result.workers
    done_at: dict = {}
    while pending:
        watched = list(open_conns.values()) + [processes[r].sentinel for r in pending]
        for ready in wait(watched, timeout=PROGRESS_INTERVAL):
            rank = next((r for r, c in open_conns.items() if c is ready), None)
            if rank is not None:
                if not run.drain(ready):
                    open_conns.pop(rank, None)
                continue
            rank = next(r for r in pending if processes[r].sentinel == ready)
            if rank in open_conns and not run.drain(open_conns[rank]):
                open_conns.pop(rank, None)
            processes[rank].join(0.5)
            stats[rank].exitcode = processes[rank].exitcode
            if stats[rank].state != "done":
                stats[rank].state = "failed"
                code = processes[rank].exitcode
                how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
                       else f"exited with code {code}")
                raise WorkerError(rank, processes[rank].pid, "WorkerExit",
                                  f"the worker {how} before finishing the cell")
            pending.discard(rank)
        now = time.monotonic()
        for rank in list(pending):
            if stats[rank].state == "done":
                # It finished the cell; a process that then lingers (a thread the cell left
                # running, say) is stopped with the others.
                done_at.setdefault(rank, now)
                if now - done_at[rank] > EXIT_GRACE:
                    pending.discard(rank)
        run.tick()


def train_shared(target, cell: str, *, nprocs: int | None = None, model: str | None = None,
                 device: str | None = None, start_method: str | None = None, seed: int | None = None,
                 header: str = "%%sharedtrain", progress: Callable | None = None,
                 output: Callable | None = None) -> SharedTrainResult:
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
        Default fork where safe, else forkserver on Linux and spawn elsewhere
        (see :func:`choose_start_method`).
    seed : int, optional
        Worker ``rank`` seeds torch, random and numpy with ``seed + rank``;
        loaders shuffle with ``seed``. Default: drawn from the notebook's torch
        generator.
    progress : callable, optional
        Called with the :class:`SharedTrainResult` about twice a second while
        workers run.
    output : callable, optional
        ``output(rank, stream, text)`` for what workers print; default prints
        it here with a ``[rank r]`` prefix.

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
    __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not this frame
    import multiprocessing as mp
    import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory reductions

    started = time.monotonic()
    shell, ns = _shell_and_ns(target)
    if cells.is_empty(cell):
        raise usage_error("the cell is empty: write the training loop each worker runs")
    nprocs, crowded = _check_nprocs(nprocs)
    compiled = _compile(shell, cell, header)
    modules = find_modules(_with_function_globals(compiled.tree, ns), ns, [model] if model else None)
    device_name, move = _resolve_device(device, modules)
    method, reason = choose_start_method(start_method, device_name)
    if method == "fork" and start_method == "fork":
        from ..devices import torch_cuda_initialized
        if torch_cuda_initialized():
            reason = "requested; CUDA is initialised in this kernel, so workers must not touch CUDA"
    start_server_after = method == "forkserver" and start_method is None and not _forkserver_running()
    if start_server_after:
        # A server that is only now starting would make this cell wait for it to import torch
        # and torch._dynamo; spawned workers take their first step about a second sooner.
        method = "spawn"
        reason += "; it is not running yet, so this cell's workers start with spawn meanwhile"
        if _usable_cpus() > nprocs:
            _start_forkserver()  # a core to spare: it imports alongside this cell's workers
            start_server_after = False
    notes: list[str] = []
    if crowded:
        from ..display import note
        note(crowded)
        notes.append(crowded)

    read = names_read(compiled.tree)
    loaders = {name: _loader_shardable(loader) for name, loader in find_loaders(compiled.tree, ns).items()}
    for name, why in loaders.items():
        if why is not None:
            notes.append(f"{name!r} cannot be sharded ({why}): every worker reads all of it, with its random "
                         "generators seeded per rank (seed + rank)")
    optimizers = find_optimizers(compiled.tree, ns, modules)

    # From here on the notebook changes: the model moves (if asked) and goes to shared memory.
    if move:
        for module in modules.values():
            module.to(torch.device(device_name))
        for optimizer in optimizers.values():
            _match_optimizer_devices(optimizer)
    strategy = _share_modules(modules, notes)
    for name, optimizer in optimizers.items():
        tensors = [v for s in optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0]
        if tensors and not device_name.startswith("cuda") and all(_travels_shared(v) for v in tensors):
            notes.append(f"{name!r}: its state is in shared memory, so all workers update one state")
        else:
            notes.append(f"{name!r}: each worker steps its own copy ({type(optimizer).__name__}, state as in the "
                         "notebook) over the shared weights; the notebook's optimizer is left as it was")
    seed = _draw_seed() if seed is None else int(seed)

    spec = _Spec(method=method, t0=started, seed=seed, device=device_name,
                 set_device_name=device is not None, loaders=loaders, optimizers=list(optimizers))
    blob_fd = None
    if method == "fork":
        spec.namespace, spec.code = ns, compiled.code
    else:
        import copy
        view = dict(ns)
        for name in loaders:
            # Loaders travel without a running iterator (persistent workers cannot be pickled).
            view[name] = copy.copy(ns[name])
            view[name]._iterator = None
        data, shared = _pack(read, view, set(names_assigned(compiled.tree)),
                             {"tree": compiled.tree, "filename": compiled.filename, "sources": _cell_sources()})
        blob_fd = _blob_fd(data)
        del data
        spec.blob, spec.shared = _FdHandle(blob_fd), shared

    history = History(nprocs)
    result = SharedTrainResult(modules=modules, nprocs=nprocs, start_method=method, start_reason=reason,
                               device=device_name, seed=seed, sharing_strategy=strategy, history=history,
                               workers=[WorkerStats(rank=r) for r in range(nprocs)], notes=notes)
    ctx = mp.get_context(method)
    server_before = None
    if method == "forkserver":
        spec.env = dict(os.environ)
        server_before = _prepare_forkserver(ctx)
    run = _Run(result, progress, output)
    processes, conns = [], []
    try:
        for rank in range(nprocs):
            process, conn = _start_worker(ctx, method, rank, nprocs, spec)
            processes.append(process)
            conns.append(conn)
            result.workers[rank].pid = process.pid
        if blob_fd is not None:
            os.close(blob_fd)  # every worker has its own descriptor now
            blob_fd = None
        if method == "forkserver":
            _adopt_forkserver(server_before)
        elif method == "fork":
            _import_lazy_torch_modules()
        run.tick(force=True)
        _wait(run, processes, conns)
        result.status = "done"
    except KeyboardInterrupt:
        result.status = "interrupted"
        # A fresh one: the notebook need not see where the kernel happened to be waiting.
        interrupt = KeyboardInterrupt()
        interrupt.result = result
        raise interrupt from None
    except BaseException as exc:
        result.status = "failed"
        exc.result = result
        raise
    finally:
        with _no_interrupts():
            for stats in result.workers:
                if stats.state in ("starting", "running"):
                    stats.state = "stopped"
            codes = _stop_workers(processes)
            for code, stats in zip(codes, result.workers):
                if stats.exitcode is None:
                    stats.exitcode = code
            for conn in conns:
                conn.close()
            if blob_fd is not None:
                os.close(blob_fd)
            spec.namespace = spec.shared = spec.blob = None
            if device_name.startswith("cuda"):
                torch.cuda.ipc_collect()
            result.seconds = time.monotonic() - started
            run.tick(force=True)
            if start_server_after:
                _start_forkserver()
    return result

