"""The way back: what a ``%%dataparallel`` cell changed in the notebook, captured on rank 0 and applied in the kernel.

Rank 0 takes a :class:`~.snapshot.Snapshot` as the cell starts: the notebook objects the cell may change
(what the names it reads hold, a few levels down: lists, dicts, instances of the notebook's classes and
namespaces, tensors and arrays) and where each one is (its :data:`~gpumagic.dataparallel.protocol.Path`).
After the cell, :func:`~.capture.capture` compares and describes the changes (:class:`~gpumagic.dataparallel.
protocol.Changes`): names bound, lists and dicts changed in place, attributes set, tensors written in place.
Every new value travels through one by-name pickler (:mod:`.pickler`): what the notebook already holds
travels as where it holds it, so the kernel puts its own object there; a model the cell made travels whole,
once. :func:`~.apply.apply_changes` makes the same changes to the notebook's own objects, in place.

* :mod:`.paths` - where an object is, and finding it; :mod:`.reach` - what rank 0 watches, and how far;
* :mod:`.snapshot` - rank 0, before; :mod:`.capture` - rank 0, after; :mod:`.pickler` - both sides;
* :mod:`.apply` - the kernel.

Runs on rank 0 (snapshot, capture) and in the kernel (apply): no IPython.
"""
from __future__ import annotations

__all__: list[str] = []
