"""Files a ``%%dataparallel`` cell writes: rank 0's, once, as a plain cell writes them.

In gpumagic's DDP mode each rank runs the cell as written for one process, so a checkpoint saved in
the loop (the tutorials' ``torch.save({'epoch': ..., 'loss': loss, ...}, PATH)``) or a log the loop
appends to (``open('log.csv', 'a').write(...)``) was written by every rank: the checkpoint held
the last rank's loss (not the notebook's, rank 0's), two saves at once could interleave into a file
``torch.load`` rejects, and the log had every line once per rank. As with printing, rank 0's act is
the cell's: rank 0 writes the real files (a ``torch.save`` under a temporary name, then renamed, so
that a reader never sees half of one); another rank's writes go to private copies that its own
reads of the same path read back (a cell that reloads its best checkpoint behaves as in one
process), removed with the cell; a copy appended to starts from the file as that rank first opens
it. ``torch.jit.save`` and ``torch.export.save`` write their path from C++, not through ``open()``:
they are rank 0's once too (every rank wrote the same file before, and a reader could catch one
rank's half-written archive).

Only ``open()`` calls made for the notebook's own code are redirected: by the cell or functions
defined in the notebook, or by the data writers they call (``pathlib``'s ``write_text``,
``np.save``, ``df.to_csv``, ``fig.savefig``). A library's own files (a compiler's cache, a
framework's) are its business on each rank.

Runs in the workers: no IPython.

A cell like this writes ``ckpt.pt`` and ``log.csv`` once, rank 0's::

    %%dataparallel
    for epoch in range(3):
        loss = train_one_epoch(model, loader, opt)
        torch.save({"epoch": epoch, "model_state_dict": model.state_dict()}, "ckpt.pt")
        with open("log.csv", "a") as f:
            f.write(f"{epoch},{loss}\\n")
"""
from __future__ import annotations

import builtins
import contextlib
import functools
import io
import logging
import os
import shutil
import sys
import tempfile
import time

from ...cell.compile import is_cell

logger = logging.getLogger(__name__)

__all__ = ["writing_once", "PrivateDirectory"]

_WRITES = set("wax+")


class PrivateDirectory:
    """Where a rank other than 0 writes in place of the cell's real files: made at first use (a rank
    killed mid-cell leaves none behind for the cells that write nothing, most of them), removed with
    the cell."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.path: str | None = None

    def get(self) -> str:
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix=self.prefix)
        return self.path

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


# Savers that write a path from C++ (not through ``open()``), with their loaders: (module, saver, loader).
_SAVERS = (("torch", "save", "load"), ("torch.jit", "save", "load"), ("torch.export", "save", "load"))


class _RankFiles:
    """One rank's files for a cell: rank 0 writes the real ones; another rank its private copies."""

    def __init__(self, rank: int):
        self.other = rank != 0
        self.private = PrivateDirectory(f"gpumagic-rank{rank}-")
        self.copies: dict[str, str] = {}   # real path -> this rank's copy
        self.started = time.time_ns()
        self.open = builtins.open

    def copy_of(self, f, writing: bool, keep_contents: bool = False) -> str | None:
        """This rank's copy of path ``f`` (made when ``writing``, from the real file's contents when
        ``keep_contents``), or None where it has none. It keeps the path's suffix, which ``torch.export.save``
        reads."""
        path = os.path.abspath(os.fspath(f))
        copy = self.copies.get(path)
        if copy is None and writing and self.other:
            suffix = os.path.splitext(path)[1]
            copy = self.copies[path] = os.path.join(self.private.get(), f"{len(self.copies)}{suffix}")
            if keep_contents and os.path.isfile(path):
                shutil.copyfile(path, copy)
        return copy

    def once(self, save):
        @functools.wraps(save)
        def rank_save(obj, f, *args, **kwargs):
            if not isinstance(f, (str, os.PathLike)):
                return save(obj, f, *args, **kwargs)
            if not self.other:
                return _saved_whole(save, obj, f, args, kwargs)
            if _fails_at_once(f, "w", self.copies, self.started):   # as rank 0's will: the ranks fail alike
                return save(obj, f, *args, **kwargs)
            return save(obj, self.copy_of(f, writing=True), *args, **kwargs)
        return rank_save

    def own_copy(self, load):
        @functools.wraps(load)
        def rank_load(f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)):
                f = self.copy_of(f, writing=False) or f
            return load(f, *args, **kwargs)
        return rank_load

    def rank_open(self):
        open_ = self.open

        @functools.wraps(open_)
        def rank_open(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and _from_notebook(sys._getframe(1)):
                writing = bool(_WRITES & set(mode))
                if not (writing and self.other and _fails_at_once(file, mode, self.copies, self.started)):
                    file = self.copy_of(file, writing, keep_contents="a" in mode or "+" in mode) or file
            return open_(file, mode, *args, **kwargs)
        return rank_open


@contextlib.contextmanager
def writing_once(rank: int):
    """While the cell runs: ``torch.save``, ``torch.jit.save`` and ``torch.export.save`` to a path write
    rank 0's file only (atomically), and on another rank they and the notebook's ``open()`` for
    writing go to this rank's private copies, which its ``torch.load``, ``torch.jit.load``,
    ``torch.export.load`` and ``open()`` of the same paths read. Saves to open files and buffers are
    untouched."""
    import importlib
    files = _RankFiles(rank)
    saved = []   # (module, attribute, original)
    try:
        for module_name, save_name, load_name in _SAVERS:
            module = importlib.import_module(module_name)
            saved.append((module, save_name, getattr(module, save_name)))
            setattr(module, save_name, files.once(getattr(module, save_name)))
            if files.other:
                saved.append((module, load_name, getattr(module, load_name)))
                setattr(module, load_name, files.own_copy(getattr(module, load_name)))
        if files.other:
            builtins.open = io.open = files.rank_open()
        yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)
        builtins.open = io.open = files.open
        files.private.remove()


