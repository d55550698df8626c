"""Steps and throughput per rank while a long ``%%dataparallel`` cell runs.

Workers count their optimizer steps and the samples their loaders yield and
report at most once a second; nothing here adds a host sync to a step. The
display appears only once a cell has run for ``after`` seconds: an HTML table
updated in place in a notebook, a line on stderr every ``every`` seconds in a
terminal.
"""
from __future__ import annotations

import sys
import time

from ..display import Rendered, html_table, text_table, widgets_supported

__all__ = ["Progress"]


class Progress:
    """Collects ``{"steps", "samples", "seconds"}`` per rank; renders them when due."""

    def __init__(self, devices: list[str], shell=None, after: float = 2.0, every: float = 10.0,
                 stream=None):
        self.devices = list(devices)
        self.stats: dict[int, dict] = {}
        self.t0 = time.monotonic()
        self.after, self.every = after, every
        self.notebook = widgets_supported(shell)
        self.stream = stream
        self._handle = None
        self._last_render = 0.0
        self._dirty = False

    def update(self, rank: int, stats: dict) -> None:
        self.stats[rank] = dict(stats)
        self._dirty = True

    def rows(self) -> list[list[str]]:
        rows = []
        for rank, device in enumerate(self.devices):
            s = self.stats.get(rank)
            if s is None:
                rows.append([str(rank), device, "-", "-", "-", "-"])
                continue
            secs = max(s.get("seconds", 0.0), 1e-9)
            rows.append([str(rank), device, str(s.get("steps", 0)), f"{s.get('steps', 0) / secs:.1f}",
                         str(s.get("samples", 0)), f"{s.get('samples', 0) / secs:,.0f}"])
        return rows

    HEADER = ["rank", "device", "steps", "steps/s", "samples", "samples/s"]

    def render(self) -> Rendered:
        rows = self.rows()
        elapsed = time.monotonic() - self.t0
        title = f"%%dataparallel: {elapsed:.0f} s"
        return Rendered(title + "\n" + text_table(rows, self.HEADER),
                        f"<b>{title}</b>" + html_table(rows, self.HEADER))

    def tick(self, final: bool = False) -> None:
        now = time.monotonic()
        if now - self.t0 < self.after and not (final and self._handle is not None):
            return
        if not self.stats:
            return
        if self.notebook:
            if not (self._dirty or final) or (now - self._last_render < 1.0 and not final):
                return
            from IPython.display import display
            shown = self.render()
            if self._handle is None:
                self._handle = display(shown, display_id=True)
            else:
                self._handle.update(shown)
        else:
            if final or now - self._last_render < self.every and self._last_render:
                return
            stream = self.stream or sys.stderr
            parts = [f"rank {r}: {s.get('steps', 0)} steps, "
                     f"{s.get('samples', 0) / max(s.get('seconds', 0.0), 1e-9):,.0f} samples/s"
                     for r, s in sorted(self.stats.items())]
            print(f"[dataparallel {now - self.t0:.0f} s] " + " | ".join(parts), file=stream)
        self._last_render = now
        self._dirty = False
