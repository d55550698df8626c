"""What runs in worker processes imports no IPython: a fresh worker's start-up is torch's import and little else."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["gpumagic.procs.worker", "gpumagic.dataparallel.rank.task",
                                    "gpumagic.sharedtrain.worker"])
def test_a_worker_side_module_imports_no_ipython(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'IPython'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
