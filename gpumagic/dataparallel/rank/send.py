"""What a rank sends back when its cell ended (:func:`packed_done`): its counts, and rank 0's answer packed.

Rank 0's :class:`~gpumagic.dataparallel.protocol.Returned` is packed by :mod:`gpumagic.procs.wire` (every
tensor on the CPU, in the bulk buffer the kernel reads from shared memory). A model the cell made that cannot
travel (one holding a lock) is left out, and named: what holds it cannot come back either.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import logging

from ...procs.wire import Packed, pack
from ..protocol import RankDone, Returned

__all__ = ["packed_done", "pack_returned", "all_on_cpu"]

logger = logging.getLogger(__name__)


def all_on_cpu(obj) -> dict:
    """``{id(tensor): "cpu"}`` for every tensor in ``obj``'s dicts, lists, tuples and dataclasses."""
    import dataclasses

    import torch
    targets: dict = {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            targets[id(o)] = "cpu"
        elif isinstance(o, dict):
            stack += list(o.values())
        elif isinstance(o, (list, tuple)):
            stack += list(o)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            stack += [getattr(o, f.name) for f in dataclasses.fields(o)]
    return targets


def pack_returned(returned: Returned, scratch) -> Packed:
    """``returned`` packed; the models the cell made that cannot travel are dropped, with why."""
    try:
        return pack(returned, targets=all_on_cpu(returned), fingerprint=False, scratch=scratch)
    except Exception:
        if not returned.changes.made:
            raise
        logger.debug("models made in the cell could not be packed", exc_info=True)
    made = returned.changes.made
    for key, model in list(made.items()):
        try:
            pack({"model": model}, targets=all_on_cpu(model), fingerprint=False)
        except Exception as exc:  # noqa: BLE001 - named in the cell's note, with the reason
            returned.changes.made_failed[key] = f"{type(exc).__name__}: {exc}"
            del made[key]
    return pack(returned, targets=all_on_cpu(returned), fingerprint=False, scratch=scratch)


def packed_done(cell, returned: Returned | None, prefix_only: bool = False):
    """``(RankDone, buffer)`` for ``cell``: rank 0's ``returned`` packed into the rank's outgoing buffer."""
    done = RankDone(cell.stats, cell.started, cell.ended, cell.keys)
    if returned is None:
        return done, None
    packed = pack_returned(returned, None if prefix_only else cell.ctx.outgoing)
    done.returned, done.returned_bytes = packed.header, packed.nbytes
    return done, packed.data()
