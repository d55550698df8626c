"""tqdm's bars in a worker, shown in a notebook's cell the way tqdm's notebook bar shows them.

A worker is no notebook (``get_ipython()`` is None there), so ``tqdm.auto`` gives tqdm's text bar:
an accelerate loop's, Lightning's ``TQDMProgressBar``. Its redraws reached the cell as text, and
nested bars (Lightning's validation bar under its training bar) moved the cursor up (``\\x1b[A``),
which a notebook shows as stray characters. In a plain notebook cell the same code draws
``tqdm.notebook`` bars.

While :func:`notebook_bars` is on (a task from a notebook kernel) and the task's output reaches the
cell, a bar first drawn then is drawn as HTML instead (tqdm.notebook's look: description, a
``<progress>`` bar, the counter and rate): one display per bar, made once and updated in place
through :mod:`.display_relay`, at most once per the bar's ``mininterval`` (its final count at
once), its last state on close (green when done, red when stopped early; a ``leave=False`` bar
that finished is emptied, as tqdm.notebook hides it). Nothing is written to the cell's text
output for it. A bar still open as the task ends is closed then: it ends with the task's names.
Elsewhere (terminal IPython, a rank whose output is not shown, a DataLoader worker forked from
the rank: no link to the kernel of its own) bars stay text; the rank's HTML bars take no text
line in such a child, so its bars draw with no cursor moves.

The hook is tqdm's base class (``tqdm.std.tqdm``): ``tqdm.auto``'s class in a worker, ``tqdm.tqdm``
and Lightning's ``Tqdm`` draw through its ``display``; classes that draw otherwise (``tqdm.rich``,
``tqdm.gui``) are left alone. (``tqdm.notebook``'s class, the kernel's copy in a forked worker or
imported by a task, falls back to the base class: :func:`gpumagic.procs.worker._text_progress_bars`.)

Worker side: :func:`relay_bars` once as the worker starts; ``with notebook_bars(on):`` around a task.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import time
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from html import escape

from . import display_relay
from .import_patches import patch_module

logger = logging.getLogger(__name__)

__all__ = ["relay_bars", "notebook_bars", "render"]

MIN_INTERVAL = 0.1    # seconds between a bar's updates at least (tqdm's default mininterval)
_ATTR = "_gpumagic_html"   # on a bar: its _Shown once drawn as HTML, False once drawn as text
_LEN_TOTAL = "_gpumagic_len_total"   # on an HTML bar: its total was len() of a loader whose share may follow
_STYLES = {"success": "#5cb85c", "danger": "#d9534f"}   # tqdm.notebook's (ipywidgets') bar colours

_on = False
_pid: int | None = None   # the worker's: its children (DataLoader workers) have no link to the kernel of their own
_labelled = False   # whether bars say their rank (every rank's output shown, as lines carry [rank N])
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # HTML bars not closed yet
_fork_hook = False


class _Shown:
    """A bar's display in the cell."""

    def __init__(self, label: str):
        self.display_id = uuid.uuid4().hex
        self.label = label
        self.sent = False       # whether the display exists (later sends update it)
        self.sent_at = 0.0
        self.sent_n: float | None = None
        self.pending = False    # a state not sent yet (throttled)


def relay_bars() -> None:
    """From now on, in this worker, tqdm's text bars can be drawn as HTML (see above)."""
    global _pid, _fork_hook
    _pid = os.getpid()
    patch_module("tqdm.std", _patch)
    if not _fork_hook:
        os.register_at_fork(after_in_child=_forget_in_child)
        _fork_hook = True


@contextmanager
def notebook_bars(on: bool, labelled: bool = False) -> Iterator[None]:
    """While the block runs: bars first drawn in it are HTML displays if ``on`` (a notebook kernel's task)
    and the task's output reaches the cell, prefixed ``[rank N]`` if ``labelled`` (every rank's output
    shown). As it ends, the bars still open are closed (they end with the task's names)."""
    global _on, _labelled
    _on, _labelled = bool(on), bool(labelled)
    try:
        yield
    finally:
        _on = _labelled = False
        # The task's names go with it, and so do its open bars (a break out of a manual loop, an error).
        # Closed when collected, they would close once nothing reaches the cell, or in a later cell's
        # task, and the cell would keep their last draw, which tqdm (drawing at most every
        # mininterval) may have made many updates before.
        for bar in list(_live.values()):
            try:
                bar.close()
            except Exception:  # a bar that cannot close: it stays as last drawn rather than failing the task
                logger.debug("could not close a tqdm bar", exc_info=True)
        _live.clear()


def render(bar, style: str | None = None, label: str = "") -> dict:
    """``bar`` (a tqdm) as tqdm.notebook draws it, in HTML, with a text fallback free of escape codes;
    ``style``: ``"success"`` or ``"danger"``, its bar's colour."""
    d = dict(bar.format_dict)
    d["bar_format"] = (d.get("bar_format") or "{l_bar}<bar/>{r_bar}").replace("{bar}", "<bar/>")
    d["ncols"] = None     # (the cell's width is the page's: nothing to trim to)
    d["colour"] = None    # (a coloured text bar would carry escape codes)
    meter = type(bar).format_meter(**d)
    left, right = re.split(r"\|?<bar/>\|?", meter, maxsplit=1) if "<bar/>" in meter else ("", meter)
    left = label + left
    n, total = bar.n, bar.total
    # Without a total tqdm.notebook shows a full 'info' bar; an indeterminate <progress> says as much.
    value = f" value='{_number(n)}' max='{_number(total)}'" if total else ""
    colour = f"accent-color:{_STYLES[style]};" if style in _STYLES else ""
    html = (f"<div style='display:flex;align-items:center;gap:0.5em;font-family:monospace;white-space:pre'>"
            f"<span>{escape(left)}</span>"
            f"<progress{value} style='flex:1 1 auto;max-width:40em;{colour}'></progress>"
            f"<span>{escape(right)}</span></div>")
    return {"text/html": html, "text/plain": f"{left}|{right}"}


def _number(x) -> str:
    return str(int(x)) if float(x).is_integer() else f"{float(x):.6g}"


def _patch(module) -> None:
    cls = getattr(module, "tqdm", None)
    if cls is None or getattr(cls.display, "_gpumagic_html", False):
        return
    methods = (("display", _display_for(cls.display)), ("clear", _clear_for(cls.clear)),
               ("close", _close_for(cls.close)))
    for name, method in methods:
        method._gpumagic_html = True
        method.__doc__ = getattr(cls, name).__doc__
        setattr(cls, name, method)
    if not getattr(cls.__init__, "_gpumagic_html", False):
        cls.__init__ = _html_init(cls.__init__)


def _display_for(own_display):
    """tqdm's ``display``, drawing an HTML bar where the worker's output shows as HTML."""
    def display(self, msg=None, pos=None):
        shown = _shown(self)
        if shown is None:
            if msg is None:   # (a text bar over a loader's share ends full too: terminal IPython)
                _follow_share(self)
            return own_display(self, msg=msg, pos=pos)
        if msg != "":   # (tqdm's "" erases the line: the notebook's bar stays until it closes)
            _follow_share(self)
            _draw(self, shown)
        return True
    return display


def _clear_for(own_clear):
    def clear(self, nolock=False):
        if not isinstance(vars(self).get(_ATTR), _Shown):
            return own_clear(self, nolock=nolock)
        return None   # (tqdm.write clears bars around its line: an HTML bar is not in the text)
    return clear


def _close_for(own_close):
    """tqdm's ``close``: an HTML bar ends green, red where it stopped early, or goes where it does not stay."""
    def close(self):
        shown = vars(self).get(_ATTR)
        if not isinstance(shown, _Shown) or getattr(self, "disable", True):
            return own_close(self)
        _follow_share(self)
        leave = abs(self.pos) == 0 if self.leave is None else self.leave
        # tqdm's own close, as for a GUI bar (no screen printer): it writes no line end or erase.
        printer = vars(self).pop("sp", None)
        try:
            own_close(self)
        finally:
            if printer is not None:
                self.sp = printer
        _live.pop(id(self), None)
        if self.total and self.n < self.total:
            _send(self, shown, style="danger")   # stopped early (an error, a break): shown, as tqdm.notebook does
        elif leave:
            _send(self, shown, style="success")
        elif shown.sent:
            _send(self, shown, data={"text/html": "", "text/plain": ""})
        return None
    return close


def _html_init(own_init):
    """tqdm's ``disable=None`` hides a bar off a terminal (a worker's streams are none); tqdm.notebook,
    which a plain cell draws, shows it: so does a bar that will be drawn as HTML. A worker's bar whose
    total is its iterable's ``len()`` is marked, for :func:`_follow_share`."""
    @functools.wraps(own_init)
    def __init__(self, *args, **kwargs):
        html = _html_now() is not None
        if html and "disable" in kwargs and kwargs["disable"] is None:
            kwargs["disable"] = False
        own_init(self, *args, **kwargs)
        if os.getpid() == _pid and kwargs.get("total") is None and len(args) < 3:   # (iterable, desc, total, ...)
            vars(self)[_LEN_TOTAL] = True   # (an HTML or a text bar, in the worker itself)
    __init__._gpumagic_html = True
    return __init__


def _follow_share(bar) -> None:
    """A bar over a loader the worker reads a share of (``tqdm(loader)``) took its total from ``len()``
    before the pass began: the whole loader's, until a split pass has started (an evaluation pass reads
    it whole). Once one has, the total is the share's, as tqdm would have taken it then."""
    if not vars(bar).get(_LEN_TOTAL):
        return
    from .loaders import ShardedBatchSampler
    sampler = getattr(getattr(bar, "iterable", None), "batch_sampler", None)
    if not isinstance(sampler, ShardedBatchSampler):
        vars(bar)[_LEN_TOTAL] = False
    elif sampler.trained:
        vars(bar)[_LEN_TOTAL] = False
        try:
            bar.total = len(bar.iterable)
        except TypeError:   # (no length after all: the total stays as tqdm took it)
            logger.debug("the loader of a tqdm bar has no length", exc_info=True)


def _forget_in_child() -> None:
    """In a process forked from a worker's task (a DataLoader worker): the worker's HTML bars are no text
    lines there, so the child's text bars take their own line from the first, with no cursor moves."""
    for bar in list(_live.values()):
        instances = getattr(type(bar), "_instances", None)
        if instances is not None:
            instances.discard(bar)
    _live.clear()


def _html_now() -> int | None:
    """The rank whose bars are drawn as HTML now (a notebook's task whose output reaches the cell), else None."""
    return display_relay.shown_rank() if _on and os.getpid() == _pid else None


def _shown(bar) -> _Shown | None:
    """The bar's display if it is drawn as HTML; whether it is, is decided as it is first drawn."""
    shown = vars(bar).get(_ATTR)
    if shown is None:
        rank = _html_now()
        if rank is None:
            vars(bar)[_ATTR] = False
            return None
        shown = vars(bar)[_ATTR] = _Shown(f"[rank {rank}] " if _labelled else "")
        _live[id(bar)] = bar
    return shown if isinstance(shown, _Shown) else None


def _draw(bar, shown: _Shown) -> None:
    """Send the bar's state, unless one went less than ``mininterval`` ago (then it waits for the next
    draw, the bar's close or the task's end); the first state and the final count go at once."""
    now = time.monotonic()
    done = bar.total is not None and bar.n >= bar.total and shown.sent_n != bar.n
    if shown.sent and not done and now - shown.sent_at < max(bar.mininterval or 0.0, MIN_INTERVAL):
        shown.pending = True
        return
    _send(bar, shown)


def _send(bar, shown: _Shown, style: str | None = None, data: dict | None = None) -> None:
    if os.getpid() != _pid:   # (a forked child's copy of the bar: it would write on the worker's link)
        return
    try:
        # an open bar carries its stopped look, which the kernel draws if the task ends without closing it
        # (the rank interrupted or killed mid-loop: display_relay.stop_open_bars)
        ending = {"closed": True} if style is not None or data is not None else \
            {"stopped": render(bar, "danger", shown.label)}
        data = data if data is not None else render(bar, style, shown.label)
    except Exception:  # a bar that cannot format itself: it shows nothing rather than stopping the cell
        logger.debug("could not render a tqdm bar", exc_info=True)
        return
    if display_relay.publish(data, shown.display_id, update=shown.sent, bar=ending):
        shown.sent, shown.sent_at, shown.sent_n, shown.pending = True, time.monotonic(), bar.n, False
