"""Fresh workers keep their bytecode where Python is told to write none.

A fresh worker (spawn, the fork server, a ``%%dataparallel`` rank) imports
about a thousand of torch's modules. Where Python writes no bytecode
(``PYTHONDONTWRITEBYTECODE`` or ``-B``, common in containers) and none was
written when torch was installed, it compiles them all first: about 2 s of
CPU per worker, in every cell. Workers then keep their bytecode in a cache of
gpumagic's own, outside every source tree (``sys.pycache_prefix``), and later
workers read it. The cache is ``$GPUMAGIC_PYCACHE``, else
``$XDG_CACHE_HOME/gpumagic/pycache``, else ``~/.cache/gpumagic/pycache``;
``GPUMAGIC_PYCACHE=off`` turns it off. Where Python writes bytecode as usual,
nothing changes. :func:`warm_cache` (run as the extension loads) fills the
cache in the background the first time, so that even the first workers find
it ready.

In a notebook::

    import os
    os.environ["GPUMAGIC_PYCACHE"] = "off"   # workers compile afresh, as Python was told
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

logger = logging.getLogger(__name__)

__all__ = ["SETTING", "WORKER_ENV", "worker_pycache", "bytecode_path", "warm_cache", "stop_warming",
           "reap_warming"]

SETTING = "GPUMAGIC_PYCACHE"            # the person's choice: a directory, or "off"
WORKER_ENV = "GPUMAGIC_WORKER_PYCACHE"  # parent to worker: where to keep bytecode (gpumagic/__init__ applies it)
_OFF = ("off", "0", "no", "false", "none")
_CLOSER = "pycache-warm"

# What fresh workers import: torch, gpumagic's worker sides, DDP, and what a first optimizer step
# imports (torch._dynamo). With these in the cache even the first worker starts from bytecode.
WORKER_IMPORTS = ("gpumagic.procs.worker", "gpumagic.sharedtrain.worker", "gpumagic.dataparallel.rank",
                  "torch.distributed", "torch.nn.parallel", "torch._dynamo")

_warming: subprocess.Popen | None = None   # the process filling the cache, until it is reaped


def _writes_bytecode() -> bool:
    """Whether a fresh interpreter started from here would write bytecode."""
    return not (sys.flags.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE"))


def bytecode_path(source: str, prefix: str | None = None) -> str:
    """Where a fresh interpreter started from here looks for ``source``'s bytecode.

    Like ``importlib.util.cache_from_source``, but for the child: its prefix is
    ``prefix`` if given, else ``PYTHONPYCACHEPREFIX`` from the environment it
    inherits, not this process's.
    """
    directory, name = os.path.split(os.path.abspath(source))
    opt = f".opt-{sys.flags.optimize}" if sys.flags.optimize else ""
    name = f"{name.rpartition('.')[0]}.{sys.implementation.cache_tag}{opt}.pyc"
    prefix = prefix or os.environ.get("PYTHONPYCACHEPREFIX")
    if prefix:
        return os.path.join(os.path.abspath(prefix), directory.lstrip(os.sep), name)
    return os.path.join(directory, "__pycache__", name)


def _torch_source() -> str | None:
    import importlib.util
    spec = importlib.util.find_spec("torch")
    return spec.origin if spec is not None else None


def worker_pycache() -> str | None:
    """The directory fresh workers keep bytecode in.

    None where they need none (Python writes bytecode, or torch's was written
    when it was installed) or where ``GPUMAGIC_PYCACHE=off``.
    """
    setting = os.environ.get(SETTING, "").strip()
    if setting.lower() in _OFF or _writes_bytecode():
        return None
    torch_source = _torch_source()
    if torch_source is None or os.path.exists(bytecode_path(torch_source)):
        return None
    if not setting:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        setting = os.path.join(base, "gpumagic", "pycache")
    path = os.path.abspath(os.path.expanduser(setting))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        logger.debug("no bytecode cache at %s: workers compile as Python would anyway", path, exc_info=True)
        return None
    return path if os.access(path, os.W_OK) else None


def warm_cache() -> subprocess.Popen | None:
    """Fill the workers' bytecode cache in the background where it is needed and holds no torch yet.

    Run as the extension loads: a low-priority Python imports what workers
    import, once per machine (until torch changes), so that even the first
    ``%%sharedtrain`` or ``%%dataparallel`` cell starts its workers from
    bytecode. Returns the ``subprocess.Popen``, or None when there is nothing to do.
    """
    global _warming
    cache = worker_pycache()  # None also where torch is not installed
    torch_source = _torch_source()
    if cache is None or torch_source is None or os.path.exists(bytecode_path(torch_source, cache)):
        return None
    if _warming is not None and _warming.poll() is None:
        return _warming
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (f"import os, sys; os.nice(19); sys.path.insert(0, {package_parent!r}); "
            f"import {', '.join(WORKER_IMPORTS)}")
    # No thread waits for it (a thread would make fork unsafe for %%sharedtrain): it is reaped by
    # the next fresh start or when the extension unloads.
    _warming = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, WORKER_ENV: cache},
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from .. import session
    session.register_closer(_CLOSER, stop_warming)
    return _warming


def stop_warming(timeout: float = 1.0) -> None:
    """Reap the warming process; one still running after ``timeout`` is killed (the cache stays valid)."""
    global _warming
    proc, _warming = _warming, None
    if proc is None:
        return
    from .. import session
    session.unregister_closer(_CLOSER)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def reap_warming() -> None:
    """Reap the warming process if it has finished (called before fresh workers start)."""
    if _warming is not None and _warming.poll() is not None:
        stop_warming()
