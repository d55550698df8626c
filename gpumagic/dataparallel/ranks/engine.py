"""A ``%%dataparallel`` rank inside an ipyparallel engine: the engine's side of :mod:`.cluster`.

The kernel calls these functions on the engines through ipyparallel
(``view.apply``): :func:`describe` (host, address, GPUs, versions),
:func:`open_store` on rank 0 (the rendezvous: a ``TCPStore`` on rank 0's host,
at a port it picked, as ``torchrun`` does), :func:`join` on every engine (the
rank's device and the process group), then :func:`run_task` once per cell,
which runs the same task a local pool's worker runs
(:mod:`gpumagic.dataparallel.rank.task`) with an :class:`EngineContext` in place of
the worker's. What the task prints goes out through the engine's own output
(ipyparallel relays it); what it sends (progress, warnings) through
``ipyparallel.datapub``. The engine keeps the rank's state between cells, in
this module.

Runs in the engines: no kernel-side gpumagic.
"""
from __future__ import annotations

import logging
import os
import socket
import sys

from ...procs.failures import exception_info
from ...procs.worker import WorkerConfig, WorkerContext, _task_function

logger = logging.getLogger(__name__)

__all__ = ["describe", "open_store", "close_store", "join", "free_port", "run_task", "EngineContext",
           "HOST_VARIABLE"]

# The host an engine says it is on, where set: engines on one machine can stand for several hosts
# (tests, or a machine split by CUDA_VISIBLE_DEVICES as several nodes).
HOST_VARIABLE = "GPUMAGIC_HOST"

_engine: dict = {}   # this engine's: "ctx", "store", "config"


def describe(controller_ip: str = "") -> dict:
    """This engine: host, the address other hosts reach it at, GPUs, pid, and the versions that matter."""
    import torch

    import gpumagic
    return {"host": os.environ.get(HOST_VARIABLE) or socket.gethostname(), "address": _address(controller_ip),
            "pid": os.getpid(), "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "torch": torch.__version__, "gpumagic": getattr(gpumagic, "__version__", "?"),
            "python": sys.version.split()[0], "joined": "ctx" in _engine}


