"""``%%dataparallel``: train a cell's model on every device; the trained weights come back.

The package is cut by job, and its arrows go one way: the kernel's side uses the strategies, the strategies'
rank halves use the rank's side, and everything that crosses between kernel and ranks is a dataclass of
:mod:`.protocol`.

* :mod:`.plan` - the magic's options as a plan: devices, backend, and the strategy with its own options;
* :mod:`.protocol` - what the kernel and the ranks exchange, and nothing else;
* :mod:`.kernel` - a cell in the kernel: read, shipped, run, its result loaded
  (:func:`~.kernel.train.run_cell`; from plain Python :func:`~.kernel.train.train_parallel`);
* :mod:`.strategies` - DDP, FSDP, launch mode and DP behind one interface: what each does in the kernel before
  the cell, on each rank around it, and in the kernel after it;
* :mod:`.rank` - a cell on one rank: unpacked, run, answered;
* :mod:`.sync` - the way back: what the cell changed in the notebook, captured on rank 0 and applied in the
  kernel through one by-name pickler;
* :mod:`.ranks` - what runs the ranks: this machine's worker pool, or an ipyparallel cluster's engines.

The processes themselves are :mod:`gpumagic.procs`. This package's ``__init__`` imports none of its modules: a
rank imports only the rank's side.

In a notebook::

    %%dataparallel --nprocs 2
    for x, y in loader: ...
"""
from __future__ import annotations

__all__: list[str] = []
