"""Memory: what holds it and how to get it back without restarting the kernel.

* :mod:`.variables` -- which notebook variables hold memory (``%gpumem --vars``);
  :mod:`.storages` and :mod:`.autograd_graph` read what an object reaches;
* :mod:`.free` -- collect garbage, release cached blocks (``%gpumem --free``);
* :mod:`.reclaim` -- end this user's orphans on the GPUs (``%gpumem --reclaim``).

Nothing here imports torch or initialises CUDA: torch is used only where the
notebook imported it, and asked only about devices it has already set up.

In a notebook::

    from gpumagic.memory import variable_memory
    variable_memory(globals())["x"].nbytes
"""
from __future__ import annotations

from .variables import VarMemory, VarsReport, variable_memory

__all__ = ["VarMemory", "VarsReport", "variable_memory"]
