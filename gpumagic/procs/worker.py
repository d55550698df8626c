"""Inside a worker process: one main loop for every worker gpumagic starts.

:func:`worker_main` prepares the process (dies with the kernel, leads its own
process group, ignores Ctrl-C: the kernel stops it), sets up its device and,
for ``%%dataparallel`` ranks, joins the ``torch.distributed`` process group.
Then it runs *tasks*: a task is a function ``task(ctx, meta, data)`` named
``"module:function"``; ``ctx`` is the rank's :class:`WorkerContext`, ``data``
the bulk bytes that came with it (a uint8 tensor, or None). A task returns a
payload, or ``(payload, buffer)`` where ``buffer`` is bulk bytes for the
kernel (fill ``ctx.outgoing.get(n)``). A worker started with a first task
(``%%sharedtrain``) runs it and exits; a persistent one (``%%dataparallel``'s
pool) waits for the next.

Messages to the kernel, all through the one pipe::

    ("ready", info)                 start-up done (persistent workers)
    ("out", stream, text)           what the task printed
    ("msg", obj)                    what the task sent with ctx.send(obj)
    ("done", payload, bulk_ref)     the task's result (bulk bytes follow)
    ("error", info)                 an exception (see .failures)

and from it: ``("run", task, meta, bulk_ref)``, ``("stop",)``, ``("kill",)``.

This module imports neither IPython nor the kernel's side of gpumagic, so a
fresh worker starts with torch's import and little else.
"""
from __future__ import annotations

import gc
import importlib
import io
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field

from .display_relay import relay_displays
from .failures import exception_info
from .fd_output import DescriptorOutput
from .follow_kernel import follow
from .import_patches import patch_module
from .loader_workers import fork_from_here
from .marks import mark_worker, unmark
from .teardown import die_with_parent, watch_kernel
from .tqdm_relay import notebook_bars, relay_bars

logger = logging.getLogger(__name__)

__all__ = ["WorkerConfig", "WorkerContext", "ForwardedStream", "worker_main"]


@dataclass
class WorkerConfig:
    """What one worker needs to start (picklable: it travels to fresh interpreters)."""
    rank: int
    world_size: int
    device: str = "cpu"
    method: str = "spawn"               # how it was started: fork, spawn or forkserver
    parent_pid: int | None = None       # the kernel's pid
    backend: str | None = None          # torch.distributed backend; None: no process group
    rendezvous: tuple | None = None     # where ranks meet: ("file", path) or ("tcp", address, port)
    timeout: float = 1800.0             # seconds a collective may wait
    env: dict = field(default_factory=dict)   # added to the environment
    environ: dict | None = None         # the whole environment (fork-server children: the kernel's as it is now)
    threads: int | None = None          # torch threads on a CPU device
    bind_cpus: bool = False             # run on the CPU cores near the GPU
    preload: tuple = ()                 # modules a first task would import: imported while starting
    remote: bool = False                # on another machine (an ipyparallel engine): no descriptors
    kernel: dict | None = None          # the kernel's directory and sys.path now (a fork server's child lacks them)


