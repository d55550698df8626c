"""What ``%%sharedtrain`` shows: live progress per worker, then a summary with loss per worker.

HTML in a notebook (one display, updated in place), a status line in a terminal,
a line every few seconds where output is not a terminal.
"""
from __future__ import annotations

import base64
import html
import sys
import time

from .. import display
from ..procs.output import RankOutput

__all__ = ["Progress", "render_summary", "render_progress", "sparkline", "trained_text", "RESULT_NAME"]

RESULT_NAME = "sharedtrain"
_BARS = "▁▂▃▄▅▆▇█"
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
TEXT_PROGRESS_INTERVAL = 10.0   # seconds between progress lines when output is not a terminal


# --------------------------------------------------------------------------- renderings

def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return display.NA
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    text = str(value)
    return text if len(text) <= 24 else text[:21] + "..."


def _plot_key(history) -> str | None:
    """``loss`` when reported, else the first value reported as a plain number."""
    keys = history.keys()
    if "loss" in keys:
        return "loss"
    for key in keys:
        values = [v for per_rank in history.series(key) for _, v in per_rank]
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return key
    return None


def _numeric(points) -> list:
    return [(x, float(v)) for x, v in points
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")]


def sparkline(values: list[float], width: int = 24, low: float | None = None, high: float | None = None) -> str:
    """``[3, 2, 1] -> '█▄▁'``: bucket means, scaled to ``low``..``high`` (default: the values')."""
    if not values:
        return ""
    if len(values) > width:
        size = len(values) / width
        values = [sum(chunk) / len(chunk) for chunk in
                  (values[int(i * size):max(int((i + 1) * size), int(i * size) + 1)] for i in range(width))]
    low = min(values) if low is None else low
    high = max(values) if high is None else high
    span = (high - low) or 1.0
    return "".join(_BARS[min(len(_BARS) - 1, max(0, int((v - low) / span * (len(_BARS) - 1) + 0.5)))]
                   for v in values)


def _svg_plot(series: list, key: str, width: int = 360, height: int = 120) -> str:
    """A small plot with one line per worker (no plotting library needed), as HTML.

    The SVG is an ``<img>`` with a ``data:`` URL rather than inline: JupyterLab
    strips inline ``<svg>`` from the HTML of a stored (untrusted) notebook but
    keeps images, so the plot is still there when the notebook is opened again.
    """
    pts = [p for per_rank in series for p in per_rank]
    if not pts:
        return ""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    xspan, yspan = (x1 - x0) or 1, (y1 - y0) or 1
    high, low = _fmt(y1, 3), _fmt(y0, 3)
    left, right, top, bottom = 10 + 6 * max(len(high), len(low)), 8, 8, 18  # room for the y labels
    w, h = width - left - right, height - top - bottom

    def at(x, y):
        return f"{left + (x - x0) / xspan * w:.1f},{top + (1 - (y - y0) / yspan) * h:.1f}"

    lines = []
    for rank, per_rank in enumerate(series):
        if per_rank:
            color = _COLORS[rank % len(_COLORS)]
            lines.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.5' "
                         f"points='{' '.join(at(x, y) for x, y in per_rank)}'/>")
    svg = (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
           f"style='font:10px sans-serif'>"
           f"<rect x='{left}' y='{top}' width='{w}' height='{h}' fill='none' stroke='#ccc'/>"
           f"<text x='{left - 4}' y='{top + 8}' text-anchor='end'>{html.escape(high)}</text>"
           f"<text x='{left - 4}' y='{top + h}' text-anchor='end'>{html.escape(low)}</text>"
           f"<text x='{left}' y='{height - 4}'>step {html.escape(_fmt(x0))}</text>"
           f"<text x='{left + w}' y='{height - 4}' text-anchor='end'>{html.escape(_fmt(x1))}</text>"
           + "".join(lines) + "</svg>")
    url = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode("ascii")
    legend = " ".join(f"<span style='color:{_COLORS[r % len(_COLORS)]}'>&#9632; rank {r}</span>"
                      for r, per_rank in enumerate(series) if per_rank)
    return (f"<div><img src='{url}' width='{width}' height='{height}' alt='{html.escape(key)} per worker'>"
            f"<div style='font-size:smaller'>{html.escape(key)} per worker: {legend}</div></div>")


def _worker_rows(result, key: str | None) -> tuple[list, list]:
    header = ["rank", "pid", "steps", "samples", "samples/s", key or "last report", "state"]
    rows = []
    for w in result.workers:
        last = w.last.get(key) if key else (", ".join(f"{k}={_fmt(v)}" for k, v in list(w.last.items())[:3]) or None)
        rate = w.samples_per_s
        rows.append([w.rank, w.pid or "", w.steps, w.samples, f"{rate:.0f}" if rate else display.NA,
                     _fmt(last), w.state])
    return header, rows


def trained_text(names: list[str], most: int = 3) -> str:
    """``'model'``, ``"nets['a']" and "nets['b']"``; past ``most`` names, the first ones and how many more."""
    quoted = [repr(n) for n in names] or [repr("the model")]
    if len(quoted) > most:
        return f"{', '.join(quoted[:most])} and {len(quoted) - most} more"
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _headline(result) -> str:
    rate = result.samples_per_s
    first = result.first_step
    parts = [f"{result.nprocs} worker{'s' if result.nprocs != 1 else ''} ({result.start_method}) on "
             f"{result.device} trained {trained_text(result.trained_names)}: {result.steps} steps, "
             f"{result.samples} samples in {result.seconds:.1f} s"]
    if rate:
        parts.append(f"{rate:.0f} samples/s")
    if first is not None:
        parts.append(f"first step after {first:.2f} s")
    return "; ".join(parts)


