"""Trained state that only the workers hold, and what may not happen to it silently.

Two kinds of ``--strategy fsdp`` state live in the workers alone: a model on the
``meta`` device (its weights are the ranks' shards) and optimizer state left
there by ``--keep-optimizer``. Whatever ends the workers ends that state. So:

* a cell that would start other workers (``--nprocs``, ``--devices``,
  ``--backend``, ``--timeout`` changed) is refused before anything starts;
* a cell that would train such an object without FSDP is refused (the notebook's
  copy is a meta model, or optimizer state older than the workers');
* when the workers end anyway (a failed cell, ``%dataparallel stop``, a worker
  that died), a note says what was lost with them, once.

In a notebook::

    %%dataparallel --strategy fsdp --keep-optimizer
    ...                                    # trains model (on meta) and opt in the workers
    %dataparallel stop                     # notes: model's weights and opt's state are gone
"""
from __future__ import annotations

import weakref

from ...display import note
from ...errors import usage_error

__all__ = ["keep", "held_names", "check_cell", "lost"]

# notebook name -> (the object, the ranks whose workers hold its state)
_held: dict[str, tuple[weakref.ref, weakref.ref]] = {}


def keep(ranks, stayed: list[str], trained: list[str], ns: dict) -> None:
    """After an fsdp cell on ``ranks``: of the ``trained`` names, ``stayed`` (bound in ``ns``) are held by
    its workers alone now; what an earlier cell left there (another model) stays held too."""
    if any(ref_ranks() is not ranks for _, ref_ranks in _held.values()):
        _held.clear()   # other workers: what they held is gone (said when that was found)
    for name in trained:
        _held.pop(name, None)
    for name in stayed:
        if name in ns:
            _held[name] = (weakref.ref(ns[name]), weakref.ref(ranks))


def held_names(ns: dict) -> list[str]:
    """The names whose state only the workers hold, that still name the same object in ``ns``."""
    return [name for name, (ref, _) in _held.items() if ns.get(name) is not None and ns.get(name) is ref()]


def _kind(name: str, ns: dict) -> str:
    import torch
    return f"{name}'s weights" if isinstance(ns.get(name), torch.nn.Module) else f"{name}'s state"


def _listing(names: list[str], ns: dict) -> str:
    return ", ".join(_kind(n, ns) for n in names)


def _pool_line(ranks) -> str:
    devices = [str(d) for d in ranks.devices]
    if all(d == "cpu" for d in devices):
        return f"--devices cpu --nprocs {len(devices)}"
    return "--devices " + ",".join(d.split(":")[-1] for d in devices)


def check_cell(ns: dict, used: set, strategy, ranks, same_workers: bool) -> None:
    """Before a cell: refuse what would lose or ignore state only the workers hold; note what was lost.

    ``ranks`` are this machine's ranks now (:class:`~..ranks.local.LocalRanks`, or None); ``same_workers``,
    whether the cell's plan runs on them as they are; ``strategy`` the cell's."""
    names = held_names(ns)
    if not names:
        _held.clear()
        return
    holder = _held[names[0]][1]()
    if holder is None or not holder.alive or holder is not ranks:
        lost("their workers ended", ns)
        return
    if not same_workers:
        raise usage_error(
            f"this cell would start new workers, and only the current ones hold {_listing(names, ns)} "
            f"({'on the meta device' if any(_kind(n, ns).endswith('weights') for n in names) else '--keep-optimizer'}"
            f"): run it on the same ranks ({_pool_line(holder)}), or save them from a --strategy fsdp cell "
            "(torch.distributed.checkpoint) and let them go with %dataparallel stop",
            [_pool_line(holder), "%dataparallel stop"])
    trained_here = [n for n in names if n in used]
    if not strategy.holds_state and trained_here:
        raise usage_error(
            f"only the workers hold {_listing(trained_here, ns)} (from a --strategy fsdp cell); this cell "
            f"would train the notebook's copy instead, "
            f"{'a model on the meta device' if _kind(trained_here[0], ns).endswith('weights') else 'which is older'}"
            ": continue with --strategy fsdp, or run a --strategy fsdp cell without --keep-optimizer to bring "
            "an optimizer's state back first", ["--strategy fsdp"])


def lost(why: str, ns: dict | None = None) -> None:
    """The workers dropped what they alone held: say what, once (``why``: what ended them)."""
    names = held_names(ns) if ns is not None else [n for n, (ref, _) in _held.items() if ref() is not None]
    _held.clear()
    if names:
        note(f"%%dataparallel: {_listing(names, ns or {})} lost: only the workers held them (--strategy fsdp), "
             f"and {why}. In the next cell a model on the meta device starts again from its initialisation, an "
             "optimizer from the notebook's older state; save such state from a cell "
             "(torch.distributed.checkpoint) to keep it")
