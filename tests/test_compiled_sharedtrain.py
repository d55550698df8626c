"""%%sharedtrain with models the notebook compiled, scripted or compiles in the cell (two CPU workers)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cell
from tests.test_magics_sharedtrain import SETUP

CELL = """%%sharedtrain --nprocs 2 --start-method {method} --seed 3
for x, y, idx in loader:
    {opt}.zero_grad()
    loss = F.cross_entropy({model}(x), y)
    loss.backward()
    {opt}.step()
{after}"""


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiled_model_trains_in_spawned_workers_without_torchs_cleanup_noise(shell):
    # Each worker cleared the cell's namespace while torch.compile's globals in it still had cleanup
    # hooks: every worker printed "Exception ignored ... KeyError: '__builtins_dict___0'" into the cell.
    run_cell(shell, SETUP + "optimizer = torch.optim.SGD(model.parameters(), lr=0.2)\n"
                            "cmodel = torch.compile(model, backend='eager')\n")
    ns = shell.user_ns
    model, before = ns["model"], ns["fixed_loss"]()
    result, out, _ = run_cell(shell, CELL.format(method="spawn", opt="optimizer", model="cmodel", after=""))
    assert result.success, out
    assert "sharedtrain: 2 workers (spawn) on cpu trained 'cmodel'" in out, out
    assert "Exception ignored" not in out and "KeyError" not in out, out
    assert ns["cmodel"]._orig_mod is model and all(p.is_shared() for p in model.parameters())
    assert ns["fixed_loss"]() < before - 0.02
    torch.testing.assert_close(ns["cmodel"](ns["data"].x[:4]), model(ns["data"].x[:4]))


def test_a_torchscript_model_trains_under_fork_and_what_the_cell_set_comes_back(shell):
    # The kernel set what the cell set on the model (eval()) through get_submodule, which a
    # ScriptModule lacks: the trained cell ended in a RuntimeError blamed on a worker.
    run_cell(shell, SETUP + "smodel = torch.jit.script(Net())\n"
                            "sopt = torch.optim.SGD(smodel.parameters(), lr=0.2)\n"
                            "w0 = smodel.fc1.weight.detach().clone()\n")
    ns = shell.user_ns
    smodel = ns["smodel"]
    result, out, _ = run_cell(shell, CELL.format(method="fork", opt="sopt", model="smodel", after="smodel.eval()\n"))
    assert result.success, out
    assert "trained 'smodel'" in out, out
    assert ns["smodel"] is smodel and not smodel.training and not smodel.fc1.training
    assert not torch.equal(smodel.fc1.weight.detach(), ns["w0"])


def test_what_cannot_reach_spawned_workers_is_refused_with_what_to_do(shell):
    # The advice was "create it inside the cell": a module made there would share nothing.
    run_cell(shell, SETUP + "smodel = torch.jit.script(Net())\n"
                            "sopt = torch.optim.SGD(smodel.parameters(), lr=0.2)\n")
    result, out, _ = run_cell(shell, CELL.format(method="spawn", opt="sopt", model="smodel", after=""))
    assert "'smodel' (RecursiveScriptModule) cannot be sent to spawned workers" in out, out
    assert "use --start-method fork, whose workers share the notebook's module" in out, out


def test_the_model_a_compiled_notebook_function_calls_is_found_and_trained(shell):
    # The cell's modules are found through the notebook functions it calls; torch.compile's wrapper hid
    # the function: "the cell uses no torch.nn.Module from the notebook".
    run_cell(shell, SETUP + "optimizer = torch.optim.SGD(model.parameters(), lr=0.2)\n"
                            "@torch.compile(backend='eager')\ndef forward(x):\n    return model(x)\n")
    ns = shell.user_ns
    before = ns["fixed_loss"]()
    result, out, _ = run_cell(shell, CELL.format(method="fork", opt="optimizer", model="forward", after=""))
    assert result.success and "trained 'model'" in out, out
    assert ns["fixed_loss"]() < before - 0.02
    # spawned workers get the plain function, compiled again there with the notebook's options (it was
    # refused: "cannot pickle 'DynamoTLS' object"), reading the workers' shared model
    after = ns["fixed_loss"]()
    result, out, _ = run_cell(shell, CELL.format(
        method="spawn", opt="optimizer", model="forward",
        after="import torch._dynamo.utils\nreport(graphs=torch._dynamo.utils.counters['stats']['unique_graphs'])"))
    assert result.success and "trained 'model'" in out and "(spawn)" in out, out
    assert ns["fixed_loss"]() < after - 0.01
    assert ns["sharedtrain"].history[0][-1]["graphs"] >= 1, ns["sharedtrain"].history[0]
    assert ns["forward"]._torchdynamo_orig_callable(ns["data"].x[:1]).shape[0] == 1   # the notebook's, as it was
