"""Getting back what the last error holds: ``%gpumem --rescue`` and ``--rescue --drop``.

After an out-of-memory error the failing frames still hold their locals (the
batch, the activations) and whatever their autograd graphs saved. :func:`rescue`
moves every storage only the error reaches from the GPUs to the CPU in place
(:mod:`.moving`: the same tensor objects, so ``%debug`` still shows them; the
graphs keep CPU copies and hand them back on the GPU should ``backward()`` run),
then releases torch's caches. With ``drop=True`` it lets go of the error
instead (:func:`.free.release_last_error`): its frames' locals are gone.

The notebook's own variables are never touched: a storage any of them reaches
(the model's weights, the optimizer's state, the batch) stays where it is.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..devices import discovery as devices
from ..display import fmt_bytes
from . import last_error, moving
from .free import ErrorRelease, measure, release_caches, release_last_error
from .variables import _collect, _skip, _torch

logger = logging.getLogger(__name__)

__all__ = ["RescueReport", "rescue", "NotEnoughHostMemory", "error_holdings"]

HOST_MARGIN = 1 << 30   # host memory left free after a rescue's copies: the kernel must go on working


class NotEnoughHostMemory(RuntimeError):
    """The CPU has too little memory available for what the error holds on the GPUs."""


@dataclass
class RescueReport:
    """What ``%gpumem --rescue`` did: what the error held and where it went, and the bytes per device."""
    error: str = ""
    moved: moving.MoveResult | None = None
    dropped: ErrorRelease | None = None
    on_cpu: int = 0                       # bytes the error holds on the CPU (a rescue leaves them)
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def freed(self, device: str) -> int | None:
        """Bytes freed on ``device`` (a GPU's allocated bytes, the CPU's resident memory)."""
        if self.before.get(device) is None or self.after.get(device) is None:
            return None
        return self.before[device] - self.after[device]

    def as_dict(self) -> dict:
        moved = self.moved
        return {
            "error": self.error,
            "moved": dict(moved.moved) if moved else {},
            "tensors": moved.tensors if moved else 0,
            "saved_tensors": moved.saved if moved else 0,
            "seconds": moved.seconds if moved else 0.0,
            "stayed": [{"device": d, "bytes": b, "why": w} for d, b, w in (moved.stayed if moved else ())],
            "dropped": self.dropped is not None and not self.dropped.held_by,
            "on_cpu": self.on_cpu,
            "before": dict(self.before), "after": dict(self.after),
            "notes": list(self.notes),
        }

    def text(self) -> str:
        lines = []
        if self.dropped is not None:
            lines.append(self.dropped.text())
        if self.moved is not None:
            lines += _move_lines(self.moved)
        for device in sorted(d for d in self.after if not d.endswith("reserved")):
            freed = self.freed(device)
            what = "resident" if device == "cpu" else "allocated"
            change = "" if not freed else f" (freed {fmt_bytes(freed)})" if freed > 0 else \
                f" (+{fmt_bytes(-freed)}: what was moved there)"
            lines.append(f"{device}: {what} {fmt_bytes(self.before[device])} -> {fmt_bytes(self.after[device])}"
                         + change)
        return "\n".join([*lines, *self.notes])

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def _repr_html_(self):
        import html
        return "".join(f"<div>{html.escape(line)}</div>" for line in self.text().splitlines())

    def __repr__(self):
        return self.text()


def _move_lines(moved: moving.MoveResult) -> list[str]:
    lines = []
    for device, nbytes in sorted(moved.moved.items()):
        rate = moved.rate
        speed = f", {rate / 1e9:.1f} GB/s" if rate else ""
        lines.append(f"moved {fmt_bytes(nbytes)} from {device} to the CPU: {moved.tensors} tensors and "
                     f"{moved.saved} tensors saved for backward, in {moved.seconds:.2f} s{speed}")
    for device, nbytes, why in moved.stayed:
        lines.append(f"left {fmt_bytes(nbytes)} on {device}: {why}")
    return lines


def error_holdings(torch, shell, user_ns: dict, hidden=(), holders=(), devices_=None):
    """``(groups, kept)``: the storages only the kept errors reach (not the notebook's variables nor
    its output history), grouped by storage (:func:`.moving.gather`), and the kept errors."""
    kept = last_error.kept_errors(shell)
    if not kept:
        return {}, kept
    history = user_ns.get("Out")
    notebook = _collect(torch, user_ns, hidden, 6, 100_000, _skip(user_ns, history, holders))[1]
    held = set(notebook)
    if isinstance(history, dict):
        from .storages import Collector
        seen = Collector(torch, 6, 100_000, skip=_skip(user_ns, None, holders))
        seen.walk(history)
        held.update(seen.storages, seen.via_graph)
    skip_ids = frozenset(id(o) for o in (user_ns, history, *holders) if o is not None)
    groups, _ = moving.gather(torch, [k.error for k in kept], skip_keys=held, skip_ids=skip_ids,
                              devices=devices_)
    return groups, kept


def rescue(shell, user_ns: dict, hidden=(), holders=(), device: str | None = None,
           drop: bool = False) -> RescueReport:
    """Move what only the last error holds off the GPUs (``drop``: let go of the error), then release
    torch's caches. ``device`` limits the move to one GPU.

    Raises :class:`NotEnoughHostMemory` (and moves nothing) where the CPU has too little memory
    available for the copies.

    In a notebook, after a ``torch.OutOfMemoryError``::

        %gpumem --rescue          # the error's tensors to the CPU; %debug still shows them
        %gpumem --rescue --drop   # or let go of them
    """
    torch = _torch()
    report = RescueReport()
    kept = last_error.kept_errors(shell)
    if torch is None or not kept:
        report.notes.append("no error is kept: nothing to rescue.")
        return report
    report.error = kept[0].label
    cuda = devices.torch_cuda_initialized()
    indices = list(range(torch.cuda.device_count())) if cuda else []
    report.before = measure(torch, indices)
    groups, _ = error_holdings(torch, shell, user_ns, hidden, holders)
    report.on_cpu = sum(g.nbytes for g in groups.values() if g.device == "cpu")
    if drop:
        report.dropped = release_last_error(shell, user_ns, hidden, holders)
    else:
        wanted = {k: g for k, g in groups.items()
                  if g.device != "cpu" and (device is None or g.device == device)}
        _check_host_memory(wanted)
        report.moved = moving.move(torch, wanted, to="cpu")
        del wanted
    groups.clear()
    release_caches(torch)
    report.after = measure(torch, indices)
    report.notes += _rescue_notes(report, drop)
    return report


def _check_host_memory(groups: dict) -> None:
    import psutil
    needed = sum(g.nbytes for g in groups.values())
    available = int(psutil.virtual_memory().available)
    if needed and needed + HOST_MARGIN > available:
        devices_ = ", ".join(sorted({g.device for g in groups.values()}))
        raise NotEnoughHostMemory(
            f"the last error holds {fmt_bytes(needed)} on {devices_}, and the CPU has {fmt_bytes(available)} "
            f"available (a rescue leaves {fmt_bytes(HOST_MARGIN)} free): `%gpumem --rescue --drop` lets go of it "
            "instead")


def _rescue_notes(report: RescueReport, drop: bool) -> list[str]:
    notes = []
    if not drop and report.on_cpu:
        notes.append(f"the error also holds {fmt_bytes(report.on_cpu)} on the CPU, which a rescue leaves there: "
                     "`%gpumem --rescue --drop` lets go of it.")
    if not drop and report.moved is not None and not report.moved.moved and not report.on_cpu:
        notes.append("the error holds no tensor that the notebook's variables do not hold too.")
    return notes
