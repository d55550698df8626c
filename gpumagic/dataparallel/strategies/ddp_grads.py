"""Gradients across ``%%dataparallel`` cells, as across plain cells.

A plain cell whose ``loss.backward()`` runs without ``opt.zero_grad()`` adds to
the ``.grad`` the previous cell left. So the kernel sends the notebook's
gradients of the trained modules with the cell (:func:`notebook_grads`), and
every rank starts from them (:func:`start_from`): rank 0's averaged gradients
came back into the notebook after the last cell, identical on every rank, and
DDP's average of ``g0 + g_rank`` is ``g0`` plus the average, which is what one
process adds on the whole batch. Rank 0's last gradients go back as before
(:mod:`.trained`).

With ``--strategy fsdp`` the gradients are sharded, and in launch mode the
framework owns them: there the notebook's are not carried, and a note says so.
"""
from __future__ import annotations

from ...display import note

__all__ = ["notebook_grads", "not_carried", "start_from"]


def notebook_grads(modules: dict) -> dict:
    """``{module name: {parameter name: grad}}`` for the trained modules whose parameters hold gradients."""
    grads = {}
    for name, module in modules.items():
        held = {k: p.grad for k, p in module.named_parameters() if p.grad is not None}
        if held:
            grads[name] = held
    return grads


def not_carried(modules: dict, how: str) -> dict:
    """Where a strategy cannot start from the notebook's gradients (``how``: why not), a note names the modules
    whose gradients stay behind; returns none to carry."""
    grads = notebook_grads(modules)
    if grads:
        note(f"%%dataparallel: the gradients on the parameters of {', '.join(grads)}, left by an earlier cell, are "
             f"not carried into this one ({how}): its first backward() starts from zero, where a plain cell would "
             "add to them (the same result where the cell calls zero_grad() before its first backward())")
    return {}


def start_from(inner: dict, grads: dict, tensors: list, store=None) -> list:
    """Give the rank's modules (``inner``, by name) the notebook's gradients; returns ``tensors`` (what the
    rank unpacked) less those gradients, which backward() now changes in place (or DDP replaces with its
    buckets), so the rank must not keep them for the next cell as the bytes the notebook holds; nor does
    ``store`` (the rank's :class:`~gpumagic.procs.tensor_cache.TensorStore`, which gave the unchanged ones)
    hold them through the cell."""
    taken: dict[int, object] = {}
    for name, held in grads.items():
        module = inner.get(name)
        if module is None:
            continue
        for key, p in module.named_parameters():
            g = held.get(key)
            if g is None or g.shape != p.shape:
                continue
            taken[id(g)] = g
            p.grad = g.to(device=p.device, dtype=p.dtype)
    if store is not None and taken:
        store.let_go(taken.values())
    return [t for t in tensors if id(t) not in taken]
