"""``%%dataparallel``'s strategies, each an object that owns its options (:mod:`.base` is the interface).

* :mod:`.ddp` (the default) with :mod:`.ddp_rank`: gpumagic's DistributedDataParallel, one process per device;
  :mod:`.ddp_wrapper` (the wrapper), :mod:`.ddp_warm` (``--compile``), :mod:`.ddp_grads` (gradients across
  cells), :mod:`.ddp_scripting` (``torch.jit.script`` of the wrapped model);
* :mod:`.launch` with :mod:`.launch_rank`: launch mode, every rank a process ``torchrun`` started;
* :mod:`.fsdp` with :mod:`.fsdp_rank` and :mod:`.fsdp_back`: the model sharded with FSDP2 (:mod:`.fsdp_blocks`:
  its units; :mod:`.fsdp_whole`: sharded values made whole);
* :mod:`.dp`: in the kernel, each call of the model split over the devices;
* :mod:`.process` (what those with worker processes share), :mod:`.collect` and :mod:`.trained` (the trained
  state: collected on rank 0, loaded into the notebook's objects).

The ``*_rank`` modules, and those they import, run in the workers: no IPython.
"""
from __future__ import annotations

__all__: list[str] = []
