"""Notebook tensors and arrays a ``%%dataparallel`` cell changes without naming them in an item write.

``preds[idx] = out`` written in the cell is seen in its source (``items_assigned``);
written inside a notebook function the cell calls (``def fill(i, x): preds[i] = ...``),
or done by an in-place method (``buf.add_(1)``, ``np.copyto(arr, ...)``), it is not.
So rank 0 fingerprints the notebook tensors and numpy arrays the cell and the
functions it calls can reach before the cell runs (:func:`fingerprints`), and
compares after (:func:`changed`): what changed comes back into the notebook's
object in place, as the items set in the cell do (:mod:`.results`).

Runs in the workers: no IPython.
"""
from __future__ import annotations

import logging
import sys

from ..procs.returning import RETURN_LIMIT

logger = logging.getLogger(__name__)

__all__ = ["is_array", "fingerprint", "fingerprints", "changed"]


def is_array(value) -> bool:
    """A plain tensor or a numpy array (its contents can be given back to the notebook's in place)."""
    import torch
    numpy = sys.modules.get("numpy")
    return type(value) is torch.Tensor or (numpy is not None and type(value) is numpy.ndarray)


def _as_tensor(value):
    """A tensor over ``value``'s bytes (a numpy array's viewed, not copied, where contiguous); None for
    kinds torch has no dtype for (object, strings), or beyond what one cell brings back."""
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
        except TypeError:   # object, string, datetime arrays: not compared
            logger.debug("a numpy array of dtype %s is not compared", value.dtype)
            return None
    return t if t.numel() * t.element_size() <= RETURN_LIMIT else None


# Tensors larger than this (a dataset the cell reads) are judged by torch's version counter, which
# every in-place operation advances, instead of a pass over their bytes before and after each cell
# (about a second per GB on rank 0, on the way to the first step). Writes through ``.data`` or
# ``.numpy()`` do not advance it: for those, only tensors up to this size are seen.
READ_WHOLE_BYTES = 16 << 20


def fingerprint(value, read_whole: int = READ_WHOLE_BYTES):
    """The fingerprint of a tensor's or array's contents (dtype, shape and bytes, or the version counter of
    a tensor over ``read_whole`` bytes); None for what is not compared (:func:`_as_tensor`)."""
    try:
        return _fingerprint(value, read_whole)
    except Exception:   # a kind this cannot read (a big-endian array...): not compared, rather than fail the cell
        logger.debug("a %s is not compared", type(value).__name__, exc_info=True)
        return None


def _fingerprint(value, read_whole: int):
    from ..procs.tensor_cache import fingerprint_keys
    t = _as_tensor(value)
    if t is None:
        return None
    import torch
    if isinstance(value, torch.Tensor) and t.numel() * t.element_size() > read_whole \
            and not t.is_inference():
        return ("version", str(t.dtype), tuple(t.shape), value._version)   # (detach() shares the counter)
    return fingerprint_keys([t])[0]


def fingerprints(ns: dict, names: list[str]) -> dict:
    """``{name: (object, fingerprint)}`` for the tensors and arrays among ``names`` in ``ns``."""
    found = {}
    for name in names:
        value = ns.get(name)
        if is_array(value):
            key = fingerprint(value)
            if key is not None:
                found[name] = (value, key)
    return found


def changed(ns: dict, before: dict) -> list[str]:
    """The names of :func:`fingerprints` ``before`` whose object is still bound and whose contents changed."""
    out = []
    for name, (value, key) in before.items():
        if ns.get(name) is value and fingerprint(value) != key:
            out.append(name)
    return out
