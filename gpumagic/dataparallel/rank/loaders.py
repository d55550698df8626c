"""The notebook's DataLoaders on a rank: split by batch, so that N ranks share every global batch.

Every rank walks the same sequence of global batches (shuffling included, ``set_epoch`` handled, seeded
alike) and takes its equal share (:func:`~gpumagic.procs.loaders.shard_loader`). A pass begun with
gradients off (an evaluation under ``torch.no_grad()``) is read whole on every rank. The split loaders'
samples are counted for the progress display (:class:`TrainingPassSampler`).

Runs in the workers: no IPython.
"""
from __future__ import annotations

from ...procs.loaders import ShardedBatchSampler, shard_loader
from ..protocol import CellWarning
from .cell import RankCell

__all__ = ["TrainingPassSampler", "split_loaders"]


class TrainingPassSampler(ShardedBatchSampler):
    """A rank's share of a loader's batches, counted for the progress display.

    A pass read whole (gradients off: an evaluation) is not training: its samples are not counted. A
    split pass in which no optimizer steps is probably an evaluation that forgot ``torch.no_grad()``
    (unless it ran backward, accumulating gradients for a later cell): what the cell computes from it
    covers rank 0's share only, and a warning says so.
    """

    def watch(self, name: str, cell: RankCell) -> None:
        """Count into ``cell``'s stats; rank 0 warns through it."""
        self.name, self.cell = name, cell
        self.warned = False

    def __iter__(self):
        stats = self.cell.stats
        split = self.splits_this_pass()
        steps_before, backwards_before = stats.steps, stats.backwards
        for batch in super().__iter__():
            if split:
                stats.samples = (stats.samples or 0) + len(batch)
            yield batch
        trained = stats.steps != steps_before or stats.backwards != backwards_before
        if split and not trained and self.cell.rank0 and not self.warned:
            self.warned = True
            self.cell.send(CellWarning(
                f"DataLoader {self.name!r} was split across the ranks but no optimizer step followed: what the "
                "cell computed from it covers rank 0's share only. Read it under torch.no_grad() (as an "
                "evaluation) and every rank reads it whole."))


def split_loaders(cell: RankCell) -> None:
    """Each loader the cell reads, replaced by the rank's share of it (the notebook's objects holding it hold
    the share while the cell runs: :attr:`~.cell.RankCell.swaps`)."""
    for name in cell.order.roles.loaders:
        original = cell.ns[name]
        # every rank seeded alike: the same global batches
        sharded = shard_loader(original, cell.rank, cell.world_size, split="batch", seed=cell.order.seed,
                               whole_without_grad=True, sampler_class=TrainingPassSampler, follow_seed=True)
        sampler = sharded.batch_sampler
        assert isinstance(sampler, TrainingPassSampler)
        sampler.watch(name, cell)
        cell.ns[name] = sharded
        cell.swaps[id(original)] = (original, sharded)
        cell.known[id(sharded)] = (("path", (name,)), sharded)
        cell.known[id(original)] = (("path", (name,)), original)
