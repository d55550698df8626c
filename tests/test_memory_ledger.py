"""%gpumem --cells, the per-cell ledger, through a real InteractiveShell on the CPU (resident memory)."""
from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError

from gpumagic.memory.ledger import Ledger
from tests.conftest import run_cell

pytestmark = pytest.mark.usefixtures("no_last_error")

MIB = 1 << 20


def ledger_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("[gpumem ")]


@pytest.fixture
def ledger(shell):
    _, out, _ = run_cell(shell, "%gpumem --cells")
    assert "The memory ledger is on" in out
    yield shell
    _, out, _ = run_cell(shell, "%gpumem --cells")
    assert "The memory ledger is off" in out


def test_a_list_of_losses_keeping_graphs_is_flagged_with_its_name(ledger, no_cuda_init):
    shell = ledger
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(1024, 1024)\nlosses = []")
    step = ("x = torch.randn(8192, 1024)             # 32 MiB\n"
            "loss = model(x).pow(2).mean()\n"
            "losses.append(loss)              # keeps every step's graph (its activations)")
    _, first, _ = run_cell(shell, step)
    assert "leak?" not in first
    kept = [float(m) for m in re.findall(r"\(\+([\d.]+) MiB kept\)", first)]
    assert kept and kept[0] >= 30, first
    _, second, _ = run_cell(shell, step)
    lines = ledger_lines(second)
    label = f"[gpumem In[{shell.execution_count - 1}]]"
    assert lines[0].startswith(f"{label} cpu: ") and "kept)" in lines[0] and ", peak " in lines[0]
    # each step keeps its input and its output for backward (64 MiB); the graph reaches the weight too
    assert "grew: losses +64.0 MiB (132.0 MiB now)" in second, second
    assert f"{label} leak? this cell kept more on cpu on each of its last 2 runs" in second
    assert second.rstrip().endswith("what grew: losses")


def test_a_rerun_that_rebinds_is_no_leak_and_quiet_cells_print_nothing(ledger, no_cuda_init):
    shell = ledger
    run_cell(shell, "import torch")
    cell = "weights = torch.ones(64 * 1024 * 1024 // 4)"
    _, first, _ = run_cell(shell, cell)
    assert "(+64." in first and "grew: weights +64.0 MiB" in first
    for _ in range(2):
        _, out, _ = run_cell(shell, cell)          # the new tensor is made before the old one goes
        line, = ledger_lines(out)
        before, after, peak = (float(x) for x in re.findall(r"([\d.]+) MiB", line)[:3])
        assert abs(after - before) < 8 and peak - before > 60, line
        assert "leak?" not in out and "grew" not in out
    _, out, _ = run_cell(shell, "n = 1 + 1")
    assert ledger_lines(out) == []


def test_results_piling_up_in_out_are_named(ledger, no_cuda_init):
    shell = ledger
    run_cell(shell, "import torch\nw = torch.ones(16)")
    outs = [run_cell(shell, "torch.ones(32 * 1024 * 1024 // 4) * w[0]")[1] for _ in range(3)]
    assert all(re.search(r"grew: Out\[\d+\] \+32\.0 MiB", out) for out in outs), outs
    assert "leak? this cell kept more on cpu on each of its last 3 runs" in outs[-1]
    assert re.search(r"what grew: Out\[\d+\]$", outs[-1].rstrip())


def test_the_ledger_is_off_by_default_and_takes_no_json(shell):
    run_cell(shell, "import torch")
    _, out, _ = run_cell(shell, "big = torch.ones(64 * 1024 * 1024 // 4)")
    assert ledger_lines(out) == []
    with pytest.raises(UsageError, match="--json returns a report's data; --cells has none"):
        shell.run_line_magic("gpumem", "--cells --json")
    with pytest.raises(UsageError, match="--free and --cells cannot be combined"):
        shell.run_line_magic("gpumem", "--cells --free")


def test_the_ledger_alone_without_ipython():
    import torch
    ns: dict = {"torch": torch}
    ledger = Ledger()
    ledger.start(ns)
    ns["block"] = torch.ones(64 * MIB // 4)
    entry = ledger.finish(ns, "block = torch.ones(...)", "In[1]")
    assert entry is not None and entry.devices[0].device == "cpu" and entry.devices[0].kept > 60 * MIB
    assert entry.grew == [("block", 64 * MIB, 64 * MIB)] and entry.leak is None
    assert entry.as_dict()["grew"] == {"block": {"more": 64 * MIB, "now": 64 * MIB}}
