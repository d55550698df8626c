"""What runs inside a ``%%sharedtrain`` worker process.

The kernel's side (:mod:`gpumagic.parallel.hogwild`) decides, shares and
ships; this module is what a worker needs to run the cell: the channel that
sends counters, reports and output back, the sharded and counting loaders,
and :func:`_worker_main`. It imports torch and a few light gpumagic modules
but not IPython, so a worker started fresh (spawn, or the fork server that
preloads this module) does not pay for importing the notebook's machinery.
"""
from __future__ import annotations

import builtins
import gc
import io
import os
import pickle
import random
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from . import workers
from .cell import compile as cells
from .loaders import shard_loader

FLUSH_INTERVAL = 0.5       # seconds between a worker's messages to the kernel
_READ_LATER = ("cuda",)    # devices whose reported tensors are read when sent, not when reported


class _SharedUnpickler(pickle.Unpickler):
    """Resolves the kernel's persistent ids to the tensors that arrived shared."""

    def __init__(self, file, shared):
        super().__init__(file)
        self._shared = shared

    def persistent_load(self, pid):
        return self._shared[pid]


class _FdHandle:
    """A file descriptor that crosses to a worker as the worker's own descriptor."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction
        # Pickled while the worker is being started: the fd is handed over with it.
        return (_FdHandle._rebuild, (reduction.DupFd(self.fd),))

    @staticmethod
    def _rebuild(dup):
        return _FdHandle(dup.detach())


@dataclass
class _Spec:
    """What a worker needs. Under fork: objects; otherwise a blob and shared tensors."""
    method: str
    t0: float
    seed: int
    device: str
    set_device_name: bool
    loaders: dict              # name -> None (shard) or reason it cannot be sharded
    optimizers: list           # names of notebook optimizers (their state follows the device)
    namespace: dict | None = None
    code: object = None
    blob: _FdHandle | None = None
    shared: list | None = None
    env: dict | None = None    # forkserver: the kernel's environment now, not when the server started


class _Channel:
    """A worker's line to the kernel: counters, reports and output, sent in batches."""

    def __init__(self, conn, rank: int, t0: float):
        self.conn, self.rank, self.t0 = conn, rank, t0
        self.steps = self.samples = self.reports = 0
        self.counting = False
        self.first: float | None = None
        self.buffer: list = []
        self.last_flush = 0.0
        self.broken = False

    def step(self, batch) -> None:
        self.steps += 1
        self.samples += _batch_len(batch)
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
        self.send(("tick", self.rank, (steps, self.samples, self.first, now - self.t0, entries)))

    def send(self, message) -> None:
        if self.broken:
            return
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionError, OSError):
            # The kernel is gone or stopped listening: nobody wants this work.
            self.broken = True
            os._exit(1)


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
    try:
        import numbers
        if isinstance(value, numbers.Number):
            return float(value)
    except Exception:
        pass
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

    _channel: _Channel | None = None

    def __iter__(self):
        channel = self._channel
        for batch in super().__iter__():
            if channel is not None:
                channel.step(batch)
            yield batch


class _Forward(io.TextIOBase):
    """A worker's stdout or stderr, forwarded line by line to the kernel."""

    encoding = "utf-8"

    def __init__(self, channel: _Channel, name: str):
        self.channel, self.name, self.pending = channel, name, ""

    def writable(self):
        return True

    def write(self, text):
        self.pending += text
        if "\n" in self.pending:
            head, _, self.pending = self.pending.rpartition("\n")
            self.channel.send(("out", self.channel.rank, (self.name, head + "\n")))
        return len(text)

    def flush(self):
        if self.pending:
            text, self.pending = self.pending, ""
            self.channel.send(("out", self.channel.rank, (self.name, text)))


def _no_shell():
    raise RuntimeError("IPython magics and !commands cannot run inside %%sharedtrain workers; "
                       "run them in a cell of their own")


def _load_spawned(spec: _Spec):
    import mmap
    # Workers share the descriptor's offset, so each reads through its own mapping.
    try:
        with mmap.mmap(spec.blob.fd, 0, access=mmap.ACCESS_READ) as view:
            payload = _SharedUnpickler(view, spec.shared).load()
    finally:
        os.close(spec.blob.fd)
    for name, source in payload["sources"].items():
        cells.register_source(name, source)
    ns = {"__name__": "__main__", "__builtins__": builtins, "get_ipython": _no_shell}
    ns.update(payload["namespace"])
    return ns, compile(payload["tree"], payload["filename"], "exec")


def _seed_worker(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2 ** 32)


