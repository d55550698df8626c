"""Thin Magics classes: parse arguments, call a plain function, display the result.

Each module holds one magic; the list below is what ``%load_ext`` registers.
Modules are imported when the extension loads, and they import torch only
inside the magic's body.
"""
from __future__ import annotations

import importlib

from .. import fresh, session

# (module, class) for every magic class; later magics add themselves here.
MAGIC_CLASSES = [
    ("gpumagic.magics.info", "InfoMagics"),
    ("gpumagic.magics.memory", "MemoryMagics"),
    ("gpumagic.magics.ondevice", "OnDeviceMagics"),
    ("gpumagic.magics.dataparallel", "DataParallelMagics"),
    ("gpumagic.magics.sharedtrain", "SharedTrainMagics"),
]


def _classes():
    for module_name, class_name in MAGIC_CLASSES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # not written yet in this build
                continue
            raise
        yield getattr(module, class_name)


def register(shell) -> None:
    for cls in _classes():
        shell.register_magics(cls(shell))
    try:
        fresh.warm_cache()  # only where workers would otherwise compile torch: see fresh.py
    except Exception:
        pass  # a speed-up only; workers then fill the cache themselves


def unregister(shell) -> None:
    """Stop background threads and pools, then remove every gpumagic magic."""
    session.close_all()
    table = shell.magics_manager.magics
    for cls in _classes():
        for kind, names in cls.magics.items():
            for name in names:
                table[kind].pop(name, None)
