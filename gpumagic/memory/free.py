"""Freeing memory: ``%gpumem --free``.

:func:`free_memory` collects garbage, releases torch's cached blocks and reports
what was freed per device. It never imports torch nor initialises CUDA.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

from ..devices import discovery as devices
from ..display import fmt_bytes, html_table, text_table
from .variables import _collect, _kept_notes, _skip, _torch

logger = logging.getLogger(__name__)

__all__ = ["FreedRow", "FreeReport", "free_memory"]


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


class FreeReport:
    """What ``%gpumem --free`` did: per device, memory before and after."""

    header = ["device", "measured", "before", "after", "freed"]

    def __init__(self, rows: list[FreedRow], collected: int, notes: list[str] | None = None):
        self.rows = rows
        self.collected = collected
        self.notes = notes or []

    def __getitem__(self, device: str) -> FreedRow:
        for row in self.rows:
            if row.device == device:
                return row
        raise KeyError(device)

    def as_dict(self) -> dict:
        return {
            "collected": self.collected,
            "devices": {r.device: {"measured": r.what, "before": r.before, "after": r.after, "freed": r.freed}
                        for r in self.rows},
            "notes": list(self.notes),
        }

    def _cells(self):
        return [[r.device, r.what, fmt_bytes(r.before), fmt_bytes(r.after), fmt_bytes(r.freed)]
                for r in self.rows]

    def text(self) -> str:
        lines = [f"garbage collector: {self.collected} unreachable objects",
                 text_table(self._cells(), self.header), *self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def _repr_html_(self):
        import html
        head = f"<div>garbage collector: {self.collected} unreachable objects</div>"
        notes = "".join(f"<div>{html.escape(n)}</div>" for n in self.notes)
        return head + html_table(self._cells(), self.header) + notes

    def __repr__(self):
        return self.text()


def free_memory(device: str | None = None, history: dict | None = None, user_ns: dict | None = None,
                hidden=(), holders=(), last_error: BaseException | None = None) -> FreeReport:
    """Collect garbage and release torch's cached blocks; report what was freed.

    GPUs report torch's reserved bytes before and after (only devices this
    kernel initialised; the others hold nothing of ours); the CPU reports the
    kernel's resident memory. ``device`` limits the report, not the freeing
    (``gc`` and ``empty_cache`` act on everything). ``history`` (IPython's
    ``Out``) and ``last_error`` are checked for tensors they alone keep alive
    (no variable of ``user_ns`` holds them), which freeing cannot release.

    In a notebook::

        del model, optimizer
        %gpumem --free
    """
    import psutil
    proc = psutil.Process()
    torch = _torch()
    cuda = devices.torch_cuda_initialized()
    indices = list(range(torch.cuda.device_count())) if cuda else []

    def reserved():
        return {i: int(torch.cuda.memory_reserved(i)) for i in indices}

    rss_before = proc.memory_info().rss
    before = reserved()
    collected = gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # releases unused cached blocks on every device
    mps = torch is not None and "mps" in (device or "mps") and devices.mps_available()
    if mps:
        mps_before = int(torch.mps.driver_allocated_memory())
        torch.mps.empty_cache()
    after = reserved()
    rss_after = proc.memory_info().rss

    rows = [FreedRow("cpu", rss_before, rss_after, "kernel resident")]
    rows += [FreedRow(f"cuda:{i}", before[i], after[i], "torch reserved") for i in indices]
    if mps:
        rows.append(FreedRow("mps", mps_before, int(torch.mps.driver_allocated_memory()), "mps driver"))
    if device is not None:
        rows = [r for r in rows if r.device == device]
    notes = []
    if torch is not None:
        ns = user_ns or {}
        notes = _kept_notes(history, last_error, device,
                            lambda: _collect(torch, ns, hidden, 6, 100_000, _skip(ns, history, holders))[1],
                            _skip(ns, None, holders))
    if not cuda and (device is None or device.startswith("cuda")):
        notes.append("this kernel has not initialised CUDA, so it holds no cached GPU blocks.")
    return FreeReport(rows, collected, notes)
