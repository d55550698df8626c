"""A ledger per cell: ``%gpumem --cells``.

Before a cell, :meth:`Ledger.start` reads what each device holds (torch's
allocated bytes on every GPU this kernel set up, the kernel's resident memory)
and restarts the peak counters; after it, :meth:`Ledger.finish` says per device
the cell touched: before -> after and the cell's peak, the variables that grew,
and whether the cell's re-runs keep growing what stays allocated (a leak: a list
of losses that keeps their graphs, ``total_loss += loss`` outside ``no_grad``,
results piling up in ``Out``).

Cheap by design: the per-cell readings are host-side counters (no CUDA call, no
walk of the notebook); variables are read only after a cell whose kept memory
grew, and then only the names it bound or whose containers grew. It never
initialises CUDA and never empties a cache. Nothing here needs IPython.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections import deque
from dataclasses import dataclass, field

from ..display import fmt_bytes
from .storages import Collector

logger = logging.getLogger(__name__)

__all__ = ["DeviceChange", "CellLedger", "Ledger", "CPU_NOISE"]

CPU_NOISE = 8 << 20     # resident memory moves this much by itself (allocator arenas): less is no change
GPU_NOISE = 1 << 20     # torch's allocator rounds blocks to 512 bytes and keeps small pools: less is no change
RUNS_KEPT = 8           # runs of each cell remembered for the leak check
_CLEAR_REFS = "/proc/self/clear_refs"


def _torch():
    return sys.modules.get("torch")


@dataclass
class DeviceChange:
    """One device over one cell: bytes held before and after, and the most held during it."""
    device: str
    before: int
    after: int
    peak: int | None

    @property
    def kept(self) -> int:
        return self.after - self.before


@dataclass
class CellLedger:
    """The ledger's line for one cell run: the devices it touched, what grew, and a leak, if any."""
    label: str
    devices: list[DeviceChange] = field(default_factory=list)
    grew: list[tuple[str, int, int]] = field(default_factory=list)   # (name, bytes more than before, bytes now)
    leak: str | None = None

    def lines(self) -> list[str]:
        out = []
        for d in self.devices:
            peak = f", peak {fmt_bytes(d.peak)}" if d.peak is not None else ""
            kept = f" ({'+' if d.kept >= 0 else ''}{fmt_bytes(d.kept)} kept)" if d.kept else ""
            out.append(f"[gpumem {self.label}] {d.device}: {fmt_bytes(d.before)} -> {fmt_bytes(d.after)}{kept}{peak}")
        if self.grew:
            out.append(f"[gpumem {self.label}] grew: " + ", ".join(
                f"{n} +{fmt_bytes(more)}" + (f" ({fmt_bytes(now)} now)" if now != more else "")
                for n, more, now in self.grew))
        if self.leak:
            out.append(f"[gpumem {self.label}] leak? {self.leak}")
        return out

    def text(self) -> str:
        return "\n".join(self.lines())

    def as_dict(self) -> dict:
        return {"cell": self.label,
                "devices": {d.device: {"before": d.before, "after": d.after, "kept": d.kept, "peak": d.peak}
                            for d in self.devices},
                "grew": {n: {"more": more, "now": now} for n, more, now in self.grew}, "leak": self.leak}


def _rss() -> int:
    """The kernel's resident bytes, from /proc where there is one (a few microseconds)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:   # not Linux
        import psutil
        return int(psutil.Process().memory_info().rss)


def _peak_rss() -> int | None:
    """The resident high-water mark since :func:`_reset_peak_rss` (Linux), else None."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        logger.debug("no /proc/self/status: the CPU's peak is unknown", exc_info=True)
    return None


