"""``--strategy fsdp``: sharded tensors among the cell's values, made whole before they come back.

Under FSDP the cell's parameters are ``DTensor`` shards, and so is much of what the
cell computes from them: ``clip_grad_norm_``'s total norm, ``model.state_dict()``,
``w = model.fc.weight``, ``model.fc.weight.sum()``. Such a value means nothing in the
kernel: its mesh is the workers' process group, and any use of it there (even
copying it) fails. So, on every rank, before rank 0 packs what comes back, each
``DTensor`` held by a value the cell bound (or by its last expression, through
lists, tuples and dicts) is replaced by the whole tensor: ``to_local()`` where
every rank holds it whole already, else ``full_tensor()``, a collective every rank
joins in the same order. Rank 0 keeps the whole tensor, on the CPU; the other ranks
let it go.

Every rank ran the same cell, so every rank finds the same tensors; code that
bound different ones on different ranks (``if rank == 0: ...``) is found by
comparing the ranks' lists first, and those values are named as not brought back
rather than gathered (a collective some ranks skipped would hang). Gathering
stops at what one cell brings back (:data:`~gpumagic.procs.returning.RETURN_LIMIT`): a larger
value (a big model's whole ``state_dict()``) is named instead, before any rank
holds it whole.

Runs in the workers: no IPython.
"""
from __future__ import annotations

from typing import Any

from ...procs.returning import RETURN_LIMIT

__all__ = ["whole_values", "VALUE"]

VALUE = "<the cell's last expression>"


def _found(obj, path: tuple, out: list, depth: int = 0) -> None:
    """The ``DTensor`` leaves of ``obj`` through lists, tuples and dicts, with their paths."""
    from torch.distributed.tensor import DTensor
    if isinstance(obj, DTensor):
        out.append((path, obj))
    elif depth < 6 and isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _found(v, (*path, i), out, depth + 1)
    elif depth < 6 and isinstance(obj, dict):
        for k, v in obj.items():
            _found(v, (*path, k), out, depth + 1)


def _replaced(obj, path: tuple, new):
    """``obj`` with the leaf at ``path`` replaced by ``new``; containers rebuilt, keeping their types."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        obj[head] = _replaced(obj[head], rest, new)
        return obj
    items = list(obj)
    items[head] = _replaced(items[head], rest, new)
    if isinstance(obj, list):
        obj[:] = items   # the same list: a name bound to it elsewhere in the cell sees the same
        return obj
    from ...cell.values import same_tuple_type
    return same_tuple_type(obj, items)


def _needs_gather(t) -> bool:
    from torch.distributed.tensor import Replicate
    return not all(isinstance(p, Replicate) for p in t.placements)


def whole_values(ctx, ns: dict, names: list[str], value) -> tuple[Any, list[str]]:
    """On every rank: the ``DTensor`` values among ``ns[names]`` and ``value`` made whole (see the module's
    docstring). Returns the last expression's value and, on rank 0, what was not brought back, with why;
    names not brought back are removed from ``ns``."""
    import torch
    import torch.distributed as dist
    roots = {name: ns[name] for name in names if name in ns}
    roots[VALUE] = value
    found: list = []
    for name, obj in roots.items():
        _found(obj, (name,), found)
    # what each rank would gather, to be sure all of them do it alike
    mine = [(path, tuple(t.shape), str(t.dtype), tuple(map(str, t.placements))) for path, t in found
            if _needs_gather(t)]
    everyone: list = [None] * ctx.world_size
    if ctx.world_size > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    # by name: a value bound differently on some rank is left out; the others are gathered in the same order
    by_rank = [{name: [e for e in entries if e[0][0] == name] for name in {e[0][0] for e in entries}}
               for entries in everyone]
    names_seen = set().union(*by_rank)
    dropped = {name: "holds sharded tensors that differ between the ranks" for name in names_seen
               if any(r.get(name) != by_rank[0].get(name) for r in by_rank)}
    budget = RETURN_LIMIT
    for path, shape, dtype, _ in mine:
        name = path[0]
        if name in dropped:
            continue
        size = torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, dtype.removeprefix("torch."))) \
            .element_size()
        budget -= size
        if budget < 0:
            dropped[name] = (f"holds sharded tensors larger than a cell brings back ({RETURN_LIMIT >> 20} MB): "
                             "gather what you need with .full_tensor(), or save it with "
                             "torch.distributed.checkpoint")
    rank0 = ctx.rank == 0
    with torch.no_grad():
        for path, t in found:
            if path[0] in dropped:
                continue
            whole = t.full_tensor() if _needs_gather(t) else t.to_local()
            roots[path[0]] = _replaced(roots[path[0]], path[1:], whole.detach().cpu() if rank0 else None)
    for name in dropped:
        roots.pop(name, None)
        ns.pop(name, None)
    for name, obj in roots.items():
        if name != VALUE:
            ns[name] = obj
    if VALUE in dropped:
        from ..protocol import RemoteRepr
        value = RemoteRepr(f"<not brought back: the value {dropped[VALUE]}>")
    else:
        value = roots[VALUE]
    return value, [f"{name} ({why})" for name, why in dropped.items() if name != VALUE] if rank0 else []
