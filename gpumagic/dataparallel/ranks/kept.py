"""What the kernel counts on the ranks holding between cells (:class:`Kept`), and nothing more.

Each rank keeps the large tensors a cell handed it (the weights it trained, the data it read: see
:mod:`gpumagic.procs.tensor_cache`), so the next cell sends only the fingerprints of those every rank holds
(:attr:`Kept.tensors`). ``--strategy fsdp`` ranks keep their shards of the models and optimizers, and the
notebook's tensors they write the trained state into (:attr:`Kept.sharded`). The kernel forgets all of it
when a cell fails or the ranks start again: the next cell ships everything.

Runs in the kernel: no IPython.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

__all__ = ["Kept", "Sharded", "ShardRecord"]


@dataclass
class ShardRecord:
    """What the ranks hold sharded of a notebook module or optimizer, and what the notebook held then."""
    ref: weakref.ref                # the notebook's object
    keys: dict | None               # fingerprints of its tensors; None: a meta model (nothing to compare)
    groups: list | None = None      # an optimizer's hyperparameters
    blocks: list | None = None      # a module's FSDP unit classes


@dataclass
class Sharded:
    """``--strategy fsdp``'s records: the modules and optimizers the ranks hold sharded (by notebook name), and
    the notebook's tensors (shared memory) they write the trained state into (``sent``, weakly, by ref)."""
    modules: dict[str, ShardRecord] = field(default_factory=dict)
    optimizers: dict[str, ShardRecord] = field(default_factory=dict)
    sent: dict | None = None        # None: the ranks hold no targets (a new pool, or after a failure)


@dataclass
class Kept:
    """What the ranks hold between cells, as far as the kernel counts on it."""
    tensors: set = field(default_factory=set)      # fingerprint keys every rank holds
    sharded: Sharded | None = None

    def forget(self) -> None:
        """Count on nothing: the ranks replaced or dropped what they held (a cell began, or failed)."""
        self.tensors = set()
        self.sharded = None
