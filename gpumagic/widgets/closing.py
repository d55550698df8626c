"""Closing a widget together with the widgets it made: children, ``layout``, ``style``.

ipywidgets' ``Widget.close`` closes that one widget's comm only. Every
``HTML``, ``FloatProgress`` or ``Dropdown`` also creates a ``Layout`` and a
style widget, each with a comm of its own, so closing only the visible widgets
leaves those open in the kernel (and in the frontend) for good.
"""
from __future__ import annotations

from typing import Any

# At module level: Widget.__del__ calls close(), which may run late in interpreter shutdown.
from ipywidgets import Widget

__all__ = ["close_tree"]


def close_tree(widget: Any) -> None:
    """Close ``widget`` and every widget its synced traits reach (children, layout, style...).

    Closes each with ``Widget.close`` itself, so a subclass may call this from its
    own ``close``. Closing twice is harmless.
    """
    found: dict[int, Widget] = {}
    pending = [widget]
    while pending:
        w = pending.pop()
        if id(w) in found:
            continue
        found[id(w)] = w
        for key in w.keys:
            value = getattr(w, key, None)
            values = value if isinstance(value, (list, tuple)) else (value,)
            pending.extend(v for v in values if isinstance(v, Widget))
    for w in found.values():
        Widget.close(w)
