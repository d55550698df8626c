"""Starting worker processes: which start method is safe, and starting them cleanly.

:func:`choose_start_method` picks fork only where it is safe (no CUDA in the
kernel, no thread that could hold a lock, a platform that forks cleanly),
else a fresh interpreter. :func:`start_process` starts one worker, hiding the
notebook's ``__main__`` from fresh interpreters and passing them the bytecode
cache (:mod:`.bytecode`). Every worker gpumagic starts goes through it.

In a notebook::

    method, why = choose_start_method(None, "cpu")
    process = start_process(multiprocessing.get_context(method), worker_main, (conn, config), "worker-0")
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import types
import warnings
from contextlib import contextmanager

from . import bytecode

logger = logging.getLogger(__name__)

__all__ = ["START_METHODS", "choose_start_method", "fork_unsafe_threads", "autograd_threads_started", "starting",
           "start_process", "import_lazily_imported"]

START_METHODS = ("fork", "spawn", "forkserver")

# Threads from these packages only wait on sockets, pipes and timers; a forked
# child never runs their code, so they cannot leave it a held lock it needs.
_SAFE_THREAD_PACKAGES = frozenset({"IPython", "ipykernel", "zmq", "jupyter_client", "tornado", "comm",
                                   "ipywidgets", "gpumagic", "tqdm", "debugpy", "_pydevd_bundle", "pydevd"})
# multiprocessing's descriptor sharer, started once torch's reducers send a shared tensor (as
# --strategy fsdp does): it takes no lock while serving, and resets itself in a child that
# multiprocessing forks.
_SAFE_THREAD_MODULES = frozenset({"multiprocessing.resource_sharer"})

# What a worker's first optimizer call imports (over a second of CPU): a forking kernel imports it
# once for all later cells, and the fork server preloads it.
LAZILY_IMPORTED = ("torch._dynamo",)


def _thread_packages(thread: threading.Thread) -> set:
    mods: set[str | None] = {type(thread).__module__}
    target = getattr(thread, "_target", None)
    if target is not None:
        mods.add(getattr(target, "__module__", None))
        owner = getattr(target, "__self__", None)
        if owner is not None:
            mods.add(type(owner).__module__)
    return {m if m in _SAFE_THREAD_MODULES else m.split(".")[0] for m in mods if m}


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
        if packages and packages <= _SAFE_THREAD_PACKAGES | _SAFE_THREAD_MODULES | {"threading"} \
                and packages != {"threading"}:
            continue
        unsafe.append(thread)
    return unsafe


def autograd_threads_started() -> bool:
    """Whether autograd has started its per-device threads in this process (``pt_autograd_N``).

    Its first backward pass does that wherever torch sees a GPU, even for CPU
    tensors; a child forked afterwards fails its own first backward pass
    ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing").
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:   # not Linux: fork is not chosen there anyway
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().startswith("pt_autograd"):
                    return True
        except OSError:   # the thread ended meanwhile
            continue
    return False


def choose_start_method(requested: str | None, device: str, cuda_initialized: bool | None = None,
                        threads=None, platform: str | None = None,
                        autograd_threads: bool | None = None) -> tuple[str, str]:
    """``(method, reason)``: the requested method, else fork where safe, else a fresh process.

    Fork is safe when CUDA is not initialised in the kernel (a CUDA context
    does not survive fork) nor are autograd's GPU threads running
    (:func:`autograd_threads_started`), the workers use the CPU, no other thread could
    hold a lock, and the platform forks cleanly (not macOS). Otherwise workers
    need a fresh process: on Linux ``forkserver``, whose server imports torch
    once and then forks clean workers for this and every later cell (spawn
    imports torch again in every worker of every cell); elsewhere ``spawn``.
    Raises ``UsageError`` for a requested method that cannot work.
    """
    from ..errors import usage_error
    available = multiprocessing.get_all_start_methods()
    if requested is not None:
        if requested not in START_METHODS or requested not in available:
            raise usage_error(f"--start-method {requested!r} is not available here",
                              [m for m in START_METHODS if m in available])
        if requested == "fork" and device.startswith("cuda"):
            raise usage_error(f"--start-method fork cannot be used with a model on {device}: CUDA does not "
                              "survive fork", [m for m in ("spawn", "forkserver") if m in available])
        if requested == "fork" and (autograd_threads if autograd_threads is not None else autograd_threads_started()):
            raise usage_error("--start-method fork cannot be used after a backward pass in this kernel on a machine "
                              "with a GPU: autograd's threads do not survive fork",
                              [m for m in ("spawn", "forkserver") if m in available])
        return requested, "requested"
    platform = platform or sys.platform
    fresh = "forkserver" if platform.startswith("linux") and "forkserver" in available else "spawn"
    how = ("a fork server that has torch imported starts them (kept for later cells)" if fresh == "forkserver"
           else "they start a fresh Python")
    if device.startswith("cuda"):
        return fresh, f"the model is on {device}: CUDA workers need a process of their own, so {how}"
    if cuda_initialized is None:
        from ..devices import torch_cuda_initialized
        cuda_initialized = torch_cuda_initialized()
    if cuda_initialized:
        return fresh, f"CUDA is initialised in this kernel, and would be unusable after fork, so {how}"
    if autograd_threads if autograd_threads is not None else autograd_threads_started():
        return fresh, f"autograd's GPU threads run in this kernel (after a backward pass) and fail after fork, so {how}"
    if platform == "darwin" or "fork" not in available:
        return "spawn", "fork is not safe on this platform"
    unsafe = fork_unsafe_threads(threads)
    if unsafe:
        # the newest first: most likely what the notebook just started
        names = ", ".join(repr(t.name) for t in unsafe[::-1][:3]) + (f" (and {len(unsafe) - 3} more)"
                                                                     if len(unsafe) > 3 else "")
        return fresh, f"thread(s) {names} are running and could hold a lock across fork, so {how}"
    return "fork", "no CUDA in the kernel and no thread that could hold a lock across fork, so fork is safe and fastest"