def _address(controller_ip: str) -> str:
    """The address of the interface this engine reaches the controller through: the one other engines
    on the controller's network reach it at (a hostname may resolve to a loopback address)."""
    if controller_ip and controller_ip not in ("127.0.0.1", "localhost", "::1", "*", "0.0.0.0"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((controller_ip, 9))   # no packet is sent: this only picks the route
                return s.getsockname()[0]
        except OSError:
            logger.debug("no route to %s", controller_ip, exc_info=True)
    return "127.0.0.1"


def open_store(world_size: int, timeout: float, host: str = "0.0.0.0", fresh: bool = True) -> int:
    """On rank 0: the rendezvous store, on a free port of this host (``host``: loopback where every engine
    is on it), for the ranks to form in (``fresh``: the last group left first) or for one cell; returns
    the port. It serves until :func:`close_store` (:mod:`.cell_store`)."""
    from .cell_store import CellStore, serve
    if fresh:
        _forget()
        _engine["store"] = CellStore()
    elif "store" not in _engine:
        raise RuntimeError("this engine is not rank 0 of a formed cluster (it was restarted)")
    store = serve(host, world_size, timeout)
    _engine["store"].attach(store)
    return int(store.port)


def close_store() -> None:
    """Let go of the rendezvous store on this engine; on rank 0 its server closes: between cells nothing
    listens (the process group keeps the stand-in, which the next cell's store fills)."""
    store = _engine.get("store")
    if store is not None:
        store.detach()


def join(rank: int, world_size: int, local_rank: int, device: str, backend: str, address: str, port: int,
         timeout: float, env: dict | None = None) -> dict:
    """Become rank ``rank``: the device, the environment, the process group (through the store at
    ``address:port``); returns what :func:`describe` says, with the rank's device."""
    import torch

    from ...procs import process_group
    from .cell_store import CellStore, connect
    if rank != 0:
        _forget()
        _engine["store"] = CellStore()
        _engine["store"].attach(connect(address, port, world_size, timeout))
    os.environ.update(env or {})
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    config = WorkerConfig(rank=rank, world_size=world_size, device=device, backend=backend, timeout=timeout,
                          remote=True)
    process_group.join(config, store=_engine["store"])
    ctx = EngineContext(config, master_addr=address, node={
        "local_rank": local_rank, "local_world_size": int((env or {}).get("LOCAL_WORLD_SIZE", 1)),
        "node_rank": int((env or {}).get("GROUP_RANK", 0)), "nodes": int((env or {}).get("GROUP_WORLD_SIZE", 1))})
    _engine.update(ctx=ctx, config=config)
    return {**describe(), "device": device}


def _forget() -> None:
    """Leave the last process group and drop the last rank's state (the engine joins anew)."""
    from ...procs import process_group
    _engine.pop("ctx", None)
    try:
        process_group.leave()
    except Exception:  # a group from before is gone anyway
        logger.debug("leaving the old process group failed", exc_info=True)
    close_store()
    _engine.pop("store", None)


class EngineContext(WorkerContext):
    """A rank's context in an engine: sends go through ``ipyparallel.datapub``, output through the
    engine's own streams, results back as the task's return value."""

    def __init__(self, config: WorkerConfig, master_addr: str, node: dict):
        super().__init__(None, config)
        self.node = node              # local_rank, local_world_size, node_rank, nodes: torchrun's view
        self.master_addr = master_addr
        self._sent: list = []

    def send(self, obj) -> None:
        from ipyparallel.datapub import publish_data
        self._sent.append(obj)
        publish_data({"gpumagic": list(self._sent)})

    def _send(self, msg) -> None:   # pragma: no cover - the pipe's: nothing here uses it
        raise RuntimeError("an engine rank sends through ipyparallel")


def _connect_for_the_cell(ctx, rendezvous: tuple | None) -> None:
    """A rank other than 0: its connection to the store rank 0 serves for this cell."""
    from .cell_store import connect
    if rendezvous is None or ctx.rank == 0:
        return
    address, port = rendezvous
    _engine["store"].attach(connect(address, port, ctx.world_size, ctx.config.timeout))


def free_port() -> int:
    """A port free on this host now (launch mode's MASTER_PORT, on rank 0's host)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def run_task(task: str, meta, data, show: bool, rendezvous: tuple | None = None) -> tuple:
    """Run one cell's task as this rank; returns ``("done", payload, buffer)`` or ``("error", info)``.

    ``data`` is the bulk bytes (a numpy uint8 array, or None); the buffer comes back the same way.
    ``show``: whether this rank's output goes to the notebook (the rest is dropped here).
    ``rendezvous``: ``(address, port)`` of the store rank 0 serves for this cell, which the other ranks
    use while it runs (rank 0's closes when the kernel says every rank has ended).
    """
    import torch

    from ...procs import process_group
    ctx = _engine.get("ctx")
    if ctx is None:
        return ("error", {"rank": -1, "pid": os.getpid(), "exc_type": "RuntimeError",
                          "message": "this engine is not a rank (it was restarted or joined another cell's group)",
                          "traceback": ""})
    ctx._sent = []
    real_out, real_err = sys.stdout, sys.stderr
    if not show:
        sys.stdout = sys.stderr = open(os.devnull, "w")   # closed below
    ctx.in_task = True
    try:
        _connect_for_the_cell(ctx, rendezvous)
        process_group.ensure_pool_group()
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # read-only message bytes, only ever read from
            bulk = torch.from_numpy(data) if data is not None else None
        result = _task_function(task)(ctx, meta, bulk)
        payload, buffer = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
        # a view of the rank's buffer: ipyparallel sends it before the engine runs anything else
        return ("done", payload, buffer.numpy() if isinstance(buffer, torch.Tensor) else buffer)
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel with its traceback
        return ("error", exception_info(ctx.rank, exc))
    finally:
        ctx.in_task = False
        if ctx.rank != 0:
            close_store()   # (rank 0's, the server, when every rank has ended: the kernel says so)
        if not show:
            sys.stdout.close()
        sys.stdout, sys.stderr = real_out, real_err
        import gc
        gc.collect()
