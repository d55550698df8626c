"""Looking up torch names for the placement rewrite, without importing anything.

:func:`lookup` finds the object a dotted torch name refers to in the modules
already imported; :func:`takes_device` tells whether an ``nn`` module class
accepts ``device=`` (so that the rewrite can pass it).
"""
from __future__ import annotations

import sys
from functools import lru_cache

__all__ = ["lookup", "takes_device"]


def lookup(dotted: str):
    """The object a dotted torch name refers to, or None (imports nothing)."""
    parts = dotted.split(".")
    obj = sys.modules.get(parts[0])
    for part in parts[1:]:
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


def takes_device(dotted: str) -> bool:
    """True for a ``torch.nn`` module class whose constructor accepts ``device=``."""
    if "torch" not in sys.modules:
        return False   # not cached: torch may be imported later
    return _class_takes_device(dotted)


@lru_cache(maxsize=512)
def _class_takes_device(dotted: str) -> bool:
    torch = sys.modules["torch"]
    cls = lookup(dotted)
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        return False
    import inspect
    for klass in cls.__mro__:
        if klass is torch.nn.Module:
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):
            return False
        if "device" in params:
            return True
        # ``LSTM(*args, **kwargs)`` hands everything to its base; keep looking there.
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return False
    return False
