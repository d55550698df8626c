"""Thin Magics classes: parse arguments, call a plain function, display the result.

Each module holds one magic; :data:`MAGIC_CLASSES` is what ``%load_ext``
registers. Modules are imported when the extension loads, and they import
torch only inside the magic's body.
"""
from __future__ import annotations

import importlib
import logging

from .. import session
from ..procs import bytecode

__all__ = ["MAGIC_CLASSES", "register", "unregister"]

logger = logging.getLogger(__name__)

# (module, class) for every magic class.
MAGIC_CLASSES = [
    ("gpumagic.magics.info", "InfoMagics"),
    ("gpumagic.magics.memory", "MemoryMagics"),
    ("gpumagic.magics.ondevice", "OnDeviceMagics"),
    ("gpumagic.magics.dataparallel", "DataParallelMagics"),
    ("gpumagic.magics.sharedtrain", "SharedTrainMagics"),
]


def _classes():
    for module_name, class_name in MAGIC_CLASSES:
        yield getattr(importlib.import_module(module_name), class_name)


def register(shell) -> None:
    from . import cell_events
    for cls in _classes():
        shell.register_magics(cls(shell))
    cell_events.register(shell)
    try:
        bytecode.warm_cache()  # only where workers would otherwise compile torch: see procs/bytecode.py
    except OSError:  # a speed-up only; workers then fill the cache themselves
        logger.debug("could not start filling the workers' bytecode cache", exc_info=True)


def unregister(shell) -> None:
    """Stop background threads, pools and servers, then remove every gpumagic magic and cell event."""
    from . import cell_events
    cell_events.unregister(shell)
    for error in session.close_all():
        logger.warning("while unloading gpumagic: %s: %s", type(error).__name__, error)
    table = shell.magics_manager.magics
    for cls in _classes():
        for kind, names in cls.magics.items():
            for name in names:
                table[kind].pop(name, None)
