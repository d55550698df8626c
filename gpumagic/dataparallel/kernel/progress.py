"""Steps and throughput per rank while a long ``%%dataparallel`` cell runs.

Workers count their optimizer steps and the samples their loaders yield and
report at most once a second; nothing here adds a host sync to a step. The
display appears only once a cell has run for ``after`` seconds: an HTML table
updated in place in a notebook, a line on stderr every ``every`` seconds in a
terminal. Ranks on GPUs also show their GPU's utilisation and memory, read
from NVML when the display renders (no CUDA context in the kernel): an idle
or launch-bound GPU shows at a glance.
"""
from __future__ import annotations

import logging
import sys
import time

from ...display import Rendered, fmt_bytes, html_table, text_table, widgets_supported
from ..protocol import RankStats

logger = logging.getLogger(__name__)

__all__ = ["Progress"]


class Progress:
    """Collects each rank's :class:`~..protocol.RankStats`; renders them when due."""

    def __init__(self, devices: list[str], shell=None, after: float = 2.0, every: float = 10.0,
                 stream=None):
        self.devices = list(devices)
        self.stats: dict[int, RankStats] = {}
        self.t0 = time.monotonic()
        self.after, self.every = after, every
        self.notebook = widgets_supported(shell)
        self.stream = stream
        self._handle = None
        self._last_render = 0.0
        self._dirty = False
        self.gpu_handles = _nvml_handles(self.devices)

    def update(self, rank: int, stats: RankStats) -> None:
        self.stats[rank] = stats
        self._dirty = True

    def rows(self) -> list[list[str]]:
        rows = []
        for rank, device in enumerate(self.devices):
            s = self.stats.get(rank)
            if s is None:
                row = [str(rank), device, "-", "-", "-", "-"]
            else:
                secs = max(s.seconds, 1e-9)
                samples = s.samples   # None: not counted (launch mode: the framework reads the data)
                row = [str(rank), device, str(s.steps), f"{s.steps / secs:.1f}",
                       "-" if samples is None else str(samples), "-" if samples is None else f"{samples / secs:,.0f}"]
            if self.gpu_handles:
                load = self.gpu_load(rank)
                row += [f"{load['util']}%" if load.get("util") is not None else "-",
                        f"{fmt_bytes(load['used'])} / {fmt_bytes(load['total'])}" if load.get("used") is not None
                        else "-"]
            rows.append(row)
        return rows

    HEADER = ["rank", "device", "steps", "steps/s", "samples", "samples/s"]
    GPU_HEADER = ["GPU util", "GPU memory"]

    @property
    def header(self) -> list[str]:
        return self.HEADER + (self.GPU_HEADER if self.gpu_handles else [])

    def gpu_load(self, rank: int) -> dict:
        """``{"util": percent, "used": bytes, "total": bytes}`` of rank's GPU now ({} off a GPU)."""
        handle = self.gpu_handles.get(rank)
        if handle is None:
            return {}
        from ...devices import nvml
        nv = nvml.lib()
        util = nvml.query(nv.nvmlDeviceGetUtilizationRates, handle)
        memory = nvml.query(nv.nvmlDeviceGetMemoryInfo, handle)
        return {"util": getattr(util, "gpu", None), "used": getattr(memory, "used", None),
                "total": getattr(memory, "total", None)}

    def render(self) -> Rendered:
        rows = self.rows()
        elapsed = time.monotonic() - self.t0
        title = f"%%dataparallel: {elapsed:.0f} s"
        return Rendered(title + "\n" + text_table(rows, self.header),
                        f"<b>{title}</b>" + html_table(rows, self.header))

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
            parts = []
            for r, s in sorted(self.stats.items()):
                secs = max(s.seconds, 1e-9)
                rate = f"{s.samples / secs:,.0f} samples/s" if s.samples is not None else \
                    f"{s.steps / secs:.1f} steps/s"
                part = f"rank {r}: {s.steps} steps, {rate}"
                util = self.gpu_load(r).get("util")
                parts.append(part + (f", GPU {util}%" if util is not None else ""))
            print(f"[dataparallel {now - self.t0:.0f} s] " + " | ".join(parts), file=stream)
        self._last_render = now
        self._dirty = False


def _nvml_handles(devices: list[str]) -> dict:
    """NVML handles of the ranks on this machine's GPUs, by rank (through NVML: no CUDA context)."""
    if not any(d.startswith("cuda") for d in devices):
        return {}
    try:
        from ...devices import visible_gpus
        gpus = {g.device: g.handle for g in visible_gpus() if g.handle is not None}
    except Exception:  # the display goes on without GPU columns
        logger.debug("no NVML handles for the progress display", exc_info=True)
        return {}
    handles = {}
    for rank, device in enumerate(devices):
        name = device if ":" in device else f"{device}:0"
        if name in gpus:
            handles[rank] = gpus[name]
    return handles
