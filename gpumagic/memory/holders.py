"""Memory no notebook variable holds, and what holds it: a cache in a module, a thread's frame.

:func:`unnamed_tensors` finds the live tensors on a device whose storage no
variable reaches; :func:`who_holds` follows the garbage collector's referrers
from one of them up to something with a name (``mylib.cache``, ``sys.last_value``,
a running frame). Both read the whole heap, so they serve an explicit command
(``%gpumem --free``), never a per-cell path. Nothing here imports torch.
"""
from __future__ import annotations

import gc
import logging
import sys
import types
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["Unnamed", "unnamed_tensors", "who_holds"]

MAX_REFERRER_CALLS = 200   # each is a walk of the whole heap: a bound on the time naming may take


@dataclass
class Unnamed:
    """A storage on ``device`` that no variable reaches: its bytes and what holds it."""
    device: str
    nbytes: int
    holder: str


def _storage_key(t) -> tuple | None:
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr()) if storage.data_ptr() else None
    except Exception:  # a wrapper tensor without a storage is named by the variables' report, not here
        logger.debug("a %s has no storage to read", type(t).__name__, exc_info=True)
        return None


def unnamed_tensors(torch, device: str, known: set, most: int = 3) -> list[Unnamed]:
    """The ``most`` largest storages on ``device`` that live tensors hold and ``known`` (storage keys,
    ``(device, data_ptr)``) does not name, each with what holds one of its tensors."""
    by_key: dict[tuple, tuple[int, object]] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):
            continue
        key = _storage_key(obj)
        if key is None or key[0] != device or key in known or key in by_key:
            continue
        by_key[key] = (int(obj.untyped_storage().nbytes()), obj)
    largest = sorted(by_key.values(), key=lambda pair: -pair[0])[:most]
    by_key.clear()
    found = [Unnamed(device, nbytes, who_holds(t)) for nbytes, t in largest]
    del largest
    return found


def who_holds(obj, max_depth: int = 12) -> str:
    """A readable path to ``obj`` from something named: ``mylib.cache[0]``, ``sys.last_value``,
    ``<the running frame of loop (train.py:12)>.batch``; ``unknown`` where no path is found
    within bounds."""
    running = _running_frames()
    ignore = {id(sys._getframe())}
    queue: deque = deque([(obj, "", 0)])
    seen = {id(obj)}
    calls = 0
    while queue and calls < MAX_REFERRER_CALLS:
        target, path, depth = queue.popleft()
        calls += 1
        referrers = gc.get_referrers(target)
        ignore.add(id(referrers))
        for ref in referrers:
            if id(ref) in seen or id(ref) in ignore or _is_own(ref):
                continue
            step = _step(ref, target, path)
            named = _root_name(ref, target, running)
            if named is not None:
                return named + step
            if depth < max_depth:
                seen.add(id(ref))
                queue.append((ref, step, depth + 1))
        del referrers
    return "unknown"


def _running_frames() -> set[int]:
    """ids of the frames some thread is running now (a root: what they hold is in use)."""
    running: set[int] = set()
    for top in sys._current_frames().values():
        frame: types.FrameType | None = top
        while frame is not None:
            running.add(id(frame))
            frame = frame.f_back
    return running


def _is_own(ref) -> bool:
    """This module's own bookkeeping: the walk's frames and queue entries."""
    if type(ref) is types.FrameType:
        return ref.f_code.co_filename == __file__
    if type(ref) is deque:
        return True
    return type(ref) is tuple and len(ref) == 3 and type(ref[1]) is str and type(ref[2]) is int


def _root_name(ref, target, running: set[int]) -> str | None:
    """A name for ``ref`` where it is a module's namespace or a frame a thread is running."""
    if type(ref) is dict:
        for name, module in list(sys.modules.items()):
            if getattr(module, "__dict__", None) is ref:
                return name
        return None
    if type(ref) is types.FrameType and id(ref) in running:
        code = ref.f_code
        return f"<the running frame of {code.co_name} ({code.co_filename}:{ref.f_lineno})>"
    return None


def _key_of(d: dict, target) -> str | None:
    for key, value in list(d.items()):
        if value is target:
            return key
    return None


def _step(ref, target, path: str) -> str:
    """``path`` (from ``target`` down) with how ``ref`` reaches ``target`` in front of it."""
    if type(ref) is dict:
        key = _key_of(ref, target)
        if key is None:
            return path
        return (f".{key}" if isinstance(key, str) and key.isidentifier() else f"[{key!r}]") + path
    if issubclass(type(ref), (list, tuple)):
        index = next((i for i, item in enumerate(ref) if item is target), None)
        return (f"[{index}]" if index is not None else "") + path
    if type(ref) is types.FrameType:
        # a finished frame (a traceback's): its locals, named by the frame's function
        code = ref.f_code
        return f"<frame of {code.co_name} ({code.co_filename}:{ref.f_lineno})>" + path
    if type(ref) is types.TracebackType:
        return path
    try:
        attrs = object.__getattribute__(ref, "__dict__")
    except (AttributeError, TypeError):   # no __dict__ (slots, a builtin)
        return path
    key = _key_of(attrs, target) if type(attrs) is dict else None
    return (f".{key}" if isinstance(key, str) else "") + path
