"""Kernel-wide state: the current device and the things to stop on unload.

Kept free of torch and IPython imports so that ``import gpumagic`` stays light.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["picked_device", "set_picked_device", "on_device_change", "register_closer", "unregister_closer",
           "close_all"]

_lock = threading.Lock()
_picked: str | None = None          # canonical device string, e.g. "cuda:1"
_listeners: list[Callable[[str | None], None]] = []
_closers: dict[str, Callable[[], object]] = {}


def picked_device() -> str | None:
    """The device picked by the user (picker or :func:`set_current_device`), if any."""
    return _picked


def set_picked_device(device: str | None) -> None:
    """Record ``device`` (already validated and canonical) as the session's device."""
    global _picked
    with _lock:
        _picked = device
        listeners = list(_listeners)
    for listener in listeners:
        listener(device)


def on_device_change(listener: Callable[[str | None], None]) -> Callable[[], None]:
    """Call ``listener(device)`` whenever the current device changes; returns an undo."""
    with _lock:
        _listeners.append(listener)

    def remove():
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)
    return remove


def register_closer(name: str, close: Callable[[], object]) -> None:
    """Remember ``close`` to be called on ``%unload_ext gpumagic`` (one per name)."""
    with _lock:
        _closers[name] = close


def unregister_closer(name: str) -> None:
    with _lock:
        _closers.pop(name, None)


def close_all() -> list[BaseException]:
    """Call every registered closer; returns the errors instead of stopping at one."""
    with _lock:
        closers = list(_closers.items())
        _closers.clear()
    errors = []
    for _, close in closers:
        try:
            close()
        except BaseException as exc:  # noqa: BLE001 - unloading must go on
            errors.append(exc)
    return errors
