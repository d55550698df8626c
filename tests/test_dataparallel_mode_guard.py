"""Framework code that reading the cell cannot show, and framework state a rank keeps between cells (CPU, gloo).

A cell whose framework is reached through a module it imports for the first
time runs in gpumagic's DDP mode; building the framework there is refused with
the fix (``--launch``), the notebook's model untouched, and with ``--launch``
the same cell trains on both ranks. accelerate's process-wide state from an
earlier cell does not make a later launch cell count one process. A model built
in the cell and set up with Fabric comes back.
"""
from __future__ import annotations

import sys

import pytest
import torch

from gpumagic.errors import WorkerError
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell

pytest.importorskip("accelerate")

CPU2 = "--nprocs 2"

SETUP = """\
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8)
"""

# A training script of the user's, as a file the cell imports: accelerate's nlp_example shape.
SCRIPT = """\
import torch
from accelerate import Accelerator

def main(model, loader):
    accelerator = Accelerator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    batches = 0
    for x, y in loader:
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        batches += 1
    return accelerator.num_processes, batches
"""


@pytest.fixture
def script(tmp_path, monkeypatch):
    """``train_script_<n>.py`` in the kernel's (and so the ranks') working directory, not imported yet."""
    name = f"train_script_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_framework_in_a_module_the_cell_imports_is_refused_then_runs_with_launch(shell, script):
    # ranks that start in the directory holding the script, as a notebook's start in the kernel's
    assert run_cell(shell, "%dataparallel stop\n" + SETUP)[0].success
    ns = shell.user_ns
    before = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    cell = f"from {script} import main\nworld, batches = main(model, loader)\n"
    with pytest.raises(WorkerError) as err:
        dp_cell(shell, CPU2, cell)
    assert err.value.exc_type == "SelfDistributingCell"
    assert "an accelerate Accelerator" in err.value.message and "--launch" in err.value.message
    assert f"{script}.py" in err.value.remote_traceback        # where it was built
    assert all(torch.equal(v, before[k]) for k, v in ns["model"].state_dict().items())
    assert "world" not in ns

    _, cap = dp_cell(shell, f"{CPU2} --launch", cell)
    assert (ns["world"], ns["batches"]) == (2, 4)               # 8 batches shared by two ranks
    assert not torch.equal(ns["model"].weight, before["weight"])  # trained, in the notebook's model


def test_a_framework_behind_a_notebook_function_or_method_chooses_launch(shell):
    assert run_cell(shell, SETUP + """
def helper():
    from accelerate import Accelerator     # imported inside the function
    return Accelerator().num_processes

class Experiment:
    def run(self):
        from accelerate import Accelerator
        return Accelerator().num_processes

experiment = Experiment()
""")[0].success
    ns = shell.user_ns
    _, cap = dp_cell(shell, CPU2, "model(torch.zeros(1, 8))\nseen = helper()\n")
    assert "launch mode, because the cell builds an accelerate Accelerator" in cap.stderr
    assert ns["seen"] == 2
    _, cap = dp_cell(shell, CPU2, "seen_by_method = experiment.run()\n")
    assert "launch mode" in cap.stderr and ns["seen_by_method"] == 2


def test_a_launch_cell_run_again_with_other_accelerator_settings_starts_afresh(shell):
    """Under torchrun every run is a fresh process; a rank lives on, and accelerate keeps its state
    in class attributes, which refused a changed setting until the pool restarted."""
    assert run_cell(shell, SETUP)[0].success
    ns = shell.user_ns
    cell = ("from accelerate import Accelerator\nacc = Accelerator(mixed_precision={!r})\n"
            "precision = acc.mixed_precision\nworld = acc.num_processes\n"
            "m, dl = acc.prepare(model, loader)\nbatches = sum(1 for _ in dl)\n")
    dp_cell(shell, CPU2, cell.format("no"))
    assert (ns["precision"], ns["world"], ns["batches"]) == ("no", 2, 4)
    dp_cell(shell, CPU2, cell.format("bf16"))
    assert (ns["precision"], ns["world"], ns["batches"]) == ("bf16", 2, 4)


def test_a_model_built_in_the_cell_and_set_up_with_fabric_comes_back(shell):
    pytest.importorskip("lightning")
    assert run_cell(shell, SETUP + "import lightning as L\n")[0].success
    ns = shell.user_ns
    _, cap = dp_cell(shell, CPU2, """\
fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
torch.manual_seed(1)
net = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
net, optimizer = fabric.setup(net, optimizer)
for x, y in fabric.setup_dataloaders(loader):
    optimizer.zero_grad()
    fabric.backward(torch.nn.functional.mse_loss(net(x), y))
    optimizer.step()
rank0_weight = net.module.weight.detach().clone().tolist()
""")
    assert "models built in the cell (on the CPU): net" in cap.stderr, cap.stderr
    assert type(ns["net"]) is torch.nn.Linear
    assert ns["net"].weight.tolist() == ns["rank0_weight"]
