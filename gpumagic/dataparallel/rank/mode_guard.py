"""In gpumagic's DDP mode, refuse a framework that would distribute the cell a second time.

:func:`.detect.choose_mode` reads the cell before it runs, and cannot see
everything: a ``Trainer`` built in a module the cell imports for the first
time, or behind a call it cannot follow. Such a cell would run with its model
already wrapped and its loaders already split, and the framework would count
one process per rank (an ``Accelerator`` says ``num_processes == 1``), or fail
deep inside (a Trainer reads the wrapper's ``forward`` signature). While a cell
runs in DDP mode, :func:`refusing_frameworks` makes building any of them raise
:class:`SelfDistributingCell`, which names the fix: ``--launch``.

Runs in the workers: no IPython.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ...procs.import_patches import patch_module

__all__ = ["refusing_frameworks", "SelfDistributingCell", "FRAMEWORK_CLASSES"]

# module -> (class, what it is): where each framework that distributes by itself is defined.
FRAMEWORK_CLASSES = {
    "transformers.trainer": ("Trainer", "a Hugging Face Trainer"),
    "accelerate.accelerator": ("Accelerator", "an accelerate Accelerator"),
    "lightning.pytorch.trainer.trainer": ("Trainer", "a Lightning Trainer"),
    "pytorch_lightning.trainer.trainer": ("Trainer", "a Lightning Trainer"),
    "lightning.fabric.fabric": ("Fabric", "a Lightning Fabric"),
    "lightning_fabric.fabric": ("Fabric", "a Lightning Fabric"),
}

_refusing = False   # True while a DDP-mode cell runs in this process


class SelfDistributingCell(RuntimeError):
    """A DDP-mode cell built a framework object that distributes the training by itself."""


@contextmanager
def refusing_frameworks() -> Iterator[None]:
    """While the block runs, building a framework trainer raises :class:`SelfDistributingCell`."""
    global _refusing
    for name in FRAMEWORK_CLASSES:
        patch_module(name, _guard_class)
    _refusing = True
    try:
        yield
    finally:
        _refusing = False


def _guard_class(module) -> None:
    name, what = FRAMEWORK_CLASSES[module.__name__]
    cls = getattr(module, name, None)
    if cls is None or getattr(cls.__init__, "_gpumagic_guarded", False):
        return
    init = cls.__init__

    def guarded_init(self, *args, **kwargs):
        if _refusing:
            _refusing_now(what, f"{cls.__module__}.{cls.__qualname__}")
        init(self, *args, **kwargs)

    guarded_init._gpumagic_guarded = True  # type: ignore[attr-defined]
    guarded_init.__wrapped__ = init  # type: ignore[attr-defined]
    guarded_init.__doc__ = init.__doc__
    cls.__init__ = guarded_init


def _refusing_now(what: str, qualified: str) -> None:
    raise SelfDistributingCell(
        f"the cell builds {what} ({qualified}), which distributes the training by itself, but the cell "
        "runs in gpumagic's DDP mode (its model wrapped, its loaders split), since reading the cell did "
        "not show the framework (it is reached through code the cell imports or calls): run the cell "
        "with %%dataparallel --launch. The notebook's objects are as they were.")
