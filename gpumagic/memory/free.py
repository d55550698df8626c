"""Freeing memory: ``%gpumem --free``.

:func:`free_memory` lets go of what only IPython's own machinery holds (the last
error wherever it is kept, and with ``history=True`` the output history's
tensors), collects garbage, releases torch's cached blocks, and reports per
device the bytes freed and what still holds memory: the notebook's variables,
largest first, and storages no variable holds with what holds them.

Afterwards the kernel holds what its variables hold. Nothing here imports torch
or initialises CUDA: torch is asked only about devices it already set up.
"""
from __future__ import annotations

import gc
import logging
import sys
from dataclasses import dataclass, field

from ..devices import discovery as devices
from ..display import fmt_bytes, html_table, text_table
from . import history as out_history
from . import last_error
from .holders import Unnamed, unnamed_tensors
from .variables import VarsReport, _torch, variable_memory

logger = logging.getLogger(__name__)

__all__ = ["FreedRow", "FreeReport", "free_memory", "measure", "release_caches", "trim_c_heap", "ErrorRelease",
           "release_last_error"]

UNNAMED_FLOOR = 2 << 20   # bytes a GPU's allocation may exceed its variables' before the rest is looked for


@dataclass
class FreedRow:
    device: str
    before: int | None
    after: int | None
    what: str

    @property
    def freed(self) -> int | None:
        if self.before is None or self.after is None:
            return None
        return self.before - self.after


@dataclass
class ErrorRelease:
    """What letting go of the last error did: which error, where it was kept, frames cleared, and
    the notebook variables that hold it still (then nothing was let go)."""
    label: str = ""
    holders: list[str] = field(default_factory=list)
    frames_cleared: int = 0
    held_by: list[str] = field(default_factory=list)

    def text(self) -> str:
        if self.held_by:
            return (f"the last error ({self.label}) is held by notebook variable {', '.join(self.held_by)}: "
                    f"`del {', '.join(self.held_by)}` lets it go")
        return (f"let go of the last error ({self.label}), kept by {', '.join(self.holders)}; "
                f"{self.frames_cleared} frame{'s' if self.frames_cleared != 1 else ''} cleared "
                "(%debug has nothing to show now)")


def measure(torch, indices) -> dict[str, int | None]:
    """The figures freeing changes: ``cpu`` (resident), ``cuda:N`` (allocated) and ``cuda:N reserved``."""
    import psutil
    figures: dict[str, int | None] = {"cpu": int(psutil.Process().memory_info().rss)}
    for i in indices:
        figures[f"cuda:{i}"] = int(torch.cuda.memory_allocated(i))
        figures[f"cuda:{i} reserved"] = int(torch.cuda.memory_reserved(i))
    return figures


def release_caches(torch) -> int:
    """``gc.collect()``, then what torch keeps for reuse on GPUs this kernel set up: the caching
    allocator's free blocks, cuBLAS workspaces and cuFFT plans (both count as allocated), and
    tensors shared with processes that are gone; and on Linux the C allocator's free memory, which
    it keeps for reuse rather than give back (``malloc_trim``). Returns what the collector found
    unreachable."""
    collected = gc.collect()
    trim_c_heap()
    if torch is None or not devices.torch_cuda_initialized():
        return collected
    torch.cuda.synchronize()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    for i in range(torch.cuda.device_count()):
        try:
            torch.backends.cuda.cufft_plan_cache[i].clear()
        except Exception:  # a build without cuFFT: nothing cached there
            logger.debug("no cuFFT plan cache to clear on cuda:%d", i, exc_info=True)
    torch.cuda.empty_cache()
    torch.cuda.ipc_collect()
    return collected


