"""NVML, initialised once and lazily; unsupported fields become ``None``.

NVML answers in microseconds and, unlike ``torch.cuda`` queries, never creates
a CUDA context or initialises CUDA in this process, so every monitoring path
in gpumagic goes through here.

Tests swap in a stand-in library with :func:`use`.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_lib: Any = None            # the pynvml module (from nvidia-ml-py), or a stand-in
_error: str | None = None   # why NVML is unavailable, once we know
_initialised = False
generation = 0              # bumped by use(): caches built on NVML answers key on it


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (no library, no driver, no GPU)."""


def use(library: Any | None) -> None:
    """Use ``library`` as NVML from now on (``None``: forget, load lazily again).

    The stand-in needs the ``nvml*`` functions gpumagic calls and an
    ``NVMLError`` exception class, like the ``pynvml`` module.
    """
    global _lib, _error, _initialised, generation
    with _lock:
        _lib, _error, _initialised = library, None, False
        generation += 1


def lib() -> Any:
    """The initialised NVML module; raises :class:`NvmlUnavailable` with the reason."""
    global _lib, _error, _initialised
    if _initialised:
        return _lib
    with _lock:
        if _initialised:
            return _lib
        if _error is not None:
            raise NvmlUnavailable(_error)
        try:
            if _lib is None:
                import pynvml  # provided by nvidia-ml-py
                _lib = pynvml
            _lib.nvmlInit()
        except Exception as exc:  # library missing, driver missing, no GPU
            logger.debug("NVML did not load; GPU figures will say why", exc_info=True)
            _error = f"NVML is not available: {exc}"
            raise NvmlUnavailable(_error) from None
        _initialised = True
        return _lib


def available() -> bool:
    try:
        lib()
        return True
    except NvmlUnavailable:
        return False


def unavailable_reason() -> str | None:
    try:
        lib()
        return None
    except NvmlUnavailable as exc:
        return str(exc)


def query(fn: str | Callable, *args, default=None):
    """Call NVML function ``fn`` (name or callable); ``default`` where it is unsupported.

    >>> query("nvmlDeviceGetTemperature", handle, 0)   # doctest: +SKIP
    34
    """
    nv = lib()
    func = getattr(nv, fn) if isinstance(fn, str) else fn
    try:
        return func(*args)
    except Exception:  # NVMLError_NotSupported, NoPermission, GpuIsLost...
        logger.debug("NVML %s is unsupported here; using %r", getattr(func, "__name__", func), default,
                     exc_info=True)
        return default


def text(value) -> str | None:
    """NVML returns bytes from old bindings and str from new ones."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)

