"""Files a ``%%dataparallel`` cell saves with ``torch.save``: rank 0's, written whole.

In gpumagic's DDP mode each rank runs the cell as written for one process, so a checkpoint saved in
the loop (the tutorials' ``torch.save({'epoch': ..., 'loss': loss, ...}, PATH)``) is saved by every
rank to the same path: the last rank to finish wins (rank 1's loss beside the notebook's rank 0
values), and two writes at once can interleave into a file ``torch.load`` rejects. As with printing,
rank 0's act is the cell's: the file is rank 0's, written to a temporary name and renamed, so that
a reader never sees half of it. Another rank's save goes to a private copy that its own
``torch.load`` of the same path reads, so each rank still reads back what it saved (a cell that
reloads its best checkpoint behaves as in one process); the copies go with the cell.

Runs in the workers: no IPython.

A cell like this writes ``ckpt.pt`` once, rank 0's::

    %%dataparallel
    for epoch in range(3):
        train_one_epoch(model, loader, opt)
        torch.save({"epoch": epoch, "model_state_dict": model.state_dict()}, "ckpt.pt")
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

__all__ = ["saving_once"]


@contextlib.contextmanager
def saving_once(rank: int):
    """``torch.save`` to a path writes rank 0's file only (atomically); ``torch.load`` on another rank
    reads that rank's own copy of a path it saved. Saves to open files and buffers are untouched."""
    import torch
    save, load = torch.save, torch.load
    private = tempfile.mkdtemp(prefix=f"gpumagic-rank{rank}-") if rank != 0 else None
    copies: dict[str, str] = {}   # real path -> this rank's copy

    @functools.wraps(save)
    def rank_save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return save(obj, f, *args, **kwargs)
        path = os.path.abspath(os.fspath(f))
        if private is not None:
            copy = copies.setdefault(path, os.path.join(private, str(len(copies))))
            return save(obj, copy, *args, **kwargs)
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
            f = copies.get(os.path.abspath(os.fspath(f)), f)
        return load(f, *args, **kwargs)

    torch.save = rank_save
    if private is not None:
        torch.load = rank_load
    try:
        yield
    finally:
        torch.save, torch.load = save, load
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
