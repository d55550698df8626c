"""The kernel's working directory, ``sys.path`` and environment variables, followed by workers that
outlive the moment they started.

A persistent worker (the ``%%dataparallel`` pool) or one forked from a long-lived
fork server starts with the kernel's directory, path and environment as they were
then. A notebook that later runs ``%cd data``, ``sys.path.insert(0, "src")`` or
``%env HF_HUB_OFFLINE=1`` expects the next cell to see them, as a plain cell does:
its relative paths, its imports and the libraries it configures through the
environment. Each task carries what changed; the worker applies it before the task.

Kernel side::

    view = KernelView()            # as the workers start
    ...
    changes = view.changes()       # before each task: sent with it

Worker side: ``follow(changes)``.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

logger = logging.getLogger(__name__)

__all__ = ["KernelView", "follow", "where_now"]

# A worker's own identity and devices: set for it, never taken from the kernel.
OWN = frozenset({"CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"})


def where_now() -> dict:
    """The kernel's directory and ``sys.path`` (what a worker started from a fork server lacks); the
    directory is None where it was removed since the kernel went there (a plain cell runs on)."""
    return {"cwd": _getcwd(), "path": list(sys.path)}


def _getcwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:   # the directory was removed (``%cd tmp``, then ``rm -r tmp`` from elsewhere)
        return None


class KernelView:
    """What the workers hold of the kernel's environment: the environment as they started, then as
    each task told them."""

    def __init__(self):
        self.environ = dict(os.environ)

    def changes(self) -> dict:
        now = dict(os.environ)
        changed = {**where_now(),
                   "set": {k: v for k, v in now.items() if self.environ.get(k) != v and k not in OWN},
                   "unset": [k for k in self.environ if k not in now and k not in OWN]}
        self.environ = now
        return changed


def follow(changes: dict) -> None:
    """Take the kernel's directory, path and environment changes (:meth:`KernelView.changes`)."""
    cwd = changes.get("cwd")
    # (the worker's own directory may be gone: the kernel went there, then left and removed it)
    if cwd and cwd != _getcwd():
        try:
            os.chdir(cwd)
        except OSError:   # (removed since): the worker stays where it is, as the kernel's cell would fail there
            logger.debug("cannot follow the kernel to %s", cwd, exc_info=True)
    path = changes.get("path")
    if path is not None and path != sys.path:
        sys.path[:] = path
    importlib.invalidate_caches()   # a module written since (%%writefile utils.py) is found
    os.environ.update(changes.get("set") or {})
    for key in changes.get("unset") or ():
        os.environ.pop(key, None)
