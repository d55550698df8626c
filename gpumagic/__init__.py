"""gpumagic: IPython magics that make GPUs pleasant and fast to use from notebooks.

In a notebook::

    %load_ext gpumagic
    %gpuinfo                  # devices, and a picker for the session's device
    %gpumem --watch           # live memory gauges
    %%ondevice cuda:1         # run a cell on a device; .cuda() code follows

``import gpumagic`` is light: torch, NVML and widgets load when a magic needs them.
"""
from __future__ import annotations

import os as _os

if _os.environ.get("GPUMAGIC_WORKER_PYCACHE"):
    # A worker interpreter gpumagic started: keep bytecode where the kernel said (see
    # procs/bytecode.py), before anything else is imported, torch and the standard library's
    # logging and subprocess included. Removed so the worker's environment is the notebook's.
    import sys as _sys
    _sys.pycache_prefix = _os.environ.pop("GPUMAGIC_WORKER_PYCACHE")
    _sys.dont_write_bytecode = False

__version__ = "0.1.0"
__all__ = ["load_ipython_extension", "unload_ipython_extension", "current_device", "set_current_device"]


def current_device():
    """The session's current device (``torch.device``): picked, else ``cuda:0``, else ``cpu``."""
    from .devices import current_device as _current
    return _current()


def set_current_device(device):
    """Make ``device`` (``"cpu"``, ``"cuda:1"``, ``1``...) where later gpumagic cells run."""
    from .devices import set_current_device as _set
    return _set(device)


def load_ipython_extension(ipython) -> None:
    """Called by ``%load_ext gpumagic``; registering twice is harmless."""
    from .magics import register
    register(ipython)


def unload_ipython_extension(ipython) -> None:
    """Called by ``%unload_ext gpumagic``: removes the magics and stops background work."""
    from .magics import unregister
    unregister(ipython)
