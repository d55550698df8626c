"""The notebook's torch.compile settings on every rank.

What torch's own messages tell a notebook user to set (``torch._dynamo.config.capture_scalar_outputs
= True`` in a graph-break warning, ``recompile_limit``, ``torch._inductor.config`` options) is set
in the kernel, but the cell's code compiles in the ranks, which are other processes with torch's
defaults. So, as with the matmul precision, every cell carries the settings the kernel changed
(:func:`notebook_compile_settings`) and each rank takes them (:func:`apply_compile_settings`), and
goes back to its own value where the kernel no longer changes one.

Only plain values travel (numbers, strings, and lists, tuples, sets and dicts of them): a custom
pass or a callable in the config stays in the kernel.
"""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["notebook_compile_settings", "apply_compile_settings", "CONFIG_MODULES"]

# torch.compile's configuration modules, as torch.compile's documentation and messages name them.
CONFIG_MODULES = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")

_originals: dict[str, dict[str, Any]] = {}   # on a rank: each key's value before a kernel's setting replaced it


def notebook_compile_settings() -> dict[str, dict[str, Any]]:
    """The settings the kernel changed from torch's defaults, by config module (in the kernel).

    A module the notebook never imported has only its defaults: it is not imported here (dynamo
    costs a second to import, and the kernel imports none of it for a cell that does not compile).
    """
    settings: dict[str, dict[str, Any]] = {}
    for name in CONFIG_MODULES:
        module = sys.modules.get(name)
        try:
            changed = module._get_dict(skip_default=True) if module is not None else {}
        except Exception:  # noqa: BLE001 - a torch without this config API: the ranks keep their defaults
            changed = {}
        plain = {key: value for key, value in changed.items() if _plain(value)}
        if plain:
            settings[name] = plain
    return settings


def apply_compile_settings(settings: dict[str, dict[str, Any]]) -> None:
    """The kernel's changed settings on this rank (in the rank); a setting the kernel changed in an
    earlier cell and no longer does goes back to the rank's own value."""
    import importlib
    for name in set(settings) | set(_originals):
        wanted = settings.get(name, {})
        module = importlib.import_module(name) if wanted else sys.modules.get(name)
        if module is None:
            continue
        originals = _originals.setdefault(name, {})
        for key in [k for k in originals if k not in wanted]:
            setattr(module, key, originals.pop(key))
        for key, value in wanted.items():
            if not hasattr(module, key):
                continue   # (a setting this rank's torch does not have)
            originals.setdefault(key, getattr(module, key))
            setattr(module, key, value)


def _plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(map(_plain, value))
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False
