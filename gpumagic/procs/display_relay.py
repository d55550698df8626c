"""What a worker's cell displays, shown in the notebook as a plain cell shows it.

A worker is not IPython (``get_ipython()`` is None there, so that tqdm and rich draw as text), and
IPython's ``display()`` without a shell prints a repr: a live loss plot (``plt.show()`` under the
inline backend, which the kernel's ``MPLBACKEND`` gives the workers) became ``Figure(640x480)``,
a DataFrame of metrics a text table. Here, while a task whose output reaches the cell runs,
``display``, ``update_display`` and ``clear_output`` send the object's rich representation
(HTML, PNG...; a matplotlib figure rendered to PNG) to the kernel, which publishes it in the
cell; a rank whose prints are not shown shows nothing either.

Worker side: :func:`relay_displays` (once, as a worker starts); kernel side: :func:`show`
(for each ``("display", ...)`` or ``("clear", wait)`` message).
"""
from __future__ import annotations

import base64
import io
import logging
import sys
import uuid

from .import_patches import patch_module

logger = logging.getLogger(__name__)

__all__ = ["relay_displays", "relay_in", "show", "shown_rank", "publish", "stop_open_bars"]

# Modules that hold IPython's display functions under their own names.
_HOLDERS = ("IPython.core.display_functions", "IPython.display", "matplotlib_inline.backend_inline")
_ctx = None                 # this worker's context, once relay_displays ran
_originals: dict = {}       # IPython's own functions: outside a task they do what they did
_BAR = "gpumagic_bar"       # a display's metadata key: a progress bar's state (publish), not shown
_open_bars: dict = {}       # kernel: display id -> how that bar looks stopped, for bars not closed yet


def relay_displays(ctx) -> None:
    """From now on, in this worker, ``display()`` and ``clear_output()`` reach the cell (see above)."""
    global _ctx
    _ctx = ctx
    for name in _HOLDERS:
        patch_module(name, _patch)


def _patch(module) -> None:
    for name, relayed in (("display", _display), ("clear_output", _clear_output)):
        current = getattr(module, name, None)
        if current is not None and current is not relayed:
            _originals.setdefault(name, current)
            setattr(module, name, relayed)


def relay_in(ns: dict) -> None:
    """A forked worker's namespace (the notebook's, copied) holds IPython's own ``display`` where the
    notebook imported it: the relayed one goes in its place."""
    relayed = {id(_originals[name]): function for name, function in (("display", _display),
                                                                      ("clear_output", _clear_output))
               if name in _originals}
    for name, value in list(ns.items()):
        if id(value) in relayed:
            ns[name] = relayed[id(value)]


def _task():
    """The context while a task runs in this worker, else None."""
    return _ctx if _ctx is not None and _ctx.in_task else None


def shown_rank() -> int | None:
    """This worker's rank while a task whose output reaches the cell runs, else None."""
    ctx = _task()
    return ctx.rank if ctx is not None and ctx.forward else None


def publish(data: dict, display_id: str, update: bool, bar: dict | None = None) -> bool:
    """``data`` (MIME type: content) shown in the cell as the display ``display_id``, or (``update``) in
    place of what it showed; False where the task's output does not reach the cell. ``bar``: for a progress
    bar, ``{"stopped": data}`` while it is open (what the kernel shows if the task ends first) or
    ``{"closed": True}``."""
    ctx = _task()
    if ctx is None or not ctx.forward:
        return False
    ctx._send(("display", data, {_BAR: bar} if bar else {}, {"display_id": display_id}, update))
    return True


def _display(*objs, include=None, exclude=None, metadata=None, transient=None, display_id=None, raw=False,
             clear=False, **kwargs):
    ctx = _task()
    if ctx is None:
        return _originals["display"](*objs, include=include, exclude=exclude, metadata=metadata,
                                     transient=transient, display_id=display_id, raw=raw, clear=clear, **kwargs)
    transient = dict(transient or {})
    if display_id is True:
        display_id = uuid.uuid4().hex
    if display_id:
        transient["display_id"] = display_id
    if ctx.forward:
        if clear:
            _clear_output(wait=True)
        if not objs and display_id:   # an empty output to update later
            objs, raw = ({},), True
        for obj in objs:
            data, md = (obj, dict(metadata or {})) if raw else _bundle(obj, include, exclude)
            if not data:
                continue
            md.update(metadata or {})
            ctx._send(("display", data, md, transient, bool(kwargs.get("update"))))
    if display_id:
        from IPython.core.display_functions import DisplayHandle
        return DisplayHandle(display_id)
    return None


def _clear_output(wait: bool = False) -> None:
    ctx = _task()
    if ctx is None:
        _originals["clear_output"](wait=wait)
    elif ctx.forward:
        ctx._send(("clear", bool(wait)))


def _bundle(obj, include, exclude) -> tuple[dict, dict]:
    """``obj``'s representations by MIME type, as the kernel's formatter would give them."""
    figure = sys.modules.get("matplotlib.figure")
    if figure is not None and isinstance(obj, figure.Figure):
        # The kernel's inline backend registers a PNG formatter for figures; a worker has none.
        png = io.BytesIO()
        obj.savefig(png, format="png", bbox_inches="tight")
        return {"image/png": base64.b64encode(png.getvalue()).decode("ascii"), "text/plain": repr(obj)}, {}
    from IPython.core.formatters import DisplayFormatter
    data, md = DisplayFormatter().format(obj, include=include, exclude=exclude)
    return data, dict(md)


def show(message: tuple) -> None:
    """In the kernel: publish a worker's display (after what it printed before), or clear the output."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            logger.debug("a closed stream", exc_info=True)
    from IPython.core.interactiveshell import InteractiveShell
    if message[0] == "clear":
        if InteractiveShell.initialized():
            from IPython.display import clear_output
            clear_output(wait=message[1])
        return
    _, data, metadata, transient, update = message
    bar = metadata.pop(_BAR, None) if metadata else None
    display_id = (transient or {}).get("display_id")
    if bar is not None and display_id is not None:
        if "stopped" in bar:
            _open_bars[display_id] = bar["stopped"]
        else:
            _open_bars.pop(display_id, None)
    if not InteractiveShell.initialized():   # (plain Python: no shell to publish through)
        print(data.get("text/plain", ""))
        return
    from IPython.display import publish_display_data
    publish_display_data(data, metadata, transient=transient or None, update=update)


def stop_open_bars() -> None:
    """In the kernel, as a task ends: the progress bars its workers left open (a rank interrupted, failed or
    killed mid-loop) are drawn stopped, red, as tqdm.notebook draws a bar an exception ended."""
    from IPython.core.interactiveshell import InteractiveShell
    bars = list(_open_bars.items())
    _open_bars.clear()
    if not bars or not InteractiveShell.initialized():
        return
    from IPython.display import publish_display_data
    for display_id, stopped in bars:
        try:
            publish_display_data(stopped, {}, transient={"display_id": display_id}, update=True)
        except Exception:  # a bar is only a picture: the task's own end must not fail for it
            logger.debug("could not draw a stopped bar", exc_info=True)