def trim_c_heap() -> None:
    """glibc keeps freed blocks under 32 MiB (a tensor of a few MiB, an activation) in its heap: the
    kernel's resident memory stays up until ``malloc_trim`` gives the free pages back."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc (musl): nothing kept that way
        logger.debug("no malloc_trim here", exc_info=True)


def release_last_error(shell, user_ns: dict, hidden=(), holders=()) -> ErrorRelease | None:
    """Let go of the last error where only IPython and ``sys`` keep it: drop their references and
    clear its frames' locals. Where a notebook variable holds it, nothing changes and the release
    names the variable. None where no error is kept."""
    kept = last_error.kept_errors(shell)
    if not kept:
        return None
    release = ErrorRelease(label=kept[0].label)
    release.held_by = _variables_reaching([k.error for k in kept], user_ns, hidden, holders)
    if release.held_by:
        return release
    frames = last_error.error_frames([k.error for k in kept])
    release.holders = last_error.let_go(shell)
    release.frames_cleared, _ = last_error.clear_frames(frames)
    return release


def _variables_reaching(errors, user_ns: dict, hidden, holders) -> list[str]:
    """Notebook variables through which an error (or its traceback) is reachable: `err` after
    ``except Exception as err`` at a cell's top level."""
    from .storages import Collector
    torch = _torch()
    if torch is None:
        return []
    wanted = {id(e) for e in errors}
    names = []
    skip = frozenset(id(o) for o in (user_ns, *holders) if o is not None)
    hidden = set(hidden)
    for name, value in list(user_ns.items()):
        if name.startswith("_") or name in hidden:
            continue
        if id(value) in wanted:
            names.append(name)
            continue
        collector = Collector(torch, 6, 100_000, skip=skip)
        try:
            collector.walk(value)
        except Exception:  # an unreadable variable cannot be proven to hold the error
            logger.debug("reading variable %r failed", name, exc_info=True)
            continue
        if wanted & collector.visited:
            names.append(name)
    return names


class FreeReport:
    """What ``%gpumem --free`` did: per device, memory before and after, and what still holds memory."""

    header = ["device", "measured", "before", "after", "freed"]

    def __init__(self, rows: list[FreedRow], collected: int, notes: list[str] | None = None,
                 error: ErrorRelease | None = None, history: list[str] | None = None,
                 held: VarsReport | None = None, unnamed: list[Unnamed] | None = None):
        self.rows = rows
        self.collected = collected
        self.notes = notes or []
        self.error = error
        self.history = history or []
        self.held = held
        self.unnamed = unnamed or []

    def __getitem__(self, device: str) -> FreedRow:
        """The row of ``device``: a GPU's allocated bytes, the CPU's resident memory."""
        for row in self.rows:
            if row.device == device:
                return row
        raise KeyError(device)

    def row(self, device: str, what: str) -> FreedRow:
        """``report.row("cuda:0", "torch reserved")``."""
        for row in self.rows:
            if row.device == device and row.what == what:
                return row
        raise KeyError((device, what))

    def as_dict(self) -> dict:
        devices_: dict[str, dict] = {}
        for r in self.rows:
            figures = {"before": r.before, "after": r.after, "freed": r.freed}
            if r.device not in devices_:
                devices_[r.device] = {"measured": r.what, **figures}
            else:   # a GPU's reserved bytes beside its allocated ones
                devices_[r.device][r.what.removeprefix("torch ")] = figures
        return {
            "collected": self.collected,
            "devices": devices_,
            "last_error": None if self.error is None else {
                "error": self.error.label, "let_go": self.error.holders, "frames_cleared": self.error.frames_cleared,
                "held_by": self.error.held_by},
            "history": list(self.history),
            "held": [] if self.held is None else [
                {"name": r.name, "device": r.device, "bytes": r.nbytes} for r in self.held.rows],
            "unnamed": [{"device": u.device, "bytes": u.nbytes, "holder": u.holder} for u in self.unnamed],
            "notes": list(self.notes),
        }

    def _cells(self):
        return [[r.device, r.what, fmt_bytes(r.before), fmt_bytes(r.after), fmt_bytes(r.freed)]
                for r in self.rows]

    def _lines(self) -> tuple[list[str], list[str]]:
        """(what was let go, what still holds memory), one line each."""
        done = []
        if self.error is not None:
            done.append(self.error.text())
        if self.history:
            done.append(f"dropped from the output history: {', '.join(self.history)}")
        done.append(f"garbage collector: {self.collected} unreachable objects")
        return done, _still_held(self.held, self.unnamed)

    def text(self) -> str:
        done, held = self._lines()
        return "\n".join([*done, text_table(self._cells(), self.header), *held, *self.notes])

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def _repr_html_(self):
        import html
        done, held = self._lines()
        head = "".join(f"<div>{html.escape(line)}</div>" for line in done)
        tail = "".join(f"<div>{html.escape(line)}</div>" for line in [*held, *self.notes])
        return head + html_table(self._cells(), self.header) + tail

    def __repr__(self):
        return self.text()


