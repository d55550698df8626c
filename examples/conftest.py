"""Run the example notebooks with nbval whenever pytest collects this folder.

``python -m pytest`` (with ``examples`` in ``testpaths``) or
``python -m pytest examples`` executes each notebook top to bottom in a fresh
kernel of the running Python and compares every output not marked
``# NBVAL_IGNORE_OUTPUT``, after the substitutions in ``nbval_sanitize.cfg``.
The same as::

    python -m pytest --nbval --nbval-current-env \\
        --nbval-sanitize-with examples/nbval_sanitize.cfg examples
"""
from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# Executed copies (scripts/run_tour.sh) and editor checkpoints are not examples.
collect_ignore_glob = ["*.executed.ipynb", ".ipynb_checkpoints/*"]


def pytest_configure(config):
    option = config.option
    if not hasattr(option, "nbval"):  # nbval is not installed: nothing to run here
        return
    option.nbval = True
    if not getattr(option, "nbval_kernel_name", None):
        option.nbval_current_env = True
    if getattr(option, "nbval_sanitize_with", None) is None:
        option.nbval_sanitize_with = str(HERE / "nbval_sanitize.cfg")
    # The kernel imports the checkout's gpumagic even where it is not installed.
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