@contextmanager
def starting(method: str = "spawn"):
    """Around ``Process.start()`` of workers started with ``method``.

    For fresh interpreters (spawn, forkserver) it hides the notebook's
    ``__main__``: they would re-import it, and a notebook has none to import
    (after ``%reset`` not even a ``__spec__``), while after ``%run script.py``
    its ``__file__`` would run the script again in every worker. Workers need
    nothing from it: cells travel by value. It also passes them the bytecode
    cache (:mod:`.bytecode`) through the environment, set only while they start.
    """
    bytecode.reap_warming()
    if method == "fork":
        yield
        return
    cache = bytecode.worker_pycache()
    saved_main, saved_env = sys.modules.get("__main__"), os.environ.get(bytecode.WORKER_ENV)
    stub = types.ModuleType("__main__")
    stub.__spec__ = None
    sys.modules["__main__"] = stub
    if cache:
        # The child reads it as gpumagic is first imported, before anything it unpickles imports
        # torch; gpumagic/__init__ removes it there again.
        os.environ[bytecode.WORKER_ENV] = cache
    try:
        if method == "forkserver":
            _ensure_server()
        yield
    finally:
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        if saved_env is None:
            os.environ.pop(bytecode.WORKER_ENV, None)
        else:
            os.environ[bytecode.WORKER_ENV] = saved_env


def _ensure_server() -> None:
    """Start multiprocessing's fork server, where it is not running yet, with Ctrl-C ignored.

    Jupyter interrupts the kernel's whole process group, the server too, which ignores Ctrl-C only
    once it has imported its preload list (torch: seconds): interrupted before, it would die, and
    the workers waiting on it fail with an ``EOFError``. "Ignored" is the one disposition an exec
    keeps.
    """
    from multiprocessing import forkserver
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def start_process(ctx, target, args: tuple, name: str):
    """Start ``target(*args)`` in a new, non-daemonic process of context ``ctx``; returns the Process.

    Non-daemonic: a worker may start DataLoader workers of its own.
    """
    process = ctx.Process(target=target, args=args, name=name, daemon=False)
    with warnings.catch_warnings(), starting(ctx.get_start_method()):
        # Python 3.12+ warns on fork with threads running; fork is chosen knowing which run.
        warnings.simplefilter("ignore", DeprecationWarning)
        process.start()
    return process


def import_lazily_imported() -> None:
    """Import in the kernel, once, what workers import on their first optimizer call.

    Run after forked workers started (they import it themselves, in
    parallel), so every later cell's forked workers inherit it instead of
    each paying over a second of CPU before their first update. An interrupt
    meanwhile is held until the import is over, then raised.
    """
    missing = [name for name in LAZILY_IMPORTED if name not in sys.modules]
    if not missing:
        return
    main = threading.current_thread() is threading.main_thread()
    pending: list[bool] = []
    previous = signal.signal(signal.SIGINT, lambda *_: pending.append(True)) if main else None
    try:
        for name in missing:
            try:
                __import__(name)
            except Exception:  # a speed-up only: workers import it themselves
                logger.debug("could not import %s ahead of forked workers", name, exc_info=True)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt
