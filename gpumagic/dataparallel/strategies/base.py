"""What every ``%%dataparallel`` strategy does, and when: one small interface, two halves.

A strategy (:class:`Strategy`: DDP, FSDP, launch mode, DP) holds the options it owns, and says what it does

* in the kernel, **before** the cell (:meth:`Strategy.check_cell`, then :meth:`Strategy.before`): refuse what
  it cannot train before anything starts, prepare what the ranks get (fsdp moves the model into shared
  memory), and say how the notebook's values travel (:class:`Prepared`, with its rank half);
* on each rank, **around** the cell (:class:`RankStrategy`): ``start`` (wrap the models in DDP, shard them,
  or leave them to the cell's framework; split the loaders), ``running`` (the guards the user's code runs
  under), ``finish`` (collect the trained state, keep what the next cell reuses) and ``send`` (rank 0's
  answer, and every rank's counts);
* in the kernel, **after** it (:meth:`Strategy.after`): the trained state into the notebook's own objects; or,
  should the cell fail, :meth:`Strategy.failed`.

Which options it owns, and how it refuses another's, is said once, as the plan is made (``OPTIONS``,
``from_options``, ``refuse``, ``on_cluster``, ``place``).

The cell itself (reading it, shipping it, running it on the ranks, the way back) is the same for all of them
(:mod:`gpumagic.dataparallel.kernel.train`); DP, which runs in the kernel without ranks, runs the cell its own
way (:meth:`Strategy.run`).

Imported by the ranks (the rank halves travel to them): no IPython.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

from ..rank.send import packed_done

__all__ = ["Strategy", "RankStrategy", "Prepared"]


@dataclass
class Prepared:
    """What a strategy prepared before a cell: its rank half, and how the notebook's values travel
    (:func:`gpumagic.procs.wire.pack`'s arguments)."""
    rank: RankStrategy
    targets: dict                   # id(tensor) -> "rank", "cpu" or "keep"
    grads: dict                     # the notebook's gradients each rank starts from, {module: {parameter: grad}}
    share: Any = None               # tensor -> whether it travels by reference (shared memory)
    stand_ins: dict | None = None   # id(object) -> token of what the ranks kept instead


class Strategy:
    """The kernel's half of a strategy. Subclasses set :attr:`name` and :attr:`OPTIONS`."""

    name: ClassVar[str] = ""
    OPTIONS: ClassVar[tuple[str, ...]] = ()   # the magic's options it owns (their argparse names)
    tag: ClassVar[str] = ""                   # in the summary's "(gloo, fsdp)"
    holds_state: ClassVar[bool] = False       # trained state may stay in the workers alone
    splits: ClassVar[bool] = True             # gpumagic wraps the models and splits the loaders (not in launch mode)
    processes: ClassVar[bool] = True          # it runs the cell in worker processes (not DP, in the kernel)

    @classmethod
    def refuse(cls, flags: list[str]) -> None:
        """``UsageError`` for ``flags`` given that are not this strategy's."""
        raise NotImplementedError

    def on_cluster(self) -> None:
        """``UsageError`` where the strategy cannot run on a cluster's engines."""
        raise NotImplementedError

    def place(self, devices: list[str], backend: str | None, notes: list[str]) -> str | None:
        """The backend for ranks on ``devices`` (notes added to ``notes``)."""
        raise NotImplementedError

    def devices_for(self, placed: list[str]) -> list[str]:
        """The devices the plan runs on, of those placed."""
        raise NotImplementedError

    def run(self, notebook, cell: str, plan, header: str, on_ranks):
        """Run ``cell``: on the ranks (``on_ranks(self, notebook, cell, plan, header)``), as every strategy but
        DP does."""
        return on_ranks(self, notebook, cell, plan, header)

    def for_launch(self, why: str, devices=(), on_cluster: bool = False) -> Strategy:
        """The strategy for a cell that distributes by itself (``why``: what the cell builds, or ``--launch``):
        launch mode, or ``UsageError`` where this strategy's options cannot be honoured there."""
        raise NotImplementedError

    def check_cell(self, read) -> None:
        """``UsageError`` before anything starts for a cell this strategy cannot train."""

    def before(self, read, ranks) -> Prepared:
        """Prepare the cell on the kernel's side, the ranks known: its rank half, and how values travel."""
        raise NotImplementedError

    def after(self, read, returned, done, buffer, ranks):
        """Rank 0's trained state into the notebook's own objects (a :class:`~.trained.Loaded`)."""
        raise NotImplementedError

    def failed(self, read, ranks, done=None) -> None:
        """The cell failed: let go of what :meth:`before` prepared (it may be said more than once);
        ``done``: rank 0's answer, where loading it into the notebook is what failed (the note says what the
        notebook holds then)."""


class RankStrategy:
    """A strategy's half on the ranks (it travels in :class:`~gpumagic.dataparallel.protocol.CellOrder`)."""

    def stand_ins(self, ctx) -> dict:
        """What this rank kept from an earlier cell in place of what the kernel did not ship."""
        return {}

    def start(self, cell) -> None:
        """Before the cell: :attr:`~gpumagic.dataparallel.rank.cell.RankCell.inner` and the loaders set up."""
        raise NotImplementedError

    def running(self, cell) -> contextlib.AbstractContextManager:
        """The guards the user's code runs under."""
        return contextlib.nullcontext()

    def finish(self, cell) -> None:
        """After the cell: the trained state collected into ``cell.trained``; what is kept, kept."""

    def send(self, cell, returned):
        """``(RankDone, buffer)``: this rank's counts, and rank 0's ``returned`` packed."""
        return packed_done(cell, returned)
