"""Lists and dicts too long to copy each cell, compared by the identity of their items.

A history of every step (``self.losses.append(loss.item())`` on a list of 200,000 floats, ``history[step] =
loss``) is not copied before a ``%%dataparallel`` cell as a shorter one is (:mod:`.containers`): rank 0 keeps
its items' references (:class:`Shallow`) and, after the cell, finds the items at its head and at its tail
that are still the same objects under the same keys. What lies between is described item by item, as
:mod:`.containers` describes a shorter list; the rest, and runs of items between that kept their order
(``del losses[3]`` shifts them), travel as spans, ``("span", start, stop)`` (``(None, span)`` in a dict's
entries): the notebook's own items at those places as the cell started (:func:`listed`, :func:`mapped`, in
the kernel). So rank 0 sends the change, not the history: an append sends the new item.

Cost on rank 0: a list of the references before the cell, one pass comparing them after (in C), and a
pass over the items between head and tail. A change inside an item (a dict it holds, changed in place) is
not seen. Lists and dicts of more than :data:`LONG_ITEMS` items are not compared: :class:`TooLong` tells
whether the cell changed their length or last item, so that the note names them.

Runs in the workers (:class:`Shallow`, :class:`TooLong`) and in the kernel (:func:`listed`, :func:`mapped`).
"""
from __future__ import annotations

import itertools
import operator
from collections.abc import Callable

from ..cell.values import is_plain_value

__all__ = ["Shallow", "TooLong", "listed", "mapped", "LONG_ITEMS", "SPAN"]

# Lists and dicts compared by identity, up to this many items; longer ones, only for the note (:class:`TooLong`).
LONG_ITEMS = 1_000_000
SPAN = "span"


class Shallow:
    """A long list's or dict's items as the cell started, not copied."""

    def __init__(self, container):
        self.keys = list(container) if isinstance(container, dict) else None
        self.values = list(container.values() if isinstance(container, dict) else container)

    def same(self, container) -> bool:
        """Whether ``container`` holds the same objects, under the same keys, in the same order."""
        values = container.values() if isinstance(container, dict) else container
        return len(container) == len(self.values) and all(map(operator.is_, values, self.values)) and (
            self.keys is None or list(container) == self.keys)

    def pairs(self):
        """``(key, item)`` as the cell started (a list's keys: its indices)."""
        return zip(self.keys if self.keys is not None else range(len(self.values)), self.values)

    def whole(self) -> list:
        """Entries standing for the container as the cell started."""
        return self._spans([(0, len(self.values))])

    def described(self, container, between: Callable) -> tuple[list, bool, list]:
        """``(entries, changed, foreign)`` of ``container`` (as :func:`~.containers.describe` answers): the
        items between its unchanged head and tail described by ``between(old, new)`` (``(entries,
        foreign)``; ``old``: ``{key: item}`` of those there as the cell started, and of any of the head or
        tail the cell put between them too, ``runs.append(runs[0])``; ``new``: ``[(key, item)]`` now)."""
        if self.same(container):
            return self.whole(), False, []
        start, end, old, new = self.parts(container)
        before = dict(old)
        there = {id(v) for v in before.values()}
        strays = {id(v) for _, v in new if id(v) not in there and not is_plain_value(v)}
        if strays:
            before.update({k: v for k, v in self.pairs() if id(v) in strays and k not in before})
        inner, foreign = between(before, new)
        return self.entries(start, end, inner), True, foreign

    def parts(self, container) -> tuple[int, int, list, list]:
        """``(start, end, old, new)``: the items before ``start`` and from ``end`` on (places as the cell
        started) are still there, the same objects, before and after the others; ``old``: ``(key, item)``
        of those others as the cell started, ``new``: as they are now (a list's keys: their indices)."""
        keys, values = (list(container), list(container.values())) if self.keys is not None else (None, container)
        start = _run(values, self.values, min(len(values), len(self.values)))
        if keys is not None and self.keys is not None:
            start = _run(keys, self.keys, start)
        tail = _run(reversed(values), reversed(self.values), min(len(values), len(self.values)) - start)
        if keys is not None and self.keys is not None:
            tail = _run(reversed(keys), reversed(self.keys), tail)
        end, stop = len(self.values) - tail, len(values) - tail
        old_keys = range(start, end) if self.keys is None else self.keys[start:end]
        new_keys = range(start, stop) if keys is None else keys[start:stop]
        return start, end, list(zip(old_keys, self.values[start:end])), list(zip(new_keys, values[start:stop]))

    def entries(self, start: int, end: int, inner: list) -> list:
        """The container's entries: spans of its head (up to ``start``) and tail (from ``end``) around
        ``inner``, the entries of the items between, whose runs of ``("old", key)`` in their old order
        become spans too."""
        listlike = self.keys is None
        place = {} if self.keys is None else {k: i for i, k in enumerate(self.keys[start:end], start)}
        out: list = []
        run: list[int] = []   # [first, stop) of the run of old items being joined

        def flush():
            if run:
                out.extend(self._spans([tuple(run)]))
                run.clear()
        for e in inner:
            entry, key = (e, None) if listlike else (e[1], e[0])
            at = None
            if entry[0] == "old" and (listlike or key is entry[1]):
                at = entry[1] if listlike else place.get(key)
            if at is not None and run and run[1] == at:
                run[1] = at + 1
                continue
            flush()
            if at is not None:
                run[:] = [at, at + 1]
            else:
                out.append(e)
        flush()
        head = self._spans([(0, start)] if start else [])
        return head + out + self._spans([(end, len(self.values))] if end < len(self.values) else [])

    def _spans(self, ranges: list) -> list:
        spans = [(SPAN, a, b) for a, b in ranges]
        return spans if self.keys is None else [(None, s) for s in spans]


