"""Which notebook values a ``%%sharedtrain`` cell changed in place, each worker in its own copy.

A worker's ``losses.append(loss.item())``, ``history["loss"].append(...)``,
``args.epoch = epoch`` or ``scheduler.step()`` changes the worker's copy: the
notebook's list, dict or object is as before the cell. What the cell *binds*
is named by the kernel from the code; changes in place, and what the notebook
functions it calls rebind (``global best_acc``), are found by comparing a cheap
fingerprint of each value before and after the cell, in the worker: the identities of a
container's items, a tensor's version counter, an object's attributes.
Tensors in shared memory (or on a GPU) are the notebook's own, and skipped.

In a notebook the kernel says what changed::

    %%sharedtrain --nprocs 2
    for x, y in loader:
        ...
        losses.append(loss.item())
    # note: changed in the workers only, each in its own copy ...: losses
"""
from __future__ import annotations

import argparse
import collections
import logging
import numbers
import types

import torch

from ..cell.values import is_stateful

logger = logging.getLogger(__name__)

__all__ = ["watched_names", "fingerprint", "changed_names", "snapshot"]

_CONTAINERS = (list, tuple, set, frozenset, dict, collections.deque, bytearray)
_NAMESPACES = (argparse.Namespace, types.SimpleNamespace)
_PLAIN = (numbers.Number, str, bytes)
_DEEP = 1000          # containers up to this many items are followed into them
_SHALLOW = 100_000    # up to this many, each item's identity is compared; beyond, the length and the ends
_DEPTH = 3


def _has_attributes(value, top: bool) -> bool:
    """An object whose attributes are its state: a namespace, an instance of a notebook class, a scheduler
    (at the top only: a third-party object's attributes may be caches that change when read)."""
    if isinstance(value, (type, types.ModuleType, types.FunctionType, torch.nn.Module, torch.optim.Optimizer,
                          torch.utils.data.DataLoader, torch.Tensor)):
        return False
    if isinstance(value, _NAMESPACES) or type(value).__module__ == "__main__":
        return isinstance(getattr(value, "__dict__", None), dict)
    return top and is_stateful(value) and isinstance(getattr(value, "__dict__", None), dict)


def watched_names(ns: dict, names: list[str]) -> list[str]:
    """Of ``names`` (notebook values the cell reads and does not bind itself), those whose changes would
    stay in the workers: containers, tensors not in shared memory, objects of attributes, and plain
    values a notebook function may rebind (``global best_acc``)."""
    from .sharing import travels_shared
    out = []
    for name in names:
        value = ns.get(name)
        if isinstance(value, torch.Tensor):
            if not travels_shared(value):
                out.append(name)
        elif isinstance(value, _CONTAINERS + _PLAIN) or value is None or _has_attributes(value, top=True):
            out.append(name)
    return out


def fingerprint(value, depth: int = _DEPTH, top: bool = True):
    """What changes when ``value`` is changed in place (compared with ``==``; never calls the value's ``__eq__``).

    Cheap on large values: a container of up to ``_DEEP`` items is followed into them, one of up to
    ``_SHALLOW`` gives each item's identity, a larger one its length and ends.
    """
    if isinstance(value, torch.Tensor):
        from .sharing import travels_shared
        if travels_shared(value):
            return ("shared", id(value))
        try:
            return ("tensor", id(value), value._version)
        except RuntimeError:   # an inference tensor keeps no version
            return ("tensor", id(value))
    if depth <= 0:
        return id(value)
    if isinstance(value, dict):
        if len(value) <= _DEEP:
            return ("dict", id(value), tuple((id(k), fingerprint(v, depth - 1, False)) for k, v in value.items()))
        if len(value) <= _SHALLOW:
            return ("dict", id(value), tuple(map(id, value)), tuple(map(id, value.values())))
        return ("dict", id(value), len(value))
    if isinstance(value, bytearray):
        return ("bytes", id(value), bytes(value) if len(value) <= _SHALLOW else len(value))
    if isinstance(value, (set, frozenset)):
        return ("set", id(value), frozenset(map(id, value)) if len(value) <= _SHALLOW else len(value))
    if isinstance(value, (list, tuple, collections.deque)):
        if len(value) <= _DEEP:
            return ("seq", id(value), tuple(fingerprint(v, depth - 1, False) for v in value))
        if len(value) <= _SHALLOW:
            return ("seq", id(value), tuple(map(id, value)))
        return ("seq", id(value), len(value), id(value[0]), id(value[-1]))
    if _has_attributes(value, top):
        attrs = vars(value)
        return ("object", id(value), fingerprint(dict(attrs), depth, False)[2:])
    return id(value)


def _safe_fingerprint(name: str, value):
    try:
        return fingerprint(value)
    except Exception:
        logger.debug("no fingerprint of %s", name, exc_info=True)
        return None


def snapshot(ns: dict, names: list[str]) -> dict:
    """Fingerprints of ``names`` in ``ns`` (the worker's copies, before the cell runs)."""
    return {name: _safe_fingerprint(name, ns[name]) for name in names if name in ns}


def changed_names(ns: dict, before: dict) -> list[str]:
    """The names in ``before`` whose value the cell changed: in place (the same object, other contents),
    or rebound or deleted by a notebook function it called (``global best_acc``)."""
    out = []
    for name, seen in before.items():
        if seen is None:
            continue   # unreadable before: nothing to compare
        if name not in ns or id(ns[name]) != _identity(seen) or _safe_fingerprint(name, ns[name]) != seen:
            out.append(name)
    return out


def _identity(seen) -> int:
    return seen[1] if isinstance(seen, tuple) else seen
