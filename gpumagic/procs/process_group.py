"""A worker's ``torch.distributed`` process group: formed at start-up, given way to, formed again.

:func:`join` forms the pool's group when a worker starts, in the store its
rendezvous names (:mod:`.rendezvous`), and connects every pair with a first
collective, so that the user's first step does not pay for it.

Code written for ``torchrun`` may find that group already there (frameworks
check ``is_initialized()`` first) or call ``init_process_group`` itself. For
the second, :func:`join` makes ``init_process_group`` keep the pool's group
where the call asks for that group (``env://``, the launch's world size and
rank, the pool's backend), and ``destroy_process_group`` leave it for the
next cell; a call that asks for another group gets it, as in a fresh
``torchrun`` process, the pool's given up first. :func:`ensure_pool_group`,
at the start of every task, forms the pool's group again wherever a cell
left another one.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import datetime
import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["join", "ensure_pool_group", "is_pool_group", "leave"]

_state: dict[str, Any] = {}   # this process's: config, store, group, generation


def join(config, store=None) -> None:
    """Form the pool's process group for ``config`` (a :class:`~.worker.WorkerConfig`), in ``store``
    or the one its rendezvous names."""
    from .rendezvous import connect
    if store is None:
        if config.rendezvous is None:
            raise RuntimeError("a process group needs a rendezvous")
        store = connect(config.rendezvous, config.world_size)
    # a new store holds no keys: every rank starts its groups' names afresh, wherever it was before
    _state.update(config=config, store=store, generation=0)
    _form()
    _give_way_to_user_init()


def is_pool_group() -> bool:
    """Whether the default process group is the one :func:`join` formed."""
    import torch.distributed as dist
    return bool(_state) and dist.is_initialized() and dist.group.WORLD is _state.get("group")


def ensure_pool_group() -> bool:
    """Form the pool's group again if a cell destroyed it or left its own; returns whether it did.

    Every rank calls this at the start of the same task, so they form it together.
    """
    import torch.distributed as dist
    if not _state or is_pool_group():
        return False
    if dist.is_initialized():
        logger.debug("a cell left its own process group; forming the pool's again")
        _state.get("original_destroy", dist.destroy_process_group)()
    _state["generation"] += 1
    _form()
    return True


def leave() -> None:
    """Destroy whatever process group this worker has, the pool's included (the worker is leaving)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        _state.get("original_destroy", dist.destroy_process_group)()


def _form() -> None:
    import torch
    import torch.distributed as dist
    config = _state["config"]
    store: Any = _state["store"]
    if _state["generation"]:
        # The store still holds the keys of the group formed before: start afresh under a prefix.
        store = dist.PrefixStore(f"gpumagic-group-{_state['generation']}", store)
    kwargs = {}
    nccl = config.device.startswith("cuda") and config.backend == "nccl"
    if nccl:
        kwargs["device_id"] = torch.device(config.device)
    timeout = datetime.timedelta(seconds=config.timeout)
    init = _state.get("original_init", dist.init_process_group)
    try:
        init(config.backend, store=store, rank=config.rank, world_size=config.world_size,
             timeout=timeout, **kwargs)
    except TypeError:  # a torch without device_id
        init(config.backend, store=store, rank=config.rank, world_size=config.world_size, timeout=timeout)
    # A first collective connects every pair now rather than in the user's first step.
    if nccl:
        t = torch.ones(1, device=config.device)
        dist.all_reduce(t)
        torch.cuda.synchronize()
    else:
        dist.barrier()
    _state["group"] = dist.group.WORLD


def _same_as_pool(call: dict) -> bool:
    """Whether an ``init_process_group`` call asks for the group the pool has: torchrun's default
    rendezvous (``env://``), this launch's world size and rank, and the pool's backend (or none)."""
    config = _state["config"]
    backend = call.get("backend")
    return (call.get("store") is None and call.get("init_method") in (None, "env://")
            and call.get("world_size", -1) in (-1, None, config.world_size)
            and call.get("rank", -1) in (-1, None, config.rank)
            and (backend is None or str(backend).lower() == config.backend))


def _give_way_to_user_init() -> None:
    """``init_process_group`` in a cell: the pool's group where it asks for that group, else the pool's
    group is given up first (never a user's own); ``destroy_process_group`` keeps the pool's group.

    Why keep it: code written for torchrun forms the group at its start and destroys it at its end,
    and a framework finds it formed; forming and destroying gloo and NCCL groups cell after cell
    costs seconds, and a gloo group destroyed under a DDP object the cell still holds can block
    the collection of that object on every rank.
    """
    import inspect

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    if "original_init" in _state:
        return
    original = _state["original_init"] = c10d.init_process_group
    original_destroy = _state["original_destroy"] = c10d.destroy_process_group
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if is_pool_group():
            try:
                call = signature.bind(*args, **kwargs).arguments
            except TypeError:
                call = None   # let torch's own function say what is wrong with the call
            if call is not None and _same_as_pool(call):
                return None
            original_destroy()
        return original(*args, **kwargs)

    @functools.wraps(original_destroy)
    def destroy_process_group(group=None):
        if (group is None or group is dist.group.WORLD) and is_pool_group():
            return None   # the pool's: the next cell finds it as this one did
        return original_destroy(group)

    # Both names: code imports them from either module, before or after this runs.
    c10d.init_process_group = dist.init_process_group = init_process_group
    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group
