"""Profiler traces and TensorBoard logs a ``%%dataparallel`` cell writes: rank 0's, as a plain cell
writes them.

The profiler recipe ends with ``prof.export_chrome_trace("trace.json")``. torch writes that file
from C++ (a ``trace.json.tmp`` renamed into place), not through Python's ``open()``, so the
cell's file writes (:mod:`.rank_files`) never saw it: every rank wrote the same temporary name
at once, one rank's rename found it gone (``Failed to rename trace.json.tmp``), and the notebook
could be left with no trace, or another rank's. As with printing and ``torch.save``, rank 0's
export is the cell's; the others' go to a private directory removed with the cell. So do the
event files of a ``SummaryWriter`` the cell makes (one per rank in the same folder, otherwise).
(A writer made in the notebook is another matter: it stays in the kernel, :mod:`~gpumagic.procs.relays`.)

Runs in the workers: no IPython.
"""
from __future__ import annotations

import contextlib
import functools
import os

from ...procs.import_patches import patch_module
from .files import PrivateDirectory

__all__ = ["exporting_once"]

# (module, class, method) whose first argument after self is the path the notebook asked for
_EXPORTS = (("torch.profiler.profiler", "_KinetoProfile", "export_chrome_trace"),
            ("torch.profiler.profiler", "_KinetoProfile", "export_stacks"),
            ("torch.profiler.profiler", "_KinetoProfile", "export_memory_timeline"),
            ("torch.autograd.profiler", "profile", "export_chrome_trace"),
            ("torch.autograd.profiler", "profile", "export_stacks"))


# TensorBoard's writers, made in the cell, each start a log directory's event file of their own
_WRITERS = ("torch.utils.tensorboard.writer", "tensorboardX.writer")
_private: PrivateDirectory | None = None   # while a cell runs on a rank other than 0


@contextlib.contextmanager
def exporting_once(rank: int):
    """While the cell runs, on ranks other than 0, the profiler's exports and the TensorBoard
    writers the cell makes write into a private directory instead of the path given."""
    if rank == 0:
        yield
        return
    import importlib
    global _private
    _private = PrivateDirectory("gpumagic-rank-exports-")
    saved = []
    for module_name, class_name, method in _EXPORTS:
        cls = getattr(importlib.import_module(module_name), class_name, None)
        original = getattr(cls, method, None) if cls is not None else None
        if original is not None:
            saved.append((cls, method, original))
            setattr(cls, method, _redirected(original))
    for name in _WRITERS:   # (now if imported, else as it is: inert outside a cell)
        patch_module(name, _private_writer)
    try:
        yield
    finally:
        for cls, method, original in saved:
            setattr(cls, method, original)
        private, _private = _private, None
        private.remove()


def _private_dir() -> str:
    assert _private is not None, "only while a cell runs on a rank other than 0"
    return _private.get()


def _redirected(export):
    @functools.wraps(export)
    def call(self, path, *args, **kwargs):
        if isinstance(path, (str, os.PathLike)):
            # the same name (its suffix tells torch to gzip, say), in this rank's own directory
            path = os.path.join(_private_dir(), os.path.basename(os.fspath(path)) or "trace")
        return export(self, path, *args, **kwargs)
    return call


def _private_writer(module) -> None:
    """``SummaryWriter(log_dir)`` made in a cell on a rank other than 0 logs into the rank's private
    directory: TensorBoard would show a second curve (or twice the points) from the same folder."""
    cls = getattr(module, "SummaryWriter", None)
    if cls is None or getattr(cls.__init__, "_rank_zero_logs", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def init(self, log_dir=None, *args, **kwargs):
        if log_dir is None:
            log_dir = kwargs.pop("logdir", None)   # (tensorboardX's name for it)
        if _private is not None:
            log_dir = os.path.join(_private_dir(), os.path.basename(os.fspath(log_dir)) if log_dir else "runs")
        original(self, log_dir, *args, **kwargs)

    init._rank_zero_logs = True   # type: ignore[attr-defined]
    cls.__init__ = init