def _prepare_loader(loader, rank: int, world: int, seed: int, reason: str | None, channel: _Channel):
    if reason is None:
        loader = shard_loader(loader, rank, world, split="dataset", seed=seed)
    else:
        import copy
        loader = copy.copy(loader)
    try:
        loader.__class__ = _CountingLoader
        loader._channel = channel
        channel.counting = True
    except TypeError:
        pass  # a DataLoader subclass with its own layout: no step counts, training is unaffected
    return loader


def _match_optimizer_devices(optimizer) -> None:
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    stale = any(isinstance(v, torch.Tensor) and v.dim() > 0 and v.device != p.device
                for p in params.values() for v in optimizer.state.get(p, {}).values())
    if stale:
        optimizer.load_state_dict(optimizer.state_dict())  # casts state to each parameter's device


def _detach_display() -> None:
    """In a forked worker, ``display()`` prints (forwarded) instead of using the kernel's sockets.

    The kernel's ZeroMQ sockets are not fork-safe: a child sending on them
    could corrupt the notebook's output channel.
    """
    module = sys.modules.get("IPython.core.interactiveshell")
    if module is None or not module.InteractiveShell.initialized():
        return
    publisher = getattr(module.InteractiveShell.instance(), "display_pub", None)
    if publisher is None:
        return

    def publish(data, metadata=None, *args, **kwargs):
        text = data.get("text/plain") if isinstance(data, dict) else None
        if text:
            print(text)

    try:
        publisher.publish = publish
        publisher.clear_output = lambda *args, **kwargs: None
    except Exception:
        pass


def _private_state(optimizer) -> None:
    """Copy an optimizer's state: CUDA tensors always arrive shared, the state must not."""
    for state in optimizer.state.values():
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor):
                state[key] = value.clone()


def _watch_kernel() -> None:
    """Under forkserver: end this worker (and its group) when the kernel dies.

    Its parent is the fork server, which stays up while any worker holds its
    "alive" pipe, so a parent-death signal alone would never come. The
    pipe multiprocessing keeps from the kernel (``parent_process().sentinel``)
    reaches end-of-file when the kernel dies, whatever kills it.
    """
    import multiprocessing
    from multiprocessing.connection import wait
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return

    def watch():
        try:
            wait([sentinel])
        except Exception:
            return
        _signal_group(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="sharedtrain-kernel-watch", daemon=True).start()
    # That thread only waits on a pipe: a DataLoader that forks its own workers from here is safe.
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)


def _adopt_environment(env: dict) -> None:
    """The kernel's environment as it is now (CUDA_VISIBLE_DEVICES set in a cell, say), before CUDA starts."""
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)


def _worker_main(rank: int, world: int, spec: _Spec, conn, parent_pid: int | None) -> None:
    if spec.method == "forkserver":
        workers.die_with_parent(os.getppid())  # the server: if it goes, so does this worker
        _watch_kernel()
    else:
        workers.die_with_parent(parent_pid)
    try:
        os.setpgid(0, 0)  # its own group, so stopping it also stops any DataLoader workers it starts
    except OSError:
        pass
    if spec.env is not None:
        _adopt_environment(spec.env)
    # The kernel decides when to stop; a terminal's Ctrl-C reaches it, not every worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    channel = _Channel(conn, rank, spec.t0)
    sys.stdout = _Forward(channel, "stdout")
    sys.stderr = _Forward(channel, "stderr")
    ns = None
    try:
        torch.set_num_threads(1)
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(spec.device))
        if spec.method == "fork":
            _detach_display()
            ns, code = spec.namespace, spec.code
        else:
            ns, code = _load_spawned(spec)
        _seed_worker(spec.seed + rank)
        for name, reason in spec.loaders.items():
            if isinstance(ns.get(name), DataLoader):
                ns[name] = _prepare_loader(ns[name], rank, world, spec.seed, reason, channel)
        for name in spec.optimizers:
            if isinstance(ns.get(name), torch.optim.Optimizer):
                _match_optimizer_devices(ns[name])
                if spec.device.startswith("cuda"):
                    _private_state(ns[name])
        ns["rank"], ns["world_size"], ns["report"] = rank, world, channel.report
        if spec.set_device_name:
            ns["device"] = torch.device(spec.device)
        exec(code, ns)
        if spec.device.startswith("cuda"):
            torch.cuda.synchronize()
        sys.stdout.flush()
        sys.stderr.flush()
        channel.flush()
        ns = code = None
        spec.shared = spec.namespace = None
        gc.collect()  # let go of CUDA IPC handles before saying done
        channel.send(("done", rank, None))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the kernel
        info = workers.exception_info(rank, exc)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            channel.flush()
        except Exception:
            pass
        channel.send(("error", rank, info))
        conn.close()
        os._exit(1)
    conn.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError, OSError):
        pass
