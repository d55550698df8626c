"""A memory gauge: ``[label][bar coloured by fullness][history line][used / total, and who holds it]``.

Shaped like tqdm's notebook bar (``HBox([HTML, FloatProgress, HTML])``) with
``bar_style`` for state and ``_repr_pretty_`` as the text fallback. A gauge
sends an update to the frontend only when what it displays changes, so a fast
monitor cannot flood the notebook.
"""
from __future__ import annotations

import html

from ipywidgets import HTML, FloatProgress, HBox, Layout

from ..display import NA, fmt_bytes
from .closing import close_tree

__all__ = ["MemoryGauge", "bar_style_for"]

# Bar resolution: 0.1 % of the device. Finer changes are invisible on a bar of
# a few hundred pixels, and sending them would only make traffic.
_RESOLUTION = 3


def bar_style_for(fraction: float | None) -> str:
    """``success`` below 70 % full, ``warning`` below 90 %, ``danger`` beyond."""
    if fraction is None:
        return ""
    if fraction < 0.70:
        return "success"
    if fraction < 0.90:
        return "warning"
    return "danger"


class MemoryGauge(HBox):
    """One device's memory as a coloured bar with used/total text.

    In a notebook::

        from gpumagic.widgets.gauge import MemoryGauge
        g = MemoryGauge("cuda:0", "NVIDIA H200")
        g.show(used=40 * 2**30, total=141 * 2**30, detail="this kernel 2.1 GiB")
        g                                  # the bar; print(repr(g)) shows text

    ``sends`` counts the updates that reached the widgets (changed values),
    ``history_sends`` those of the history line beside the bar (:meth:`show_history`).
    """

    def __init__(self, device: str, name: str = "", **kwargs):
        label = HTML(f"<b>{html.escape(device)}</b> {html.escape(name)}",
                     layout=Layout(width="16em", overflow="hidden"))
        bar = FloatProgress(min=0.0, max=1.0, value=0.0, bar_style="", layout=Layout(width="30%"))
        history = HTML("", layout=Layout(width="auto"))
        text = HTML("", layout=Layout(width="auto"))
        super().__init__(children=[label, bar, history, text], **kwargs)
        self.device = device
        self.device_name = name
        self.label, self.bar, self.history, self.text = label, bar, history, text
        self.used: int | None = None
        self.total: int | None = None
        self.caption = ""
        self.split = ""
        self.sends = 0
        self.history_sends = 0
        self._shown: tuple = (None, None, None)

    @property
    def fraction(self) -> float | None:
        if not self.total or self.used is None:
            return None
        return self.used / self.total

    def show(self, used: int | None, total: int | None, detail: str = "") -> bool:
        """Display ``used`` of ``total`` bytes; True when the frontend was sent anything."""
        self.used, self.total = used, total
        fraction = self.fraction
        value = round(min(max(fraction, 0.0), 1.0), _RESOLUTION) if fraction is not None else 0.0
        style = bar_style_for(fraction)
        pct = f" ({100 * fraction:.0f}%)" if fraction is not None else ""
        caption = f"{fmt_bytes(used)} / {fmt_bytes(total)}{pct}" if total else NA
        if detail:
            caption = f"{caption} · {detail}"
        shown = (value, style, caption)
        if shown == self._shown:
            return False
        old_value, old_style, old_caption = self._shown
        self._shown = shown
        self.caption = caption
        if (value, style) != (old_value, old_style):
            with self.bar.hold_sync():  # value and colour travel in one message
                self.bar.value = value
                self.bar.bar_style = style
        if caption != old_caption:
            self._show_text()
        self.sends += 1
        return True

    def show_split(self, split: str) -> bool:
        """Show who holds the device (``"kernel 5e1f (b.ipynb) 20.0 GiB · orphan 5.0 GiB"``) under the
        figures; True when it changed."""
        if split == self.split:
            return False
        self.split = split
        self._show_text()
        return True

    def _show_text(self) -> None:
        split = f"<div class='gpumagic-split'>{html.escape(self.split)}</div>" if self.split else ""
        self.text.value = html.escape(self.caption) + split

    def show_history(self, svg: str) -> bool:
        """Show the history line (inline SVG, :mod:`.sparkline`); True when it changed (one message)."""
        if svg == self.history.value:
            return False
        self.history.value = svg
        self.history_sends += 1
        return True

    def text_line(self, width: int = 20) -> str:
        """``cuda:0 [######..............] 40.0 GiB / 141.0 GiB (28%)``"""
        fraction = self.fraction
        filled = int(round((fraction or 0.0) * width))
        bar = "#" * filled + "." * (width - filled)
        return f"{self.device} [{bar}] {self.caption or NA}"

    def __repr__(self):
        # Widgets put repr() in their text/plain; a terminal then shows the bar as text.
        return self.text_line()

    def _repr_pretty_(self, p, cycle):
        p.text(self.text_line())

    def close(self):
        """Close the gauge with its parts, their layouts and styles included."""
        close_tree(self)
