"""``%%sharedtrain``: Hogwild training of one shared model from several processes.

* :mod:`.plan` - how many workers, on which device, started how;
* :mod:`.sharing` - the model in shared memory, and what else workers share;
* :mod:`.launch` - the kernel's side: :func:`~.launch.train_shared`;
* :mod:`.worker` - the workers' side: the cell as each worker's training function;
* :mod:`.results` - per-worker counters and reports; :mod:`.display` - what the cell shows.

The processes themselves are :mod:`gpumagic.procs`.
"""
__all__: list[str] = []
