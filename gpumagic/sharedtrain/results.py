"""What a ``%%sharedtrain`` run did: per-worker counters, their reports, the result object.

The notebook gets the :class:`SharedTrainResult` as ``sharedtrain``::

    sharedtrain.history.series("loss")    # [[(step, loss), ...] per worker]
    sharedtrain.workers[0].samples_per_s
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["WorkerStats", "History", "SharedTrainResult"]


@dataclass
class WorkerStats:
    """What one worker did: steps, samples, timing (seconds from cell start).

    ``steps`` counts batches taken from the notebook's loaders, or ``report()``
    calls when the cell reads no notebook loader (then ``samples`` is 0).
    """
    rank: int
    pid: int | None = None
    steps: int = 0
    samples: int = 0
    optimizer_steps: int = 0   # of any optimizer: each one updated the shared weights
    reports: int = 0
    first_step: float | None = None
    last_time: float | None = None
    last: dict = field(default_factory=dict)
    state: str = "starting"   # starting, running, done, failed, stopped
    exitcode: int | None = None

    @property
    def samples_per_s(self) -> float | None:
        if self.first_step is None or self.last_time is None or self.last_time <= self.first_step:
            return None
        return self.samples / (self.last_time - self.first_step)


class History:
    """The values each worker passed to ``report()``, one list of dicts per rank.

    Every entry has ``step`` (batches the worker had taken from the notebook's
    loaders, or the report's number when the cell uses none; ``report(step=...)``
    sets it), ``time`` (seconds since the cell started) and the reported values.

    In a notebook::

        sharedtrain.history[0][-1]          # rank 0's last report
        sharedtrain.history.series("loss")  # [[(step, loss), ...] per rank]
        pd.DataFrame(sharedtrain.history.rows())
    """

    def __init__(self, world_size: int):
        self._ranks: list[list[dict]] = [[] for _ in range(world_size)]

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    def __getitem__(self, rank: int) -> list[dict]:
        return self._ranks[rank]

    def __len__(self) -> int:
        return len(self._ranks)

    def __iter__(self):
        return iter(self._ranks)

    def extend(self, rank: int, entries: list[dict]) -> None:
        self._ranks[rank].extend(entries)

    def keys(self) -> list[str]:
        """Reported value names, in order of first appearance."""
        seen: dict[str, None] = {}
        for entries in self._ranks:
            for entry in entries:
                for key in entry:
                    if key not in ("step", "time"):
                        seen.setdefault(key, None)
        return list(seen)

    def series(self, key: str, x: str = "step") -> list[list[tuple]]:
        """``[(x, value), ...]`` per rank for the reports that carry ``key``."""
        return [[(e[x], e[key]) for e in entries if key in e] for entries in self._ranks]

    def last(self, key: str):
        """Each rank's last reported ``key`` (``None`` where it never reported it)."""
        out = []
        for entries in self._ranks:
            values = [e[key] for e in entries if key in e]
            out.append(values[-1] if values else None)
        return out

    def rows(self) -> list[dict]:
        """All reports as flat dicts with ``rank``, ordered by time (for a DataFrame)."""
        rows = [{"rank": r, **e} for r, entries in enumerate(self._ranks) for e in entries]
        return sorted(rows, key=lambda row: row["time"])

    def __repr__(self) -> str:
        counts = ", ".join(str(len(e)) for e in self._ranks)
        keys = ", ".join(self.keys()) or "none"
        return f"History({self.world_size} workers; reports per rank: {counts}; keys: {keys})"

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))


@dataclass
class SharedTrainResult:
    """What a ``%%sharedtrain`` run did; the notebook gets it as ``sharedtrain``.

    ``modules`` are the notebook's own objects, trained in place; ``history``
    holds what the workers reported; ``workers`` has one :class:`WorkerStats`
    per rank. ``status`` is ``"done"``, ``"failed"`` or ``"interrupted"``.
    """
    modules: dict
    nprocs: int
    start_method: str
    start_reason: str
    device: str
    seed: int
    sharing_strategy: str
    history: History
    workers: list
    seconds: float = 0.0
    status: str = "running"
    notes: list = field(default_factory=list)

    @property
    def model(self):
        """The trained module (the first one with parameters when the cell used several)."""
        for module in self.modules.values():
            if any(True for _ in module.parameters()):
                return module
        return next(iter(self.modules.values()))

    @property
    def trained_names(self) -> list[str]:
        """The names of the modules with parameters (of every module where none has any): what trained."""
        names = [n for n, m in self.modules.items() if any(True for _ in m.parameters())]
        return names or list(self.modules)

    @property
    def model_name(self) -> str:
        for name, module in self.modules.items():
            if module is self.model:
                return name
        return ""

    @property
    def steps(self) -> int:
        return sum(w.steps for w in self.workers)

    @property
    def samples(self) -> int:
        return sum(w.samples for w in self.workers)

    @property
    def optimizer_steps(self) -> int:
        return sum(w.optimizer_steps for w in self.workers)

    @property
    def first_step(self) -> float | None:
        """Seconds from the cell's start to the first step in any worker."""
        firsts = [w.first_step for w in self.workers if w.first_step is not None]
        return min(firsts) if firsts else None

    @property
    def samples_per_s(self) -> float | None:
        """All workers' samples over the time from the first step to the last report."""
        first = self.first_step
        lasts = [w.last_time for w in self.workers if w.last_time is not None]
        if first is None or not lasts or max(lasts) <= first:
            return None
        return self.samples / (max(lasts) - first)

    def plot(self, key: str = "loss", x: str = "step"):
        """A matplotlib figure of ``key`` per worker (needs matplotlib)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("sharedtrain.plot() needs matplotlib: pip install matplotlib") from exc
        fig, ax = plt.subplots(figsize=(6, 3))
        for rank, points in enumerate(self.history.series(key, x)):
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=f"rank {rank}")
        ax.set_xlabel(x)
        ax.set_ylabel(key)
        ax.legend()
        return fig

    def __repr__(self) -> str:
        rate = self.samples_per_s
        rate_text = f", {rate:.0f} samples/s" if rate else ""
        return (f"SharedTrainResult({self.model_name or 'model'}, {self.status}, {self.nprocs} workers "
                f"({self.start_method}) on {self.device}, {self.steps} steps in {self.seconds:.1f} s{rate_text})")

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))
