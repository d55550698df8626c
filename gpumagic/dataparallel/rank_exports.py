"""Profiler traces a ``%%dataparallel`` cell exports: rank 0's, as a plain cell writes them.

The profiler recipe ends with ``prof.export_chrome_trace("trace.json")``. torch writes that file
from C++ (a ``trace.json.tmp`` renamed into place), not through Python's ``open()``, so the
cell's file writes (:mod:`.rank_files`) never saw it: every rank wrote the same temporary name
at once, one rank's rename found it gone (``Failed to rename trace.json.tmp``), and the notebook
could be left with no trace, or another rank's. As with printing and ``torch.save``, rank 0's
export is the cell's; the others' go to a private directory removed with the cell.

Runs in the workers: no IPython.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile

__all__ = ["exporting_once"]

# (module, class, method) whose first argument after self is the path the notebook asked for
_EXPORTS = (("torch.profiler.profiler", "_KinetoProfile", "export_chrome_trace"),
            ("torch.profiler.profiler", "_KinetoProfile", "export_stacks"),
            ("torch.profiler.profiler", "_KinetoProfile", "export_memory_timeline"),
            ("torch.autograd.profiler", "profile", "export_chrome_trace"),
            ("torch.autograd.profiler", "profile", "export_stacks"))


@contextlib.contextmanager
def exporting_once(rank: int):
    """While the cell runs, on ranks other than 0, the profiler's exports write into a private
    directory (each path its own file there) instead of the path given."""
    if rank == 0:
        yield
        return
    import importlib
    private = tempfile.mkdtemp(prefix=f"gpumagic-rank{rank}-traces-")
    saved = []
    for module_name, class_name, method in _EXPORTS:
        cls = getattr(importlib.import_module(module_name), class_name, None)
        original = getattr(cls, method, None) if cls is not None else None
        if original is not None:
            saved.append((cls, method, original))
            setattr(cls, method, _redirected(original, private))
    try:
        yield
    finally:
        for cls, method, original in saved:
            setattr(cls, method, original)
        shutil.rmtree(private, ignore_errors=True)


def _redirected(export, private: str):
    @functools.wraps(export)
    def call(self, path, *args, **kwargs):
        if isinstance(path, (str, os.PathLike)):
            # the same name (its suffix tells torch to gzip, say), in this rank's own directory
            path = os.path.join(private, os.path.basename(os.fspath(path)) or "trace")
        return export(self, path, *args, **kwargs)
    return call
