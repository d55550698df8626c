"""``%%dataparallel``: train a cell's model on every device; the trained weights come back.

* :mod:`.plan` - which devices, strategy and backend (bad options are ``UsageError``);
* :mod:`.run` - the kernel's side: what the cell trains, shipped to the pool, results loaded;
* :mod:`.rank` - the ranks' side: DDP-wrapped modules, split loaders, the cell run;
* :mod:`.wrapping` - the DDP wrapper and the ``cuda:k`` rewrite a rank applies;
* :mod:`.results` - what a cell did, and rank 0's state loaded into the notebook;
* :mod:`.dp` - ``--strategy dp``: each model call split over the devices, in the kernel;
* :mod:`.progress` - steps and samples per rank while a cell runs.

The processes themselves are :mod:`gpumagic.procs`.
"""