def _still_held(held: VarsReport | None, unnamed: list[Unnamed], most: int = 4) -> list[str]:
    """``still held on cuda:0: model 1.5 GiB, opt 512.0 MiB`` per device; then what no variable holds."""
    lines = []
    by_device: dict[str, list] = {}
    for r in held.rows if held is not None else ():
        by_device.setdefault(r.device, []).append(r)
    for device, rows in sorted(by_device.items()):
        names = ", ".join(f"{r.name} {fmt_bytes(r.nbytes)}" for r in rows[:most])
        more = f" and {len(rows) - most} more" if len(rows) > most else ""
        total = held.totals.get(device, 0) if held is not None else 0
        lines.append(f"still held on {device}: {fmt_bytes(total)} by notebook variables: {names}{more}")
    for u in unnamed:
        lines.append(f"still held on {u.device}: {fmt_bytes(u.nbytes)} that no notebook variable holds, by {u.holder}")
    return lines


def free_memory(device: str | None = None, history: dict | None = None, user_ns: dict | None = None,
                hidden=(), holders=(), last_error: BaseException | None = None, shell=None,
                drop_history: bool = False) -> FreeReport:
    """Let go of what only IPython holds, collect garbage, release torch's caches; report it.

    ``shell`` (IPython's) is where the last error and the output history are kept: the
    error is let go (unless a notebook variable holds it), and with ``drop_history`` the
    ``Out`` entries that reach tensors too. GPUs report torch's allocated and reserved bytes
    before and after (only devices this kernel initialised); the CPU, the kernel's resident
    memory. ``device`` limits the report, not the freeing. ``last_error`` is accepted for a
    shell-less call and only named in a note.

    In a notebook::

        del model, optimizer
        %gpumem --free
        %gpumem --free --history     # also Out[...] entries that hold tensors
    """
    torch = _torch()
    ns = user_ns if user_ns is not None else {}
    cuda = devices.torch_cuda_initialized()
    indices = list(range(torch.cuda.device_count())) if cuda else []
    before = measure(torch, indices)
    error = release_last_error(shell, ns, hidden, holders) if shell is not None else None
    dropped = []
    if drop_history and shell is not None and torch is not None:
        dropped = out_history.drop_entries(shell, out_history.tensor_entries(torch, history))
    collected = release_caches(torch)
    mps = _release_mps(torch, device)
    after = measure(torch, indices)
    rows = _rows(before, after, indices, mps)
    if device is not None:
        rows = [r for r in rows if r.device == device]
    report = FreeReport(rows, collected, error=error, history=dropped)
    if torch is not None:
        _fill_held(report, torch, ns, hidden, history, holders, device, indices, after)
        report.notes += _notes(torch, history, None if shell is not None else last_error, device, ns, holders,
                               drop_history)
    if not cuda and (device is None or device.startswith("cuda")):
        report.notes.append("this kernel has not initialised CUDA, so it holds no cached GPU blocks.")
    return report


def _release_mps(torch, device: str | None) -> tuple[int, int] | None:
    if torch is None or "mps" not in (device or "mps") or not devices.mps_available():
        return None
    before = int(torch.mps.driver_allocated_memory())
    torch.mps.empty_cache()
    return before, int(torch.mps.driver_allocated_memory())


def _rows(before: dict, after: dict, indices, mps) -> list[FreedRow]:
    rows = [FreedRow("cpu", before["cpu"], after["cpu"], "kernel resident")]
    for i in indices:
        rows.append(FreedRow(f"cuda:{i}", before[f"cuda:{i}"], after[f"cuda:{i}"], "torch allocated"))
        rows.append(FreedRow(f"cuda:{i}", before[f"cuda:{i} reserved"], after[f"cuda:{i} reserved"],
                             "torch reserved"))
    if mps is not None:
        rows.append(FreedRow("mps", mps[0], mps[1], "mps driver"))
    return rows


def _fill_held(report: FreeReport, torch, ns: dict, hidden, history, holders, device, indices, after) -> None:
    """What still holds memory: the variables, and on a GPU whatever its allocation holds beyond them."""
    report.held = variable_memory(ns, hidden=hidden, device=device, history=history, holders=holders)
    for i in indices:
        name = f"cuda:{i}"
        if device is not None and device != name:
            continue
        beyond = (after[name] or 0) - report.held.totals.get(name, 0)
        if beyond > UNNAMED_FLOOR:
            report.unnamed += unnamed_tensors(torch, name, set(report.held.storage_keys))


def _notes(torch, history, last_error_value, device, ns, holders, dropped_history: bool) -> list[str]:
    """What the output history (and, without a shell, a given error) alone still holds."""
    from .variables import _collect, _kept_notes, _skip
    return _kept_notes(None if dropped_history else history, last_error_value, device,
                        lambda: _collect(torch, ns, (), 6, 100_000, _skip(ns, history, holders))[1],
                       _skip(ns, None, holders))
