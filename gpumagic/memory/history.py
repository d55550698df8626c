"""IPython's output history, which keeps every displayed result alive: ``Out``, ``_``, ``__``, ``___``, ``_N``.

A cell that ends with a tensor (``model(x)``, ``w[:10]``) leaves it in ``Out[n]``
and ``_n`` for the rest of the session; re-running such a cell keeps one more each
time. :func:`tensor_entries` lists the entries that reach tensor storage and
:func:`drop_entries` lets them go, everywhere IPython keeps them. Nothing here
imports torch.
"""
from __future__ import annotations

import logging

from .storages import Collector

logger = logging.getLogger(__name__)

__all__ = ["tensor_entries", "drop_entries"]

_UNDERS = ("_", "__", "___")


def tensor_entries(torch, history: dict | None, skip: frozenset[int] = frozenset()) -> dict[int, int]:
    """``{n: bytes}`` for each ``Out[n]`` that reaches tensor storage (each storage counted once per entry)."""
    found: dict[int, int] = {}
    if torch is None or not history:
        return found
    for n, value in list(history.items()):
        collector = Collector(torch, 6, 100_000, skip=skip)
        try:
            collector.walk(value)
        except Exception:  # an odd object in the history is left alone, not guessed at
            logger.debug("reading Out[%s] for tensors failed", n, exc_info=True)
            continue
        held = {**collector.via_graph, **collector.via_optimizer, **collector.storages}
        if held:
            found[n] = sum(nbytes for _, nbytes, _ in held.values())
    return found


def drop_entries(shell, numbers) -> list[str]:
    """Remove ``Out[n]`` for each n in ``numbers``, with ``_n`` and whichever of ``_``, ``__``, ``___``
    is one of them; returns the names let go (``Out[4]``, ``_4``, ``_``)."""
    ns = shell.user_ns
    history = ns.get("Out")
    if not isinstance(history, dict):
        return []
    dropped: list[str] = []
    values = []
    for n in sorted(numbers):
        if n not in history:
            continue
        values.append(history.pop(n))
        dropped.append(f"Out[{n}]")
        for space in (ns, shell.user_ns_hidden):
            if space.get(f"_{n}") is values[-1]:
                del space[f"_{n}"]
                if space is ns:
                    dropped.append(f"_{n}")
    hook = getattr(shell, "displayhook", None)
    for name in _UNDERS:
        for space in (ns, shell.user_ns_hidden):   # pushed as IPython's own names: in both
            if any(space.get(name) is v for v in values):
                space[name] = ""
                if space is ns:
                    dropped.append(name)
        if hook is not None and any(getattr(hook, name, None) is v for v in values):
            setattr(hook, name, "")   # the display hook's own copies, from which it fills `_` again
    return dropped