def _saved_whole(save, obj, f, args, kwargs):
    """Rank 0's save of ``obj`` to path ``f``: into a temporary directory beside it, then renamed into
    place, so that a reader never sees half a file. Through a link, the file it points to (a plain save writes there;
    a rename would replace the link); a device or a pipe (``/dev/null``) is written as it is."""
    path = os.path.realpath(os.fspath(f))
    if os.path.exists(path) and not os.path.isfile(path):
        return save(obj, f, *args, **kwargs)
    # In a directory beside the target, so the rename stays on one file system (and is atomic), under
    # the target's own name: torch's savers name the archive's records after the file's name.
    try:
        partial_dir = tempfile.mkdtemp(prefix=".gpumagic-partial-", dir=os.path.dirname(path))
    except OSError:   # a missing or read-only directory: the save itself fails, as in a plain cell
        return save(obj, f, *args, **kwargs)
    partial = os.path.join(partial_dir, os.path.basename(path))
    try:
        result = save(obj, partial, *args, **kwargs)
        os.replace(partial, path)
    finally:
        shutil.rmtree(partial_dir, ignore_errors=True)
    return result


def _fails_at_once(f, mode: str, copies: dict, started: int) -> bool:
    """Whether writing the real path ``f`` fails before anything is written: its directory is missing,
    it is a directory, or ``"x"`` finds a file that was there before the cell. Rank 0's write then
    raises; another rank, which would have written a private copy and gone on (to wait in the next
    collective for rank 0, and the pool would be ended), makes the same call on the real path and
    raises the same error. (A file rank 0 made during the cell is no reason: on one process it
    would not exist yet. ``started`` is when this rank's cell began, in ns, with a margin for the
    file system's coarser clock.)"""
    path = os.path.abspath(os.fspath(f))
    if path in copies:   # this rank wrote it already: its own copy decides, as rank 0's file does there
        return False
    if not os.path.isdir(os.path.dirname(path)) or os.path.isdir(path):
        return True
    if "x" not in mode:
        return False
    try:
        return os.lstat(path).st_ctime_ns < started - _CLOCK_MARGIN
    except OSError:
        return False


_CLOCK_MARGIN = 20_000_000   # ns: a few ticks of the coarse clock file times are read from


# Packages that write the data a notebook asks them to (a path it gives them), not files of their own.
_DATA_WRITERS = frozenset({"pathlib", "numpy", "pandas", "matplotlib", "PIL", "csv", "json", "pickle"})


def _from_notebook(frame) -> bool:
    """Whether the notebook's code made this call: directly, or through a data writer it called."""
    for _ in range(24):
        if frame is None:
            return False
        if is_cell(frame.f_code.co_filename):
            return True
        if frame.f_globals.get("__name__", "").split(".")[0] not in _DATA_WRITERS:
            return False
        frame = frame.f_back
    return False
