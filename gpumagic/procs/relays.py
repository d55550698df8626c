"""Notebook loggers a ``%%dataparallel`` cell writes to: rank 0's calls replayed on the notebook's own.

A TensorBoard ``SummaryWriter`` made in an earlier cell (as PyTorch's TensorBoard tutorial makes
it) holds a thread and an open event file: it cannot travel to the ranks, and a copy per rank would
write an event file per rank. So it stays in the kernel, and each rank gets a :class:`CallRelay`
in its place: on rank 0 every method call (``writer.add_scalar('loss', loss, step)``) is sent to
the kernel as it happens and made there on the notebook's writer, tensors and figures pickled on
the CPU; on the other ranks a call does nothing, as their prints show nothing (``%%sharedtrain``'s
workers are each a trainer of their own: every worker's calls are made). Calls return None; the
writer's plain attributes (``writer.log_dir``) read as in the notebook.

Kernel side: :class:`Relays` (finds the loggers while the cell's values are packed, replays the
calls); rank side: :func:`rank_relays`. In a notebook::

    writer = SummaryWriter("runs/exp1")
    ...
    %%dataparallel
    for step, (x, y) in enumerate(loader):
        ...
        writer.add_scalar("training loss", loss.item(), step)   # one curve, rank 0's, in runs/exp1
"""
from __future__ import annotations

import logging
import pickle

from ..cell.values import is_plain_value
from .returning import NotReturnable, pickled_for_notebook

logger = logging.getLogger(__name__)

__all__ = ["Relays", "CallRelay", "rank_relays", "is_relayed"]

# (module, class): objects whose methods rank 0 calls through the kernel.
RELAYED = {("torch.utils.tensorboard.writer", "SummaryWriter"), ("tensorboardX.writer", "SummaryWriter")}
# Methods that answer from a plain attribute instead of being relayed.
ANSWERS = {"get_logdir": "log_dir", "get_logdir_path": "log_dir"}
CALL_LIMIT = 64 * 2**20   # bytes of one call's arguments (an image, a histogram's tensor)


def is_relayed(value) -> bool:
    return any((c.__module__, c.__name__) in RELAYED for c in type(value).__mro__)


class Relays:
    """Kernel side: ``stand_in_for`` (for :func:`~gpumagic.procs.wire.pack`) stands in for each logger
    it meets; :meth:`replay` makes rank 0's calls on it."""

    def __init__(self):
        self.objects: list = []        # by index, the notebook's loggers this cell reaches
        self.found: dict = {}          # index -> (class name, plain attributes), for the ranks
        self.failed: set[str] = set()  # methods whose call failed here: said once

    def stand_in_for(self, obj) -> tuple | None:
        if not is_relayed(obj):
            return None
        for i, known in enumerate(self.objects):
            if known is obj:
                return ("relay", i)
        self.objects.append(obj)
        public = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
        attrs = {k: v for k, v in public.items() if is_plain_value(v)}
        # The others (``writer.file_writer``) cannot be read on a rank: named there, not called
        self.found[len(self.objects) - 1] = (type(obj).__name__, attrs, [k for k in public if k not in attrs])
        return ("relay", len(self.objects) - 1)

    def replay(self, msg: dict) -> str | None:
        """Make the call ``msg`` carries; a note for the first failure of each method, else None."""
        target = self.objects[msg["index"]]
        method = msg["method"]
        try:
            args, kwargs = pickle.loads(msg["args"])
            getattr(target, method)(*args, **kwargs)
        except Exception as exc:  # rank 0 goes on training; the cell's note says what failed
            logger.debug("%s.%s failed in the kernel", type(target).__name__, method, exc_info=True)
            if method not in self.failed:
                self.failed.add(method)
                return (f"{type(target).__name__}.{method}, called on rank 0, failed in the kernel "
                        f"({type(exc).__name__}: {exc}); later failures of it are not shown")
        return None


_FIELDS = frozenset({"_index", "_kind", "_attrs", "_send", "_active", "_held", "_refused"})


class CallRelay:
    """Rank side: stands for one of the notebook's loggers (see the module's docstring)."""

    def __init__(self, index: int, kind: str, attrs: dict, send, active: bool, held=()):
        self._index, self._kind, self._attrs, self._send, self._active = index, kind, attrs, send, active
        self._held = frozenset(held)   # the notebook's logger's other attributes: not here
        self._refused: set[str] = set()

    def __getattr__(self, name: str):
        # (its own fields are asked for here only before __init__ set them: a copy being made)
        if name.startswith("__") or name in _FIELDS:
            raise AttributeError(name)
        if name in self._attrs:
            return self._attrs[name]
        if name in self._held:
            raise AttributeError(f"{self._kind}.{name} stays in the kernel with the notebook's {self._kind}, "
                                 "which only its calls reach from here; read it in a plain cell")
        if name in ANSWERS:
            return lambda *args, **kwargs: self._attrs.get(ANSWERS[name])
        return lambda *args, **kwargs: self._call(name, args, kwargs)

    def _call(self, method: str, args: tuple, kwargs: dict) -> None:
        if not self._active:
            return
        try:
            blob = pickled_for_notebook((args, kwargs), limit=CALL_LIMIT)
        except NotReturnable as exc:
            if method not in self._refused:
                self._refused.add(method)
                self._send({"kind": "warning", "text": (
                    f"{self._kind}.{method} was not made in the notebook: its arguments cannot go there ({exc}); "
                    "call it in a plain cell after this one")})
            return
        self._send({"kind": "relay", "index": self._index, "method": method, "args": blob})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._call("close", (), {})

    def __repr__(self) -> str:
        return f"<the notebook's {self._kind}, rank 0's calls made there>"


def rank_relays(found: dict, send, active: bool) -> dict:
    """Stand-ins for :func:`~gpumagic.procs.wire.unpack`: a :class:`CallRelay` per logger the kernel found,
    sending calls where ``active`` (rank 0 of a ``%%dataparallel`` cell; every ``%%sharedtrain`` worker)."""
    return {("relay", i): CallRelay(i, kind, attrs, send, active, *held) for i, (kind, attrs, *held) in found.items()}