class WorkerContext:
    """What a task sees on its rank: rank, world size, device, and a way to talk to the kernel."""

    def __init__(self, conn, config: WorkerConfig):
        self.conn = conn
        self.config = config
        self.rank = config.rank
        self.world_size = config.world_size
        self.device = config.device
        self.backend = config.backend
        self.state: dict = {}          # kept between tasks (the tensor store lives here)
        self.in_task = False
        self.forward = False           # whether what the task prints goes to the kernel
        self._send_lock = threading.Lock()
        self.streams = (ForwardedStream(self, "stdout"), ForwardedStream(self, "stderr"))
        self.descriptors: DescriptorOutput | None = None   # fd 1 and 2, read back (a local worker)
        # where ranks span machines (ipyparallel engines): local_rank, local_world_size, node_rank, nodes
        self.node: dict | None = None

    def capture_descriptors(self) -> None:
        """C-level output (and a subprocess's) follows the rank's prints: rank 0's to the cell, every
        rank's with ``--all-output``; between tasks it goes where it went before."""
        self.descriptors = DescriptorOutput(self._descriptor_text)
        self.descriptors.start()

    def _descriptor_text(self, stream: str, text: str) -> None:
        if self.in_task:
            if self.forward:
                self._send(("out", stream, text))
            return
        saved = self.descriptors.original(stream) if self.descriptors is not None else None
        if saved is not None:
            os.write(saved, text.encode())

    def drain_descriptors(self) -> None:
        """What the task wrote to fd 1 and 2 reaches the kernel before its result."""
        if self.descriptors is not None:
            self.descriptors.drain()

    @property
    def torch_device(self):
        import torch
        return torch.device(self.device)

    def send(self, obj) -> None:
        """Send ``obj`` to the kernel's ``on_message`` while the task runs."""
        self._send(("msg", obj))

    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            # The kernel is gone or stopped listening: nobody wants this work.
            os._exit(1)

    @property
    def outgoing(self):
        """This rank's bulk buffer for results: fill ``outgoing.get(n)`` and return it from the task."""
        out = self.state.get("_outgoing")
        if out is None:
            from .bulk import Outgoing
            out = self.state["_outgoing"] = Outgoing(shared=not self.config.remote)
        return out

    def _send_result(self, payload, buffer) -> None:
        out = self.outgoing
        ref, new = out.reference(buffer, peer="kernel", can_share=not self.config.remote)
        with self._send_lock:
            self.conn.send(("done", payload, ref))
            out.send(self.conn, ref, new, buffer, "kernel", self.config.parent_pid)


class ForwardedStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` in a worker: text goes to the kernel as it is written (or nowhere).

    One pair per worker, used by every task: a logging handler made in one
    cell (frameworks make theirs when first imported) keeps writing into the
    cells after it. Whether text is forwarded is the current task's choice
    (``ctx.forward``: rank 0's output, or every rank's with ``--all-output``).
    The kernel's side (:mod:`.output`) completes lines and prefixes them with the rank.
    """

    encoding = "utf-8"

    def __init__(self, ctx: WorkerContext, stream: str):
        self._ctx, self._stream = ctx, stream

    def writable(self):
        return True

    def write(self, text):
        if self._ctx.forward and text:
            self._ctx._send(("out", self._stream, str(text)))
        return len(text)

    def isatty(self):
        return False


# ============================================================== the main loop

def worker_main(conn, config: WorkerConfig, first=None) -> None:
    """The worker process: prepare, start up, then run ``first`` (and exit) or tasks from ``conn``.

    ``first`` is a list ``[task, meta, data]`` with ``data`` a :class:`~.bulk.BulkHandle` or None.
    """
    _prepare_process(config)
    ctx = WorkerContext(conn, config)
    if not config.remote:   # (an ipyparallel engine relays its own descriptors and displays)
        ctx.capture_descriptors()
        relay_displays(ctx)
        relay_bars()
        # (tqdm.notebook imported by a task: its widgets would have no kernel behind them either)
        patch_module("tqdm.notebook", _text_progress_bars)
    try:
        info = _start_up(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel
        ctx._send(("error", exception_info(config.rank, exc)))
        os._exit(1)
    if first:
        # The Process object keeps its arguments while it runs: take the task out of them, so that
        # what the task lets go of (a namespace, shared tensors) is really freed.
        job = list(first)
        first.clear()
        _run_task(ctx, job)
        _leave(conn)
    # Everything a persistent worker has imported lives as long as it does: keep the garbage
    # collector from walking it again and again during training steps. (A one-task worker skips
    # this: forked from a kernel, it would walk the whole notebook first.)
    gc.collect()
    gc.freeze()
    conn.send(("ready", info))
    incoming = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] in ("stop", "kill"):
            break
        if msg[0] != "run":
            continue
        if incoming is None:
            from .bulk import Incoming
            incoming = Incoming()
        if len(msg) > 4 and msg[4]:
            follow(msg[4])   # the kernel's directory, sys.path and environment as the task was sent
        _run_task(ctx, [msg[1], msg[2], incoming.receive(conn, msg[3])])
        del msg
    _leave(conn)


def _prepare_process(config: WorkerConfig) -> None:
    if config.method == "forkserver":
        die_with_parent(os.getppid())   # the server: if it goes, so does this worker
        watch_kernel()                   # and the kernel, whose death the server survives
    else:
        die_with_parent(config.parent_pid)
    try:
        os.setpgid(0, 0)  # its own group: stopping it also stops any DataLoader workers it starts
    except OSError:
        logger.debug("could not lead a process group", exc_info=True)
    if config.environ is not None and dict(os.environ) != config.environ:
        os.environ.clear()
        os.environ.update(config.environ)
    os.environ.update(config.env)
    if config.kernel is not None:
        follow(config.kernel)
    # A worker's output reaches the notebook as plain text. ipykernel sets FORCE_COLOR for its own, and
    # rich (Lightning's progress bar) then draws as on a terminal, with cursor moves that a notebook
    # shows as a growing pile of frames: tell it this is no terminal, unless the user said otherwise.
    os.environ.setdefault("TTY_COMPATIBLE", "0")
    # The kernel decides when to stop; a terminal's Ctrl-C reaches it, not every worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if config.method == "fork":
        _detach_display()
    fork_from_here()   # DataLoader workers start forked, die with this worker, print through it
    if not config.remote:   # (an engine's kernel is on another machine)
        mark_worker(config.rank, config.world_size, config.parent_pid)   # %gpumem --who names it by this


def _detach_display() -> None:
    """In a forked worker, ``display()`` prints (forwarded) instead of using the kernel's sockets, and
    ``get_ipython()`` is ``None``, as in any process that is not IPython.

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

    publisher.publish = publish
    publisher.clear_output = lambda *args, **kwargs: None
    # And the process stops being IPython's: code that asks get_ipython() whether it runs in a
    # notebook (tqdm.auto, rich) would make widgets whose messages cannot reach it from here.
    from ..cell.compile import remember_cells_of
    shell = module.InteractiveShell.instance()
    remember_cells_of(shell)
    type(shell).clear_instance()
    _text_progress_bars(sys.modules.get("tqdm.notebook"))


def _text_progress_bars(notebook) -> None:
    """tqdm's notebook bar (module ``notebook``), the kernel's (``from tqdm.auto import tqdm``) or a
    task's (``from tqdm.notebook import tqdm``), draws as text here.

    Its widgets would send from a fork on the kernel's sockets, which ipykernel refuses (a warning
    with the whole message in the server's log, each update), or, made in a worker, be shown in the
    cell with no model behind them ("model not found"); the class loses its own methods, so it is
    tqdm's text bar (``tqdm.std.tqdm``, its base) in this process (drawn as HTML through the relay
    where a notebook's task shows it: :mod:`.tqdm_relay`).
    """
    cls = getattr(notebook, "tqdm_notebook", None)
    if cls is None:
        return
    for name in [n for n in vars(cls) if n not in ("__module__", "__doc__", "__qualname__", "__dict__",
                                                     "__weakref__", "__slots__")]:
        try:
            delattr(cls, name)
        except (AttributeError, TypeError):
            logger.debug("tqdm_notebook.%s stays", name, exc_info=True)


def _start_up(config: WorkerConfig) -> dict:
    import socket

    import torch
    device = config.device
    info = {"pid": os.getpid(), "host": socket.gethostname(), "device": device, "torch": torch.__version__,
            "pgid": os.getpgrp()}
    if config.threads:
        torch.set_num_threads(config.threads)
    from ..cell.rewrite.helper import follow_process
    follow_process(device)   # functions made under %%ondevice, and their device values, mean this device here
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        if config.bind_cpus:
            _bind_to_gpu_cpus(index)
        torch.cuda.set_device(index)
        info["device_name"] = torch.cuda.get_device_name(index)
    else:
        info["device_name"] = device
    if config.backend:
        from . import process_group
        process_group.join(config)
    for module in config.preload:
        importlib.import_module(module)
    return info


def _bind_to_gpu_cpus(index: int) -> None:
    """Run on the CPU cores near the GPU (its NUMA node), as NVIDIA's launchers do."""
    try:
        from ..devices import nvml, visible_gpus
        gpus = visible_gpus()
        if index >= len(gpus) or gpus[index].handle is None:
            return
        words = ((os.cpu_count() or 1) + 63) // 64
        mask = nvml.lib().nvmlDeviceGetCpuAffinity(gpus[index].handle, words)
    except Exception:  # a speed-up only: without NVML's answer the rank runs where it may
        logger.debug("no CPU affinity for cuda:%s", index, exc_info=True)
        return
    cpus = {w * 64 + b for w, bits in enumerate(mask) for b in range(64) if bits >> b & 1}
    allowed = os.sched_getaffinity(0)
    mine = cpus & allowed
    # Only a plausible NUMA share: a virtual machine may report a mask that means nothing.
    enough = max(4, len(allowed) // (2 * max(1, len(gpus))))
    if len(mine) >= enough and mine != allowed:
        os.sched_setaffinity(0, mine)


_tasks: dict = {}


def _task_function(name: str):
    fn = _tasks.get(name)
    if fn is None:
        module, _, attr = name.partition(":")
        fn = _tasks[name] = getattr(importlib.import_module(module), attr)
    return fn


def _shown(meta) -> tuple[bool, bool]:
    """``(every rank's output shown, the kernel is a notebook's)``, as a task's ``meta`` says: a dict's
    ``all_output`` and ``notebook`` keys (``%%sharedtrain``'s), or attributes of those names
    (``%%dataparallel``'s CellOrder); neither, for other tasks."""
    if isinstance(meta, dict):
        return bool(meta.get("all_output")), bool(meta.get("notebook"))
    return bool(getattr(meta, "all_output", False)), bool(getattr(meta, "notebook", False))


def _run_task(ctx: WorkerContext, job: list) -> None:
    """Run ``job`` (``[task, meta, data]``, emptied here) with the rank's output forwarded; reports
    its result or its exception."""
    task, meta, data = job
    job.clear()
    every_rank, notebook = _shown(meta)
    ctx.forward = ctx.rank == 0 or every_rank
    real_out, real_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = ctx.streams
    ctx.in_task = True
    try:
        from .bulk import BulkHandle
        if isinstance(data, BulkHandle):
            data = data.open()   # bytes given with the process's start: mapped now
        if ctx.backend:
            from .process_group import ensure_pool_group
            ensure_pool_group()   # the last cell may have ended the pool's group or left its own
        # A notebook kernel's task: its tqdm bars show as a notebook's (tqdm_relay), saying their rank
        # where every rank's output is shown.
        with notebook_bars(notebook, labelled=every_rank):
            result = _task_function(task)(ctx, meta, data)
        payload, buffer = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
        del result, meta, data
        ctx.drain_descriptors()
        ctx.in_task = False
        ctx._send_result(payload, buffer)
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel
        ctx.drain_descriptors()
        ctx.in_task = False
        ctx._send(("error", exception_info(ctx.rank, exc)))
    finally:
        ctx.in_task = False
        sys.stdout, sys.stderr = real_out, real_err
        # The cell's namespace, its wrappers and their buffers are cycles (and may hold CUDA IPC
        # handles): free them now, while the kernel reads the results, not at some later step.
        gc.collect()


def _leave(conn) -> None:
    try:
        from .process_group import leave
        leave()
    except Exception:  # leaving anyway: the process group dies with the process
        logger.debug("destroy_process_group failed", exc_info=True)
    try:
        conn.close()
    except OSError:
        logger.debug("the pipe was already closed", exc_info=True)
    unmark()
    os._exit(0)  # skip interpreter teardown: CUDA/NCCL destructors can hang at exit
