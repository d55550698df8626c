"""While a ``%%dataparallel`` cell runs, what the notebook's objects hold of a trained module or a split loader is
the rank's stand-in for it (:func:`held_objects_swapped`).

Runs in the workers: no IPython.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ...cell.names import held_slots

__all__ = ["held_objects_swapped"]


@contextmanager
def held_objects_swapped(ns: dict, swaps: dict) -> Iterator[None]:
    """While the cell runs, notebook objects that hold a trained module or a split loader (a trainer
    class's ``self.model``, ``self.loader``; further down, ``self.parts.model``, ``self.nets["g"]``,
    ``self.models[0]``: see :func:`~gpumagic.cell.names.held_slots`) hold the cell's wrapper of it or
    the rank's share instead (``swaps``: id of the original -> (original, stand-in)): called through
    ``self.model`` the module would skip DDP, and its gradients would not be averaged. Each
    place the cell did not rebind is put back afterwards, before anything is compared or sent."""
    done = []
    for value in list(ns.values()):
        # (only the notebook's own objects; a module's parts are its own)
        for container, key, held in list(held_slots(value, ns)):
            swap = swaps.get(id(held))
            if swap is not None and swap[0] is held:
                container[key] = swap[1]
                done.append((container, key, held, swap[1]))
    try:
        yield
    finally:
        for container, key, held, stand_in in done:
            _put_back(container, key, held, stand_in)


def _put_back(container, key, held, stand_in) -> None:
    """``held`` where ``stand_in`` still is: at ``key``, or, in a list the cell reordered, where it went."""
    if isinstance(container, dict):
        if container.get(key, None) is stand_in:
            container[key] = held
        return
    if key < len(container) and container[key] is stand_in:
        container[key] = held
        return
    for i, item in enumerate(container):
        if item is stand_in:
            container[i] = held