def render_summary(result) -> display.Rendered:
    """The after-the-cell view: headline, per-worker table, loss per worker, notes."""
    key = _plot_key(result.history)
    header, rows = _worker_rows(result, key)
    text = [f"sharedtrain: {_headline(result)}", display.text_table([[str(c) for c in r] for r in rows], header)]
    html_parts = [f"<div><b>sharedtrain</b>: {html.escape(_headline(result))}</div>",
                  display.html_table(rows, header)]
    if key:
        series = [_numeric(s) for s in result.history.series(key)]
        all_values = [v for s in series for _, v in s]
        if all_values:
            low, high = min(all_values), max(all_values)
            for rank, s in enumerate(series):
                if s:
                    values = [v for _, v in s]
                    text.append(f"{key} rank {rank}: {sparkline(values, low=low, high=high)}  "
                                f"{_fmt(values[0])} -> {_fmt(values[-1])}")
            html_parts.append(_svg_plot(series, key))
    if result.notes:
        text += ["notes:"] + [f"  {n}" for n in result.notes]
        html_parts.append("<ul style='font-size:smaller'>" +
                          "".join(f"<li>{html.escape(n)}</li>" for n in result.notes) + "</ul>")
    where = f"{RESULT_NAME}.history ({', '.join(result.history.keys()) or 'nothing reported'})"
    text.append(f"start method: {result.start_method} ({result.start_reason}); reports in {where}")
    html_parts.append(f"<div style='font-size:smaller'>start method: {html.escape(result.start_method)} "
                      f"({html.escape(result.start_reason)}); reports in <code>{html.escape(where)}</code></div>")
    return display.Rendered("\n".join(text), "".join(html_parts))


def render_progress(result) -> display.Rendered:
    """The live view: one row per worker with steps, samples/s and the last loss."""
    key = _plot_key(result.history)
    header, rows = _worker_rows(result, key)
    elapsed = time.monotonic() - _start_of(result)
    head = f"sharedtrain: {result.nprocs} workers ({result.start_method}) on {result.device}, {elapsed:.0f} s"
    return display.Rendered(head + "\n" + display.text_table([[str(c) for c in r] for r in rows], header),
                            f"<div>{html.escape(head)}</div>" + display.html_table(rows, header))


def _start_of(result) -> float:
    return getattr(result, "_display_started", time.monotonic())


def _status_line(result) -> str:
    key = _plot_key(result.history) or "loss"
    parts = []
    for w in result.workers:
        rate = w.samples_per_s
        last = w.last.get(key)
        parts.append(f"r{w.rank} {w.steps} steps" + (f" {rate:.0f}/s" if rate else "") +
                     (f" {key} {_fmt(last, 3)}" if last is not None else ""))
    return "sharedtrain: " + " | ".join(parts)


# --------------------------------------------------------------------------- live display

class Progress:
    """Progress while workers run: a display updated in place in a notebook, a status line in a terminal."""

    def __init__(self, shell):
        self.notebook = getattr(shell, "kernel", None) is not None
        stream = sys.stdout
        self.tty = not self.notebook and bool(getattr(stream, "isatty", lambda: False)())
        self.handle = None
        self.status_shown = False
        self.started = time.monotonic()
        self.last_text = self.started
        self._output = RankOutput(prefix=True, before_write=self._clear_status)

    def update(self, result) -> None:
        result._display_started = self.started
        if self.notebook:
            view = render_progress(result)
            if self.handle is None:
                from IPython.display import display as show
                self.handle = show(view, display_id=True)
            else:
                self.handle.update(view)
        elif self.tty:
            import shutil
            width = shutil.get_terminal_size((100, 20)).columns - 1
            sys.stdout.write("\r\033[K" + _status_line(result)[:width])
            sys.stdout.flush()
            self.status_shown = True
        elif time.monotonic() - self.last_text >= TEXT_PROGRESS_INTERVAL:
            self.last_text = time.monotonic()
            print(_status_line(result), flush=True)

    def output(self, rank: int, stream: str, text: str) -> None:
        """What a worker printed, line by line, prefixed with its rank."""
        self._output.write(rank, stream, text)

    def _clear_status(self) -> None:
        if self.status_shown:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
            self.status_shown = False

    def finish(self, result) -> None:
        """Replace the live view with the summary."""
        self._output.flush()
        self._clear_status()
        view = render_summary(result)
        if self.notebook:
            if self.handle is not None:
                self.handle.update(view)
            else:
                from IPython.display import display as show
                show(view)
        else:
            print(view.text)

    def stopped(self, result, exc) -> None:
        """A short account of a run that ended early (the error itself follows)."""
        self._output.flush()
        self._clear_status()
        if result is None:
            return
        if self.notebook and self.handle is not None:
            result._display_started = self.started
            self.handle.update(render_progress(result))
        if isinstance(exc, KeyboardInterrupt):
            why = "interrupted"
        elif isinstance(getattr(exc, "rank", None), int) and exc.rank >= 0:
            why = f"rank {exc.rank} failed"
        else:   # (the kernel's own side failed, after or between the workers)
            why = f"{type(exc).__name__} in the kernel"
        # Hogwild updates land in the notebook's own weights as they happen: none are undone
        stepped = result.optimizer_steps   # (batches alone need not have changed a weight)
        kept = (f"the model keeps the updates of the {stepped} optimizer steps the workers took until then, "
                "and is usable" if stepped else "the model is usable")
        display.note(f"sharedtrain: stopped {result.nprocs} workers after {result.seconds:.1f} s ({why}); "
                     f"{kept}, and what the workers reported is in {RESULT_NAME}.history")
