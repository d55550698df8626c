#!/usr/bin/env bash
# Run the tour notebook headless, top to bottom, in a fresh kernel of this
# Python, and leave an executed copy beside it with every output:
#
#     bash scripts/run_tour.sh                     # examples/01_tour.ipynb
#     bash scripts/run_tour.sh examples/0*.ipynb   # several, one kernel each (copies are skipped)
#     PYTHON=.venv/bin/python bash scripts/run_tour.sh
#
# writes examples/01_tour.executed.ipynb (gitignored). Exits non-zero, after
# writing the copies, if a cell raised in any of them. It needs a Python with
# gpumagic's test extra; scripts/examples.sh sets one up and runs every example.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -gt 0 ]] || set -- examples/01_tour.ipynb
py="${PYTHON:-python}"
# The checkout's gpumagic, whether or not it is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

exec "$py" - "$@" <<'PY'
import os
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

failures = 0
notebooks = cells_ran = cells = 0
for src in sys.argv[1:]:
    if src.endswith(".executed.ipynb"):
        continue
    dst = src[: -len(".ipynb")] + ".executed.ipynb"
    nb = nbformat.read(src, as_version=4)
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",  # jupyter_client runs the "python3" kernel with this very interpreter
        extra_arguments=["--IPKernelApp.log_level=ERROR"],  # not ipykernel's warning about TCP on loopback
        resources={"metadata": {"path": os.path.dirname(os.path.abspath(src))}},
    )
    start = time.perf_counter()
    failed = None
    try:
        client.execute()
    except CellExecutionError as exc:
        failed = exc
    finally:
        nbformat.write(nb, dst)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    ran = sum(1 for c in code_cells if c.get("execution_count"))
    notebooks += 1
    cells_ran += ran
    cells += len(code_cells)
    print(f"{src}: {ran}/{len(code_cells)} code cells ran in {time.perf_counter() - start:.1f} s -> {dst}",
          flush=True)
    if failed is not None:
        failures += 1
        print(str(failed)[-4000:], file=sys.stderr)
if notebooks > 1:
    print(f"{notebooks} notebooks, {cells_ran}/{cells} code cells ran"
          + (f", {failures} notebook(s) failed" if failures else ", none failed"), flush=True)
sys.exit(1 if failures else 0)
PY
