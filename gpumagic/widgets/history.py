"""The last minutes of one device, memory and utilisation, in fixed steps: what a gauge's history line draws.

A :class:`History` keeps ``window`` seconds (default 5 minutes) as ``buckets``
steps (default 60, of 5 s): each step keeps the highest memory fraction seen
in it (a peak matters more than a mean for memory) and the mean utilisation.
Adding a sample costs a few operations and tells whether the line as drawn
changes (a new step, or a value moved to another of ``levels`` heights), so
the monitor redraws it only then. Steps are aligned on the clock: a step
without samples (the monitor paused) is a gap.

In a notebook::

    from gpumagic.widgets.history import History
    h = History(window=60, buckets=12)
    h.add(0.0, memory=0.25, utilization=0.5)
    h.series(now=0.0)     # ([None, ..., 0.25], [None, ..., 0.5])
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["History", "WINDOW", "BUCKETS", "LEVELS"]

WINDOW = 300.0   # seconds on the line
BUCKETS = 60     # steps on the line (5 s each by default)
LEVELS = 20      # heights a value can take on the line: changes within one are not redrawn


@dataclass
class _Step:
    index: int                      # which step of the clock: floor(t / step)
    memory: float | None = None     # the highest fraction in it
    busy_sum: float = 0.0
    busy_count: int = 0

    @property
    def utilization(self) -> float | None:
        return self.busy_sum / self.busy_count if self.busy_count else None


class History:
    """Memory (fraction of the device) and utilisation (0..1) of one device over the last ``window`` seconds."""

    def __init__(self, window: float = WINDOW, buckets: int = BUCKETS, levels: int = LEVELS):
        if not (window > 0 and buckets >= 2 and levels >= 1):
            raise ValueError(f"need window > 0, buckets >= 2, levels >= 1; got {window}, {buckets}, {levels}")
        self.window = float(window)
        self.buckets = int(buckets)
        self.step = self.window / self.buckets
        self.levels = int(levels)
        self._steps: deque[_Step] = deque(maxlen=self.buckets)
        self._drawn: tuple = ()

    def __len__(self) -> int:
        """Steps that hold at least one sample."""
        return len(self._steps)

    def add(self, t: float, memory: float | None = None, utilization: float | None = None) -> bool:
        """Record a sample taken at ``t`` (seconds, monotonic); True when the line as drawn changes."""
        index = math.floor(t / self.step)
        if not self._steps or self._steps[-1].index < index:
            self._steps.append(_Step(index))
        last = self._steps[-1]
        if last.index != index:   # a sample older than the last step (a clock that went back): dropped
            return False
        if memory is not None:
            last.memory = memory if last.memory is None else max(last.memory, memory)
        if utilization is not None:
            last.busy_sum += utilization
            last.busy_count += 1
        drawn = (index, self._level(last.memory), self._level(last.utilization))
        changed = drawn != self._drawn
        self._drawn = drawn
        return changed

    def _level(self, value: float | None) -> int | None:
        return None if value is None else round(min(max(value, 0.0), 1.0) * self.levels)

    def series(self, now: float | None = None) -> tuple[list[float | None], list[float | None]]:
        """``(memory, utilization)``, one value per step of the window ending with ``now``'s step (default:
        the last sample's), oldest first; None for steps without a sample."""
        if now is None and not self._steps:
            return [None] * self.buckets, [None] * self.buckets
        end = math.floor(now / self.step) if now is not None else self._steps[-1].index
        first = end - self.buckets + 1
        memory: list[float | None] = [None] * self.buckets
        busy: list[float | None] = [None] * self.buckets
        for step in self._steps:
            if first <= step.index <= end:
                memory[step.index - first] = step.memory
                busy[step.index - first] = step.utilization
        return memory, busy

    def peak(self) -> float | None:
        """The highest memory fraction on the line."""
        values = [s.memory for s in self._steps if s.memory is not None]
        return max(values) if values else None
