"""The ``.cuda()`` rewrite: code written for one GPU lands on the device a cell runs on.

``%%ondevice cpu`` (or ``cuda:1``, ``meta``), ``%%dataparallel`` ranks on the CPU and ``%%sharedtrain``
workers run cells written for ``.cuda()``: the cell's syntax tree is rewritten so that every CUDA spelling
goes through one helper, which places tensors, modules and CUDA calls on the cell's device.

* :mod:`.transform` - the AST transformer (:class:`~.transform.PlacementRewriter`); :mod:`.names` - the torch
  names it looks up; :mod:`.magics` - the code of ``%time`` / ``%timeit`` / ``%prun`` in a cell;
* :mod:`.helper` - :class:`~.helper.Placement`, the helper the rewritten code calls, made of parts
  (:mod:`.part`): :mod:`.cuda_calls` (what ``torch.cuda`` and ``torch.accelerator`` answer), :mod:`.methods`
  (a module's own ``cuda()``, ``cuda``/``to`` taken as values, storages in ``map_location``), :mod:`.placed`
  (tensors a cell put on "CUDA"), :mod:`.parallel` (``replicate`` / ``scatter`` / ``parallel_apply`` /
  ``gather`` off a GPU);
* :mod:`.values` - devices spelled as CUDA, typed-tensor stand-ins; :mod:`.own` - a plain cell's class's own
  ``cuda()``, compiled again to follow the device; :mod:`.workers` - the same rewrite for CPU worker processes.

Import what you need from the modules themselves: this package's ``__init__`` imports none of them, so a
worker that needs :mod:`.workers` does not import the whole rewrite.

In a notebook::

    %%ondevice cpu
    x = torch.randn(3).cuda()      # rewritten: lands on the CPU
"""
from __future__ import annotations

__all__: list[str] = []
