"""Text and HTML renderings of the same data, and whether widgets can be shown."""
from __future__ import annotations

import html
import logging
import sys

logger = logging.getLogger(__name__)

__all__ = ["NA", "widgets_supported", "fmt_bytes", "text_table", "html_table", "Rendered", "note", "show"]

NA = "n/a"


def widgets_supported(shell=None) -> bool:
    """True in a Jupyter kernel with ipywidgets importable; False in terminal IPython."""
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return False
        shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:
        import ipywidgets  # noqa: F401
    except Exception:  # missing, or broken by a mismatched dependency
        logger.debug("ipywidgets does not import; showing text instead of widgets", exc_info=True)
        return False
    return True


def fmt_bytes(n) -> str:
    """``1536 -> '1.5 KiB'``; ``None -> 'n/a'``."""
    if n is None:
        return NA
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.1f} TiB"


def text_table(rows: list[list[str]], header: list[str]) -> str:
    """A plain fixed-width table."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    def line(cells):
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def html_table(rows: list[list[str]], header: list[str]) -> str:
    head = "".join(f"<th style='text-align:left'>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(c))}</td>" for c in r) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class Rendered:
    """An object IPython shows as HTML in a notebook and as text in a terminal."""

    def __init__(self, text: str, html_text: str | None = None):
        self.text = text
        self.html_text = html_text

    def _repr_pretty_(self, p, cycle):
        p.text(self.text)

    def _repr_html_(self):
        return self.html_text

    def __repr__(self):
        return self.text


def note(message: str) -> None:
    """A short note for the user (stderr, so it never becomes a cell's value)."""
    print(message, file=sys.stderr)


def show(shell, result) -> None:
    """``result`` (a report with ``_repr_html_`` and ``text()``) as HTML in a notebook, as text in a terminal."""
    if widgets_supported(shell):
        from IPython.display import display
        display(result)
    else:
        print(result.text())
