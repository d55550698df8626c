"""What the benchmark scripts share: the machine and command lines, and appending to RESULTS.md.

Importing it puts the repository root first on ``sys.path``, so that the
scripts measure the checkout they sit in.
"""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")


def machine(gpus) -> str:
    """``2 x NVIDIA H200; host``, or the CPU's name and ``(no GPU)``."""
    if gpus:
        return f"{len(gpus)} x {', '.join(sorted({g.name for g in gpus}))}; {platform.node() or 'host'}"
    from gpumagic import devices
    return f"{devices.cpu_facts()['name']} (no GPU); {platform.node() or 'host'}"


def versions() -> str:
    import torch
    return f"torch {torch.__version__}; Python {platform.python_version()}"


def command(script: str, argv=None) -> str:
    """The command line that ran ``benchmarks/<script>``, quoted for a shell."""
    args = argv or sys.argv[1:]
    return " ".join(shlex.quote(a) for a in ["python", f"benchmarks/{script}", *args])


def markdown_table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def append_results(title: str, lines: list[str], tables) -> None:
    """Append ``### title, date`` with ``lines`` under it, then each ``(header, rows)`` table."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"\n### {title}, {stamp}", *lines]
    for header, rows in tables:
        out += ["", *markdown_table(header, rows)]
    with open(RESULTS, "a") as f:
        f.write("\n".join(out) + "\n")
    print(f"\nappended to {os.path.relpath(RESULTS)}")


def record(script: str, argv, gpus, detail: str, tables) -> None:
    """Append a run of ``benchmarks/<script>`` to RESULTS.md: the machine, the command line with
    ``detail`` after it, and ``tables`` (``(header, rows)`` each)."""
    append_results(script, [f"- machine: {machine(gpus)}; {versions()}",
                            f"- command: `{command(script, argv)}`; {detail}"], tables)


def make_shell():
    """A real IPython shell with gpumagic loaded, as in a notebook."""
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "gpumagic")
    return shell
