"""A small inline SVG line of memory and utilisation: the gauges' history, with no plotting library.

Values are 0..1 on a fixed height, drawn at whole pixels, so values that
differ by less than a pixel give the same SVG text (and a gauge sends nothing
for it). A step without a value breaks the line.

In a notebook::

    from IPython.display import HTML
    from gpumagic.widgets.sparkline import sparkline
    HTML(sparkline([0.1, 0.4, None, 0.5], [0.0, 0.9, None, 0.2]))
"""
from __future__ import annotations

import html

__all__ = ["sparkline", "MEMORY_COLOUR", "UTILIZATION_COLOUR"]

MEMORY_COLOUR = "#1f77b4"        # blue, as the gauges' figures
UTILIZATION_COLOUR = "#ff7f0e"   # orange


def _points(values, width: int, height: int) -> list[list[tuple[int, int]]]:
    """Runs of ``(x, y)`` pixels, one run per stretch of values without a gap."""
    runs: list[list[tuple[int, int]]] = [[]]
    last = max(len(values) - 1, 1)
    for i, value in enumerate(values):
        if value is None:
            if runs[-1]:
                runs.append([])
            continue
        x = round(i * (width - 1) / last)
        y = (height - 1) - round(min(max(value, 0.0), 1.0) * (height - 2))
        runs[-1].append((x, y))
    return [run for run in runs if run]


def _polylines(values, width: int, height: int, colour: str, name: str) -> str:
    out = []
    for run in _points(values, width, height):
        if len(run) == 1:   # a lone value: a dot, or it would not show
            x, y = run[0]
            out.append(f"<circle class='gpumagic-history-{name}' cx='{x}' cy='{y}' r='1' fill='{colour}'/>")
            continue
        points = " ".join(f"{x},{y}" for x, y in run)
        out.append(f"<polyline class='gpumagic-history-{name}' points='{points}' fill='none' stroke='{colour}' "
                   "stroke-width='1.5'/>")
    return "".join(out)


def sparkline(memory, utilization, width: int = 120, height: int = 24, title: str = "") -> str:
    """Inline SVG: ``memory`` (blue) and ``utilization`` (orange), lists of 0..1 or None, oldest first."""
    lines = _polylines(utilization, width, height, UTILIZATION_COLOUR, "utilization") + \
        _polylines(memory, width, height, MEMORY_COLOUR, "memory")
    tip = f"<title>{html.escape(title)}</title>" if title else ""
    return (f"<svg class='gpumagic-history' width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
            f"xmlns='http://www.w3.org/2000/svg' style='vertical-align:middle'>{tip}"
            f"<rect x='0.5' y='0.5' width='{width - 1}' height='{height - 1}' fill='none' stroke='#ccc'/>"
            f"{lines}</svg>")
