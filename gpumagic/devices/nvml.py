"""NVML, initialised once and lazily; unsupported fields become ``None``.

NVML answers in microseconds and, unlike ``torch.cuda`` queries, never creates
a CUDA context or initialises CUDA in this process, so every monitoring path
in gpumagic goes through here.

A wedged driver can make an NVML call that never returns. What the kernel's
thread reads for ``%gpuinfo`` and ``%gpumem`` goes through :func:`bounded`: a
daemon thread does the reading, waited for at most :data:`READ_TIMEOUT`
seconds; while one is stuck, later bounded reads are refused at once, so hung
threads never pile up.

Tests swap in a stand-in library with :func:`use`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

__all__ = ["NvmlUnavailable", "NvmlTimeout", "READ_TIMEOUT", "READER_NAME", "generation", "use", "lib", "available",
           "unavailable_reason", "query", "text", "bounded", "timeout_note", "left_stuck", "stuck_note"]

_lock = threading.Lock()
_lib: Any = None            # the pynvml module (from nvidia-ml-py), or a stand-in
_error: str | None = None   # why NVML is unavailable, once we know
_initialised = False
generation = 0              # bumped by use(): caches built on NVML answers key on it


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (no library, no driver, no GPU)."""


class NvmlTimeout(NvmlUnavailable):
    """The driver did not answer an NVML call in :data:`READ_TIMEOUT` seconds, or one is still stuck."""


# Seconds a bounded reading may take. NVML answers in microseconds, and nvmlInit in well under a
# second on a driver kept loaded; past this the driver is taken as wedged.
READ_TIMEOUT = 5.0
READER_NAME = "gpumagic-nvml-reader"
T = TypeVar("T")

_stuck_lock = threading.Lock()
_stuck: list[tuple[threading.Event, float, str]] = []   # (set once it returns, since when, what) per stuck reading


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


def bounded(fn: Callable[..., T], *args, what: str = "an NVML call") -> T:
    """``fn(*args)`` run in a daemon thread, waited for at most :data:`READ_TIMEOUT` seconds.

    Its result or exception comes back as if called here. Raises
    :class:`NvmlTimeout` (its message is the note to show) when it takes longer,
    leaving the thread behind, and at once while an earlier reading is still stuck:
    a new one would wait on the same driver.
    """
    note = stuck_note()
    if note is not None:
        raise NvmlTimeout(note)
    timeout = READ_TIMEOUT
    done = threading.Event()
    box: dict[str, Any] = {}

    def read():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            box["error"] = exc
        finally:
            done.set()
    since = time.monotonic()
    reader = threading.Thread(target=read, name=READER_NAME, daemon=True)
    reader.start()
    if not done.wait(timeout):
        left_stuck(done, since, what)
        raise NvmlTimeout(timeout_note(timeout))
    reader.join(timeout)   # it is returning: gone before the caller looks at the threads
    if "error" in box:
        raise box.pop("error")
    return box["value"]


def timeout_note(seconds: float) -> str:
    """What a reading that timed out says."""
    return (f"the GPU driver did not answer in {seconds:g} s (an NVML call has not returned: a wedged driver?); "
            "GPU figures are not shown. `nvidia-smi` in a terminal tells whether the driver answers.")


def left_stuck(done: threading.Event, since: float, what: str) -> None:
    """Record a reading that did not return in time (``done`` is set once it does): until then,
    :func:`bounded` refuses new readings. The memory monitor records its own first reading here."""
    logger.warning("gpumagic: %s did not return within %g s (NVML hangs: a wedged GPU driver?); its daemon "
                   "thread is left behind and no new NVML reading starts until it returns.", what, READ_TIMEOUT)
    with _stuck_lock:
        _stuck.append((done, since, what))


def stuck_note() -> str | None:
    """The note while a reading :func:`bounded` gave up on has not returned yet; None when none is stuck."""
    with _stuck_lock:
        _stuck[:] = [entry for entry in _stuck if not entry[0].is_set()]
        if not _stuck:
            return None
        _, since, what = _stuck[0]
    return (f"the GPU driver did not answer in {READ_TIMEOUT:g} s and still has not: {what}, started "
            f"{time.monotonic() - since:.0f} s ago, has not returned (a wedged driver?), so no new NVML call is "
            "made until it does; GPU figures are not shown.")


def _forget_stuck() -> None:
    # A forked child has none of its parent's threads: nothing of its own is stuck (and the lock may
    # have been held by one of them at the fork).
    global _stuck_lock
    _stuck_lock = threading.Lock()
    _stuck.clear()


os.register_at_fork(after_in_child=_forget_stuck)
