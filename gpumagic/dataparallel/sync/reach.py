"""What rank 0 watches of the notebook for the way back, and how far: the rules the snapshot walks by.

From each name the cell reads, rank 0 goes :data:`DEPTH` levels down through

* lists and dicts (a ``defaultdict``, an ``OrderedDict``): their items, where they hold at most
  :data:`WALKED_ITEMS` (a longer one, a history of every step, is compared by the identity of its items,
  up to :data:`COMPARED_ITEMS`; past that, only whether its length or last item changed, for the note);
* instances of the notebook's classes and namespaces (``argparse.Namespace``, ``SimpleNamespace``): their
  public attributes (:func:`is_watched`);

and takes a fingerprint of each tensor and numpy array it meets (:func:`fingerprint`). Anything else (a
library's object, a dataset) is the notebook's own object, found by its path, and not looked into.

Runs on rank 0 and in the kernel (which names in the note what these rules do not bring back): no IPython.
"""
from __future__ import annotations

import argparse
import collections
import logging
import sys
import types

from ...procs.returning import RETURN_LIMIT

logger = logging.getLogger(__name__)

__all__ = ["KINDS", "DEPTH", "WALKED_ITEMS", "COMPARED_ITEMS", "READ_WHOLE_BYTES", "is_container", "is_watched",
           "is_array", "children", "fingerprint", "UNKNOWN", "comes_back"]

# What is compared item by item and refilled in place, keeping its type (a defaultdict its default_factory).
# (Other dict subclasses, a ModelOutput or an EasyDict, may refuse or redefine ``clear``/``update``.)
KINDS = (list, dict, collections.defaultdict, collections.OrderedDict)
DEPTH = 3                       # levels below a name the cell reads
WALKED_ITEMS = 10_000           # a list or dict of at most this many items is looked into
COMPARED_ITEMS = 1_000_000      # one of at most this many is compared, by the identity of its items
# Tensors larger than this (a dataset the cell reads) are judged by torch's version counter, which every
# in-place operation advances, instead of a pass over their bytes before and after each cell (about a
# second per GB on rank 0, on the way to the first step). Writes through ``.data`` or ``.numpy()`` do not
# advance it: for those, only tensors up to this size are seen.
READ_WHOLE_BYTES = 16 << 20


def is_container(value) -> bool:
    """A list or dict rank 0 compares item by item (of at most :data:`COMPARED_ITEMS`)."""
    return type(value) in KINDS and len(value) <= COMPARED_ITEMS


def is_watched(value) -> bool:
    """An instance of the notebook's classes, or a namespace: every public attribute a cell changes comes back."""
    cls = type(value)
    return isinstance(getattr(value, "__dict__", None), dict) and (
        cls.__module__ == "__main__" or cls in (argparse.Namespace, types.SimpleNamespace))


def is_array(value) -> bool:
    """A plain tensor or a numpy array (its contents can be given back to the notebook's in place)."""
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    return (torch is not None and type(value) is torch.Tensor) or (numpy is not None and type(value) is numpy.ndarray)


def children(value) -> list[tuple[tuple, object]]:
    """``[(step, child)]`` the walk goes into from ``value`` (see the module's docstring)."""
    if type(value) in KINDS and len(value) <= WALKED_ITEMS:
        return [(("item", k), v) for k, v in (value.items() if isinstance(value, dict) else enumerate(value))]
    if is_watched(value):
        return [(("attr", k), v) for k, v in vars(value).items() if not k.startswith("_")]
    return []


def _as_tensor(value):
    """A tensor over ``value``'s bytes (a numpy array's viewed, not copied, where contiguous); None for kinds
    torch has no dtype for (object, strings), or beyond what one cell brings back."""
    import torch
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:   # (meta: no contents)
            return None
        if (t.is_conj() or t.is_neg()) and t.numel() * t.element_size() <= READ_WHOLE_BYTES:
            t = t.resolve_conj().resolve_neg()   # lazy views (``x.conj()``): their contents (larger: by version)
    else:
        import numpy
        if value.dtype.hasobject or value.nbytes > RETURN_LIMIT:   # before any copy of a strided one
            return None
        try:
            t = torch.from_numpy(numpy.ascontiguousarray(value))
        except TypeError:   # datetime arrays and the like: not compared
            logger.debug("a numpy array of dtype %s is not compared", value.dtype)
            return None
    return t if t.numel() * t.element_size() <= RETURN_LIMIT else None


def fingerprint(value, read_whole: int = READ_WHOLE_BYTES):
    """The fingerprint of a tensor's or array's contents (dtype, shape and bytes, or the version counter of a
    tensor over ``read_whole`` bytes); None for what is not compared."""
    try:
        t = _as_tensor(value)
        if t is None:
            return None
        import torch

        from ...procs.tensor_cache import fingerprint_keys
        if isinstance(value, torch.Tensor) and t.numel() * t.element_size() > read_whole and not t.is_inference():
            return ("version", str(t.dtype), tuple(t.shape), value._version)   # (detach() shares the counter)
        return fingerprint_keys([t])[0]
    except Exception:  # a kind this cannot read (a big-endian array...): not compared
        logger.debug("a %s is not compared", type(value).__name__, exc_info=True)
        return None


UNKNOWN = object()   # an item key the cell's code computes: any of the items


def comes_back(ns: dict, root: str, steps: list, trained: set[int]) -> bool:
    """Whether a write the cell's code makes through ``root`` and ``steps`` comes back by these rules
    (``[("item", "box"), ("attr", "size")]`` for ``root["box"].size = ...``, the last step the one written;
    an item key the code computes is :data:`UNKNOWN`, standing for every item): it must write into a list,
    dict or watched object rank 0 reaches, a tensor or array (filled in place), a module the cell trains
    (its attributes come back with it), or something the cell adds (it comes back whole)."""
    candidates = [ns.get(root)]
    for depth, (kind, key) in enumerate(steps):
        below = []
        for value in candidates:
            if value is None or id(value) in trained:
                continue
            if depth == len(steps) - 1:
                if not (is_array(value) or (is_container(value) if kind == "item" else is_watched(value))):
                    return False
            elif depth >= DEPTH or not (type(value) in KINDS and len(value) <= WALKED_ITEMS or is_watched(value)):
                return False
            elif kind == "attr":
                below.append(vars(value).get(key))
            else:
                below += [v for k, v in children(value) if key is UNKNOWN or k[1] == key]
        candidates = below
    return True
