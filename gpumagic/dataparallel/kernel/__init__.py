"""The kernel's side of a ``%%dataparallel`` cell.

* :mod:`.train` - a cell from start to end: read, shipped, run on the ranks, its result loaded
  (:func:`~.train.run_cell`), and the same from plain Python (:func:`~.train.train_parallel`);
* :mod:`.notebook` - the notebook a cell runs against (a shell, or a namespace dict);
* :mod:`.read` - the cell compiled and read: which mode (:mod:`.detect`), what it trains and reads
  (:mod:`.survey`);
* :mod:`.result` - what a cell did (:class:`~.result.DataParallelResult`); :mod:`.progress` - steps and
  samples per rank while it runs; :mod:`.held` - state only the workers hold, guarded.
"""
from __future__ import annotations

__all__: list[str] = []
