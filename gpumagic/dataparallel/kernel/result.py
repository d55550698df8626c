"""What a ``%%dataparallel`` cell did (:class:`DataParallelResult`): bound in the notebook as ``dataparallel``,
as ``%%sharedtrain`` binds ``sharedtrain``, and returned by :func:`~.train.train_parallel`.

In a notebook::

    %%dataparallel
    ...
    dataparallel.per_rank[0].steps, dataparallel.timings["run"], dataparallel.values
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DataParallelResult", "RESULT_NAME"]

RESULT_NAME = "dataparallel"   # the notebook's name for the last cell's result


@dataclass
class DataParallelResult:
    """What a ``%%dataparallel`` cell did, for the cell's note, for the notebook and for benchmarks."""
    devices: list[str]
    backend: str
    modules: list[str]
    optimizers: list[str]
    loaders: list[str]
    stateful: list[str]
    values: list[str] = field(default_factory=list)          # names, and attributes ("args.lr"), that came back
    defined: list[str] = field(default_factory=list)         # functions, classes, modules the cell bound
    made: list[str] = field(default_factory=list)            # names of models the cell built, brought back whole
    stayed: list[str] = field(default_factory=list)          # fsdp: trained state kept sharded in the workers
    strategy: str = "ddp"
    not_returned: list[str] = field(default_factory=list)    # assigned names not brought back (they end with the cell)
    value: Any = None                                        # rank 0's last expression
    per_rank: dict = field(default_factory=dict)             # rank -> its RankStats (steps, samples, seconds)
    pids: list = field(default_factory=list)
    pool_started: bool = False
    timings: dict = field(default_factory=dict)   # seconds: total, pool_start, pack, start, run, return, load
    shipped_bytes: int = 0
    cached_bytes: int = 0
    returned_bytes: int = 0
    tag: str = ""                                            # the strategy's, in the summary: ", fsdp"

    def summary(self) -> str:
        """The cell's one-line summary."""
        what = ", ".join(n for n in self.modules + self.optimizers + self.stateful if n not in self.stayed)
        ranks = f"{len(self.devices)} rank{'s' if len(self.devices) != 1 else ''} ({self.backend}{self.tag})"
        steps = {s.steps for s in self.per_rank.values()}
        step_text = f", {next(iter(steps))} optimizer steps each" if len(steps) == 1 and steps != {0} else ""
        loaded = f"trained state loaded into {what}" if what else ""
        if self.stayed:
            loaded += (f"{'; ' if loaded else ''}trained state kept sharded in the workers (a later --strategy "
                       f"fsdp cell continues from it): {', '.join(self.stayed)}")
        text = f"%%dataparallel: {ranks}{step_text}; " + (loaded or "no notebook model used (nothing loaded in place)")
        shown = [n for n in self.values if n != "_"]   # (``for _ in range(3)``: bound, not worth a word)
        if shown:
            text += f"; values: {', '.join(shown)}"
        if self.made:
            text += f"; models built in the cell (on the CPU): {', '.join(self.made)}"
        if self.defined:
            text += f"; defined: {', '.join(self.defined)}"
        return text

    def notes(self) -> list[str]:
        """What the cell's note says: what did not come back (and how to keep a trainer's knowledge), then the
        summary."""
        lines = []
        if self.not_returned:
            lines.append("not brought back (they end with the cell): " + ", ".join(self.not_returned)
                         + _keep_hint(self.not_returned))
        return lines + [self.summary()]


def _keep_hint(not_returned: list[str]) -> str:
    """How to keep what a trainer that ends with the cell knows: bind it in the cell."""
    trainers = [entry.split(" (", 1)[0] for entry in not_returned if "(holds a Trainer," in entry]
    if not trainers:
        return ""
    name = trainers[0]
    return (f". To keep what {name} knows, bind it in the cell: history = {name}.state.log_history "
            f"(Hugging Face), metrics = {name}.callback_metrics (Lightning)")
