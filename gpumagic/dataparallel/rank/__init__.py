"""The ranks' side of a ``%%dataparallel`` cell: each worker process (or ipyparallel engine) runs it as one rank.

* :mod:`.task` - the task the kernel runs on every rank: the cell's values unpacked, the strategy's
  ``start`` / ``running`` / ``finish`` around the cell, rank 0's answer captured (:mod:`..sync`) and sent;
* :mod:`.cell` - one cell on one rank (:class:`~.cell.RankCell`); :mod:`.execute` - the user's code run,
  counted; :mod:`.loaders` - the notebook's loaders split by batch;
* :mod:`.devices` - ``'cuda:0'`` in the cell means the rank's GPU; :mod:`.swaps` - notebook objects hold the
  rank's stand-ins while the cell runs; :mod:`.files` and :mod:`.exports` - files the cell writes are rank
  0's, written once; :mod:`.mode_guard` - a framework the kernel could not see is refused as it is built.

Runs in the workers: no IPython.
"""
from __future__ import annotations

__all__: list[str] = []
