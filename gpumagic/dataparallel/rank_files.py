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
it.

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

from ..cell.compile import is_cell

logger = logging.getLogger(__name__)

__all__ = ["writing_once"]

_WRITES = set("wax+")


@contextlib.contextmanager
def writing_once(rank: int):
    """While the cell runs: ``torch.save`` to a path writes rank 0's file only (atomically), and on
    another rank ``torch.save`` and the notebook's ``open()`` for writing go to this rank's private
    copies, which its ``torch.load`` and ``open()`` of the same paths read. Saves to open files and
    buffers are untouched."""
    import torch
    save, load, open_ = torch.save, torch.load, builtins.open
    private = tempfile.mkdtemp(prefix=f"gpumagic-rank{rank}-") if rank != 0 else None
    copies: dict[str, str] = {}   # real path -> this rank's copy

    def copy_of(f, writing: bool, keep_contents: bool = False) -> str | None:
        """This rank's copy of path ``f`` (made when ``writing``, from the real file's contents when
        ``keep_contents``), or None where it has none."""
        path = os.path.abspath(os.fspath(f))
        copy = copies.get(path)
        if copy is None and writing and private is not None:
            copy = copies[path] = os.path.join(private, str(len(copies)))
            if keep_contents and os.path.isfile(path):
                shutil.copyfile(path, copy)
        return copy

    @functools.wraps(save)
    def rank_save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return save(obj, f, *args, **kwargs)
        if private is not None:
            return save(obj, copy_of(f, writing=True), *args, **kwargs)
        path = os.path.abspath(os.fspath(f))
        # A name beside the target, so the rename stays on one file system (and is atomic).
        partial = f"{path}.{os.getpid()}.partial"
        try:
            save(obj, partial, *args, **kwargs)
            os.replace(partial, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise

    @functools.wraps(load)
    def rank_load(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            f = copy_of(f, writing=False) or f
        return load(f, *args, **kwargs)

    @functools.wraps(open_)
    def rank_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and _from_notebook(sys._getframe(1)):
            writing = bool(_WRITES & set(mode))
            file = copy_of(file, writing, keep_contents="a" in mode or "+" in mode) or file
        return open_(file, mode, *args, **kwargs)

    torch.save = rank_save
    if private is not None:
        torch.load = rank_load
        builtins.open = io.open = rank_open
    try:
        yield
    finally:
        torch.save, torch.load = save, load
        builtins.open = io.open = open_
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


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
