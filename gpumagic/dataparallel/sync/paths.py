"""Where an object is in the notebook (a :data:`~gpumagic.dataparallel.protocol.Path`), and finding it there.

A path is a name and steps: ``("cfg", ("attr", "optim"))`` is ``cfg.optim``, ``("held", ("item", "outs"))``
``held['outs']``, ``("model", ("layer", "fc"))`` the layer ``model.fc``. Rank 0 names objects by the path
they had as the cell started; the kernel finds its own objects at the same paths.

In a notebook::

    follow(get_ipython().user_ns, ("cfg", ("attr", "optim")))     # cfg.optim
"""
from __future__ import annotations

import logging

__all__ = ["MISSING", "follow", "item_at", "text", "owner_text"]

logger = logging.getLogger(__name__)


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def item_at(container, key):
    """``container[key]`` for a dict (without making an item: a defaultdict's missing key is missing) or a
    list; :data:`MISSING` where there is none."""
    if isinstance(container, dict):
        return container[key] if key in container else MISSING
    if isinstance(container, (list, tuple)) and isinstance(key, int) and -len(container) <= key < len(container):
        return container[key]
    return MISSING


def _attribute(value, name: str):
    own = getattr(value, "__dict__", None)
    if isinstance(own, dict) and name in own:
        return own[name]
    try:
        return getattr(value, name)
    except Exception:  # noqa: BLE001 - any attribute may raise: not there
        return MISSING


def _layer(module, dotted: str):
    try:
        return module.get_submodule(dotted)
    except (AttributeError, TypeError):   # (rank 0 had that layer; the notebook's module took rank 0's)
        logger.debug("no layer %s", dotted, exc_info=True)
        return MISSING


def follow(ns: dict, path: tuple):
    """The object at ``path`` in the namespace ``ns``; :data:`MISSING` where a step is missing."""
    value = ns.get(path[0], MISSING)
    for kind, key in path[1:]:
        if value is MISSING:
            return MISSING
        value = _attribute(value, key) if kind == "attr" else item_at(value, key) if kind == "item" else \
            _layer(value, key)
    return value


def text(path: tuple) -> str:
    """``path`` as the notebook would write it: ``held['outs'].val``."""
    out = str(path[0])
    for kind, key in path[1:]:
        out += f"[{key!r}]" if kind == "item" else f".{key}"
    return out


def owner_text(path: tuple) -> str:
    """What the cell's note names for a change at ``path``: the path up to its first item (``held['outs']``
    is held's change, ``rec.outs[0]`` rec.outs')."""
    cut = next((i for i, (kind, _) in enumerate(path[1:], 1) if kind == "item"), len(path))
    return text(path[:cut])
