"""Shard a notebook's DataLoader across ranks without changing what it yields.

``split="batch"`` (data parallel): every rank walks the same sequence of
global batches as the original loader, shuffling included, and takes its
equal slice of each one, so N ranks averaging gradients see exactly the
single-process batches. ``split="dataset"`` (Hogwild): each rank takes every
N-th sample of the epoch and batches it at the original batch size, so
workers see different samples. With ``whole_without_grad`` (either split), a
pass begun with gradients off (an evaluation under ``torch.no_grad()``) is
not split: every rank reads every batch, so what the cell computes from it
(an accuracy over ``len(loader.dataset)``) is what one process would compute;
and until a pass with gradients on has begun, ``len()`` is the whole count
too (an evaluation loader's length is taken before its ``no_grad`` block).

Shuffling is identical on every rank. A loader made with its own
``generator`` shuffles with it, as in one process (every rank got the same
generator state, and only the loader draws from it). Otherwise each pass is
shuffled with a generator seeded with ``seed + epoch``, where ``seed`` is the
one torch was last seeded with (the ranks' common seed, or a
``torch.manual_seed(s)`` in the cell: the same seed gives the same order), and
the epoch count advances on each pass, which is what
``DistributedSampler.set_epoch`` does by hand. (Following ``torch.manual_seed``
is asked for with ``follow_seed``: only where every rank was seeded alike.)
"""
from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler

__all__ = ["ShardedBatchSampler", "shard_loader"]


class ShardedBatchSampler(Sampler):
    """Yield rank ``rank``'s share of the batches of ``batch_sampler``."""

    def __init__(self, batch_sampler, rank: int, world_size: int, split: str = "batch", seed: int = 0,
                 batch_size: int | None = None, whole_without_grad: bool = False, follow_seed: bool = False):
        if split not in ("batch", "dataset"):
            raise ValueError(f"split must be 'batch' or 'dataset', not {split!r}")
        self.batch_sampler = batch_sampler
        self.rank, self.world_size, self.split = rank, world_size, split
        self.seed, self.epoch = seed, 0
        self.follow_seed = follow_seed
        self._seeded_with = seed   # torch.initial_seed() when `seed` was last set
        sampler = getattr(batch_sampler, "sampler", None)
        self.own_generator = isinstance(sampler, RandomSampler) and sampler.generator is not None
        self.whole_without_grad = whole_without_grad
        self.trained = False   # whether a pass with gradients on (split) has begun
        self.batch_size = batch_size or getattr(batch_sampler, "batch_size", None) or 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _seed_shuffling(self):
        sampler = getattr(self.batch_sampler, "sampler", None)
        if not isinstance(sampler, RandomSampler) or self.own_generator:
            return
        if self.follow_seed and torch.initial_seed() != self._seeded_with:   # the cell seeded torch: follow it
            self.seed = self._seeded_with = torch.initial_seed()
            self.epoch = 0
        sampler.generator = torch.Generator().manual_seed(self.seed + self.epoch)

    def splits_this_pass(self) -> bool:
        """Whether a pass starting now is split (a DataLoader starts its pass in the calling thread)."""
        return not (self.whole_without_grad and not torch.is_grad_enabled())

    def __iter__(self):
        sampler = getattr(self.batch_sampler, "sampler", None)
        original = getattr(sampler, "generator", None)
        self.trained = self.trained or self.splits_this_pass()
        self._seed_shuffling()
        self.epoch += 1
        try:
            yield from self._shares()
        finally:
            if isinstance(sampler, RandomSampler):
                sampler.generator = original   # the wrapped sampler as it was: it may be the notebook's own

    def _shares(self):
        if not self.splits_this_pass():
            for batch in self.batch_sampler:
                yield list(batch)
        elif self.split == "batch":
            for batch in self.batch_sampler:
                batch = list(batch)
                if len(batch) < self.world_size:
                    continue  # a last batch too small to give every rank a sample
                share = _chunk(batch, self.rank, self.world_size)
                yield share
        else:
            # Every N-th index of the epoch, taken at C speed: this runs before each epoch's first batch.
            mine = list(itertools.islice(itertools.chain.from_iterable(self.batch_sampler), self.rank, None,
                                         self.world_size))
            for start in range(0, len(mine), self.batch_size):
                yield mine[start:start + self.batch_size]

    def __len__(self):
        # With whole_without_grad, a loader no training pass has read yet is taken for an evaluation
        # loader: the quickstart's test() takes len(loader) before its no_grad pass reads it whole.
        if self.split == "batch" or not self.splits_this_pass() or (self.whole_without_grad and not self.trained):
            return len(self.batch_sampler)
        total = len(self.batch_sampler.sampler) if hasattr(self.batch_sampler, "sampler") else 0
        per_rank = (total - self.rank + self.world_size - 1) // self.world_size
        return (per_rank + self.batch_size - 1) // self.batch_size


def _chunk(batch: list, rank: int, world: int) -> list:
    """Rank's contiguous slice; sizes differ by at most one, like ``tensor_split``."""
    base, extra = divmod(len(batch), world)
    start = rank * base + min(rank, extra)
    return batch[start:start + base + (1 if rank < extra else 0)]


def shard_loader(loader: DataLoader, rank: int, world_size: int, split: str = "batch", seed: int = 0,
                 whole_without_grad: bool = False, sampler_class: type = ShardedBatchSampler,
                 follow_seed: bool = False) -> DataLoader:
    """A DataLoader over the same dataset that yields rank's share of ``loader``.

    >>> sharded = shard_loader(train_loader, rank=1, world_size=2)   # doctest: +SKIP
    """
    if loader.batch_sampler is None:
        raise ValueError("a DataLoader with batch_size=None cannot be sharded")
    sampler = sampler_class(loader.batch_sampler, rank, world_size, split, seed,
                            batch_size=loader.batch_size, whole_without_grad=whole_without_grad,
                            follow_seed=follow_seed)
    kwargs: dict = dict(
        batch_sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
        generator=loader.generator,   # each pass draws its workers' seed from it, as the loader's own does
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    return DataLoader(loader.dataset, **kwargs)
