"""Patch a module now if it is imported, else right after its first import (a framework's, IPython's display).

A rank lives across cells, and a cell may import Lightning or accelerate at any
line: a patch registered here reaches the module whenever it arrives. Each patch
must be idempotent (it may see a module that it patched before).

Runs in the workers: no IPython.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable

__all__ = ["patch_module"]

_PATCHES: dict[str, list[Callable[[types.ModuleType], None]]] = {}


def patch_module(name: str, patch: Callable[[types.ModuleType], None]) -> None:
    """Run ``patch(module)`` on the module ``name`` now if it is imported, else once it is."""
    patches = _PATCHES.setdefault(name, [])
    if patch not in patches:
        patches.append(patch)
    if name in sys.modules:
        patch(sys.modules[name])
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs the registered patches on a module right after it is first imported."""

    def find_spec(self, fullname, path, target=None):
        patches = _PATCHES.get(fullname)
        if not patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            for patch in patches:
                patch(module)

        loader.exec_module = exec_and_patch
        return spec