def _run(values, before, limit: int) -> int:
    """How many leading items of ``values`` are those of ``before``, the same objects, up to ``limit``: in C, as
    an append leaves all of them."""
    try:
        return min(operator.indexOf(map(operator.is_, itertools.islice(values, limit), before), False), limit)
    except ValueError:   # (no item differs)
        return limit


def listed(old: list, entries: list, item: Callable) -> list:
    """In the kernel: the new items of a list ``entries`` describe, spans taken from the notebook's ``old``
    list as it still is, other entries made by ``item(entry)``."""
    out: list = []
    for e in entries:
        if e[0] == SPAN:
            out += old[e[1]:e[2]]
        else:
            out.append(item(e))
    return out


def mapped(old: dict, entries: list, item: Callable) -> dict:
    """:func:`listed` for a dict's ``(key, entry)`` entries, in their order."""
    pairs = list(old.items()) if any(e[0] == SPAN for _, e in entries) else []
    out: dict = {}
    for k, e in entries:
        if e[0] == SPAN:
            out.update(pairs[e[1]:e[2]])
        else:
            out[k] = item(e)
    return out


class TooLong:
    """A list or dict of more than :data:`LONG_ITEMS` items: not compared; only its length and last item are
    kept, to tell the note that the cell changed it. Compared by identity where the cell rebinds it."""

    def __init__(self, container):
        self.value = container
        self.size, self.last = len(container), _last(container)

    def changed(self) -> bool:
        """Whether its length or its last item (and key) changed since the cell started."""
        last = _last(self.value)
        return len(self.value) != self.size or len(last) != len(self.last) or \
            not all(map(operator.is_, last, self.last))

    def note(self, where: str) -> str:
        """The note's entry for it, at ``where`` (``"trainer.losses"``)."""
        return (f"{where} (a {type(self.value).__name__} of {self.size:,} items, longer than the "
                f"{LONG_ITEMS:,} rank 0 compares, so the cell's changes to it stay in the ranks; change it in a "
                "plain cell, or keep a shorter one)")

    def __eq__(self, other):
        return other is self.value


def _last(container) -> tuple:
    if not container:
        return ()
    return next(reversed(container.items())) if isinstance(container, dict) else (container[-1],)
