#!/usr/bin/env bash
# Run the tour notebook headless, top to bottom, in a fresh kernel of this
# Python, and leave an executed copy beside it with every output:
#
#     scripts/run_tour.sh                          # examples/01_tour.ipynb
#     scripts/run_tour.sh examples/02_dataparallel.ipynb
#     PYTHON=.venv/bin/python scripts/run_tour.sh
#
# writes examples/01_tour.executed.ipynb (gitignored). Exits non-zero, after
# writing the copy, if a cell raises.
set -euo pipefail
cd "$(dirname "$0")/.."
nb="${1:-examples/01_tour.ipynb}"
out="${nb%.ipynb}.executed.ipynb"
py="${PYTHON:-python}"
# The checkout's gpumagic, whether or not it is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

exec "$py" - "$nb" "$out" <<'PY'
import os
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

src, dst = sys.argv[1], sys.argv[2]
nb = nbformat.read(src, as_version=4)
client = NotebookClient(
    nb,
    timeout=600,
    kernel_name="python3",  # jupyter_client runs the "python3" kernel with this very interpreter
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
elapsed = time.perf_counter() - start
code_cells = [c for c in nb.cells if c.cell_type == "code"]
ran = sum(1 for c in code_cells if c.get("execution_count"))
print(f"{src}: {ran}/{len(code_cells)} code cells ran in {elapsed:.1f} s -> {dst}")
if failed is not None:
    print(str(failed)[-4000:], file=sys.stderr)
    sys.exit(1)
PY
