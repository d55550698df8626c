"""The process layer: every worker process gpumagic starts, for both training magics.

* :mod:`.start` - which start method is safe, and starting a worker cleanly;
  :mod:`.bytecode` - fresh workers keep their bytecode; :mod:`.forkserver` - the kept fork server;
* :mod:`.worker` - inside a worker: one main loop running tasks, output forwarded;
* :mod:`.group` - the kernel's side of a set of workers: start, collect, end;
  :mod:`.pool` - a persistent group joined in a ``torch.distributed`` process group;
  (ranks on other machines: ipyparallel engines, :mod:`gpumagic.dataparallel.ranks.cluster`)
* :mod:`.wire` - the one wire format for values and tensors; :mod:`.bulk` - bytes through
  anonymous shared memory; :mod:`.tensor_cache` - tensors workers keep between cells;
* :mod:`.output` - workers' output in the cell, ``[rank N]``; :mod:`.failures` - worker errors;
  :mod:`.teardown` - SIGTERM, grace, SIGKILL, reap, and dying with the kernel;
  :mod:`.loader_workers` - DataLoader workers inside a worker: forked, gone with it;
* :mod:`.loaders` - a notebook's DataLoader split across workers; :mod:`.seeding`, :mod:`.cpus`.

Modules a worker imports (worker, wire, bulk, tensor_cache, failures, teardown,
loader_workers, loaders, seeding) import neither IPython nor the kernel's side of gpumagic.
"""
__all__: list[str] = []