def _reset_peak_rss() -> bool:
    """Restart the resident high-water mark at the current size (Linux 4.0+: ``echo 5 > clear_refs``)."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        logger.debug("cannot reset the resident peak here", exc_info=True)
        return False


def _cuda_indices(torch) -> list[int]:
    """GPUs this kernel set up; none (and nothing asked) before CUDA is initialised."""
    if torch is None or not torch.cuda.is_initialized():
        return []
    return list(range(torch.cuda.device_count()))


class Ledger:
    """The per-cell ledger of one kernel; :meth:`start` before a cell, :meth:`finish` after it.

    In a notebook::

        %gpumem --cells      # on: a line per device after each cell
        %gpumem --cells      # again: off
    """

    def __init__(self):
        self._before: dict[str, int] = {}
        self._peak_cpu = False
        self._bound: dict[str, tuple[int, int]] = {}   # name -> (id, length) before the cell
        self._history_len = 0
        self._runs: dict[str, deque] = {}               # cell key -> kept bytes of its last runs, per device
        self._sizes: dict[str, int] = {}                # name -> bytes it held when last read
        self._hidden: object = ()                       # IPython's own names (In, Out, exit...)

    def start(self, user_ns: dict, hidden=()) -> None:
        torch = _torch()
        self._hidden = hidden
        self._before = {"cpu": _rss()}
        for i in _cuda_indices(torch):
            self._before[f"cuda:{i}"] = int(torch.cuda.memory_allocated(i))
            torch.cuda.reset_peak_memory_stats(i)
        self._peak_cpu = _reset_peak_rss()
        self._bound = _bindings(user_ns, hidden)
        history = user_ns.get("Out")
        self._history_len = len(history) if isinstance(history, dict) else 0

    def finish(self, user_ns: dict, source: str, label: str) -> CellLedger | None:
        """The cell's line, or None where it touched no device."""
        torch = _torch()
        changes = self._changes(torch)
        if not changes:
            return None
        entry = CellLedger(label, changes)
        grown = [d for d in changes if d.kept > (CPU_NOISE if d.device == "cpu" else GPU_NOISE)]
        if grown and torch is not None:
            entry.grew = self._grew(torch, user_ns, {d.device for d in grown})
        entry.leak = self._leak(_cell_key(source), changes, entry.grew)
        return entry

    def _changes(self, torch) -> list[DeviceChange]:
        changes = []
        after_cpu = _rss()
        peak = _peak_rss() if self._peak_cpu else None
        before_cpu = self._before.get("cpu", after_cpu)
        cpu = DeviceChange("cpu", before_cpu, after_cpu, peak)
        if abs(cpu.kept) >= CPU_NOISE or (peak is not None and peak - before_cpu >= CPU_NOISE):
            changes.append(cpu)
        for i in _cuda_indices(torch):
            name = f"cuda:{i}"
            before = self._before.get(name, 0)   # CUDA set up during the cell: it held nothing before
            after = int(torch.cuda.memory_allocated(i))
            top = int(torch.cuda.max_memory_allocated(i))
            if after != before or top > before:
                changes.append(DeviceChange(name, before, after, top))
        return changes

    def _grew(self, torch, user_ns: dict, devices: set[str]) -> list[tuple[str, int, int]]:
        """Names the cell bound or whose containers grew, that now hold more on the grown devices."""
        now = _bindings(user_ns, self._hidden)
        candidates = [n for n, (ident, length) in now.items()
                      if self._bound.get(n, (None, None))[0] != ident or self._bound[n][1] != length]
        skip = frozenset({id(user_ns)})
        grew = []
        for name in candidates:
            held = _bytes_on(torch, user_ns[name], devices, skip)
            if held > self._sizes.get(name, 0):
                grew.append((name, held - self._sizes.get(name, 0), held))
            self._sizes[name] = held
        history = user_ns.get("Out")
        if isinstance(history, dict) and len(history) > self._history_len:
            for n in sorted(history)[self._history_len - len(history):]:
                held = _bytes_on(torch, history[n], devices, skip)
                if held:
                    grew.append((f"Out[{n}]", held, held))
        grew.sort(key=lambda item: -item[1])
        return grew

    def _leak(self, key: str, changes: list[DeviceChange], grew: list[tuple[str, int, int]]) -> str | None:
        """A re-run that kept more, after a run that kept more too: what stays allocated keeps growing."""
        runs = self._runs.setdefault(key, deque(maxlen=RUNS_KEPT))
        kept = {d.device: d.kept for d in changes}
        runs.append(kept)
        if len(runs) < 2:
            return None
        for device, amount in kept.items():
            noise = CPU_NOISE if device == "cpu" else GPU_NOISE
            streak = 0
            for run in reversed(runs):
                if run.get(device, 0) <= noise:
                    break
                streak += 1
            if amount > noise and streak >= 2:
                names = ", ".join(n for n, _, _ in grew) or "no variable this cell bound"
                return (f"this cell kept more on {device} on each of its last {streak} runs "
                        f"(+{fmt_bytes(amount)} this time); what grew: {names}")
        return None


def _cell_key(source: str) -> str:
    return hashlib.sha1(source.strip().encode("utf-8", "surrogatepass")).hexdigest()


def _bindings(user_ns: dict, hidden) -> dict[str, tuple[int, int]]:
    """``{name: (id, length)}`` of the notebook's variables; length of plain containers only (-1 else)."""
    out = {}
    for name, value in list(user_ns.items()):
        if name.startswith("_") or name in hidden or name in ("In", "Out"):
            continue
        cls = type(value)
        length = len(value) if cls in (list, dict, set, deque, tuple) else -1
        out[name] = (id(value), length)
    return out


def _bytes_on(torch, value, devices: set[str], skip: frozenset[int]) -> int:
    collector = Collector(torch, 6, 100_000, skip=skip)
    try:
        collector.walk(value)
    except Exception:  # an unreadable variable is left out of the ledger's names
        logger.debug("reading a variable for the ledger failed", exc_info=True)
        return 0
    held = {**collector.via_graph, **collector.via_optimizer, **collector.storages}
    return sum(nbytes for dev, nbytes, _ in held.values() if dev in devices)
