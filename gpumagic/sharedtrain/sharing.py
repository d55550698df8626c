"""Putting the notebook's model in shared memory, and what else Hogwild workers share.

Tensors already in shared memory (or on a GPU) are shared with the workers;
everything else a worker sees is its own copy. :func:`share_modules` moves a
model's CPU parameters and buffers into shared memory in place, raising the
open-file limit or switching torch's sharing strategy where the number of
tensors needs it (:func:`plan_sharing`).
"""
from __future__ import annotations

import itertools
import logging
import os
import resource

import torch

logger = logging.getLogger(__name__)

__all__ = ["plan_sharing", "share_modules", "travels_shared", "match_optimizer_devices", "private_state",
           "share_optimizer_state"]


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
        return strategy, target, (f"raised this kernel's open-file limit from {soft} to {target} "
                                  f"for {new_storages} shared tensors")
    return "file_system", None, (
        f"the open-file limit ({hard}) is too low to share {new_storages} tensors by file descriptor; "
        f"using torch's file_system sharing strategy for this kernel instead. To keep file descriptors, "
        f"start Jupyter with a higher limit (ulimit -n {2 * need}).")


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr(), t.device.type
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage: its own
        return id(t), t.device.type


def _module_tensors(modules: dict) -> list:
    seen, out = set(), []
    for m in modules.values():
        for t in itertools.chain(m.parameters(), m.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def share_modules(modules: dict, notes: list) -> str:
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
    from ..errors import usage_error
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


def travels_shared(obj) -> bool:
    """Whether a tensor reaches the workers shared rather than copied: on a GPU, or in shared memory."""
    try:
        return obj.device.type == "cuda" or obj.is_shared()
    except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
        return False


def share_optimizer_state(name: str, optimizer, on_gpu: bool) -> str:
    """Say which of ``optimizer``'s state all workers update and which each worker has its own; returns the note.

    Where every state tensor with elements is already in shared memory (the A3C ``SharedAdam``
    pattern), its 0-d tensors (Adam's ``step``) are put there too, in place: such code shares
    ``step`` with the moments, and Adam's bias correction must count the steps taken on them.
    On a GPU each worker's state is its own copy (see :func:`private_state`).
    """
    values: dict[str, list] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            values.setdefault(str(key), []).append(value)
    tensors = [v for vs in values.values() for v in vs if isinstance(v, torch.Tensor)]
    own_copy = (f"{name!r}: each worker steps its own copy ({type(optimizer).__name__}, state as in the "
                "notebook) over the shared weights; the notebook's optimizer is left as it was")
    if on_gpu or not any(travels_shared(v) for v in tensors):
        return own_copy
    moved = []
    if all(travels_shared(v) for v in tensors if v.dim() > 0):
        for key, vs in values.items():
            scalars = [v for v in vs if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu"]
            if any(not v.is_shared() for v in scalars):
                for v in scalars:
                    v.share_memory_()
                moved.append(key)
    shared = [k for k, vs in values.items() if all(isinstance(v, torch.Tensor) and travels_shared(v) for v in vs)]
    own = [k for k in values if k not in shared]
    if not own:
        note = f"{name!r}: its state ({', '.join(shared)}) is in shared memory, so all workers update one state"
        if moved:
            others = [k for k in shared if k not in moved]
            note += (f" ({', '.join(moved)} put there too, as {', '.join(others)} "
                     f"{'is' if len(others) == 1 else 'are'})" if others else "")
        return note
    return (f"{name!r}: its {', '.join(shared)} {'is' if len(shared) == 1 else 'are'} in shared memory, one for "
            f"all workers; its {', '.join(own)} {'is' if len(own) == 1 else 'are'} per worker, each its own copy")


def match_optimizer_devices(optimizer) -> None:
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    stale = any(isinstance(v, torch.Tensor) and v.dim() > 0 and v.device != p.device
                for p in params.values() for v in optimizer.state.get(p, {}).values())
    if stale:
        optimizer.load_state_dict(optimizer.state_dict())  # casts state to each parameter's device


def private_state(optimizer) -> None:
    """Copy an optimizer's state: CUDA tensors always arrive shared, the state must not."""
    for state in optimizer.state.values():
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor):
                state[key] = value.clone()
