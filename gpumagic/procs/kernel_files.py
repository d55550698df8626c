"""A Jupyter kernel's connection file, as its command line names it, and the kernel id in its name.

Every Jupyter kernel is started with its connection file on its command line
(``python -m ipykernel_launcher -f .../kernel-<id>.json``), and so is every
child it forks: the file names a kernel, and tells a kernel (or its child)
from another Python process.

This module is imported by workers: no IPython, no torch.
"""
from __future__ import annotations

import os
import re

__all__ = ["connection_file", "kernel_id"]

_KERNEL_FILE = re.compile(r"^kernel-(?P<id>[A-Za-z0-9_.-]+)\.json$")


def connection_file(cmdline) -> str | None:
    """The kernel connection file a command line names (``-f FILE``, ``--f=FILE``, ``-f=FILE``), else None.

    >>> connection_file(["python", "-m", "ipykernel_launcher", "-f", "/run/kernel-3b2e.json"])
    '/run/kernel-3b2e.json'
    """
    args = list(cmdline or ())
    for i, arg in enumerate(args):
        value = None
        if arg in ("-f", "--f") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(("-f=", "--f=")):
            value = arg.split("=", 1)[1]
        if value and _KERNEL_FILE.match(os.path.basename(value)):
            return value
    return None


def kernel_id(path: str | None) -> str | None:
    """The kernel id in a connection file's name: ``/run/kernel-3b2e.json`` -> ``'3b2e'``."""
    match = _KERNEL_FILE.match(os.path.basename(path)) if path else None
    return match.group("id") if match else None
