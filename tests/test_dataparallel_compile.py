"""%%dataparallel --compile on the CPU: two gloo ranks compile the cell's model with torch.compile,
train it as one eager process would, keep it warm for later cells, and say when they compiled."""
from __future__ import annotations

import random
import re

import pytest
import torch
from IPython.core.error import UsageError

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.errors import WorkerError
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, last_result
from tests.test_magics_dataparallel import CPU2, SETUP, TRAIN, _reference

pytestmark = pytest.mark.filterwarnings("ignore:the cell reads no DataLoader")


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def _first_step(result) -> float:
    return result.per_rank[0].first_step


def _assert_weights(ns, reference):
    for name, p in ns["model"].state_dict().items():     # no _orig_mod. or module. prefix
        torch.testing.assert_close(p, reference.state_dict()[name], atol=1e-4, rtol=0)


def test_compiled_training_equals_eager_training_and_a_later_cell_reuses_the_compiled_model(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns)
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    _assert_weights(ns, ref_model)
    assert "--compile: compiled" in cap.stderr or "--compile: traced again" in cap.stderr, cap.stderr
    first = _first_step(last_result())
    # The same model again, continuing from the trained weights and the optimizer's momentum:
    # the ranks train the model they compiled, with nothing traced or compiled again.
    ref_model, _, _ = _reference(ns)
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    assert "--compile: the compiled model was reused, nothing recompiled" in cap.stderr, cap.stderr
    _assert_weights(ns, ref_model)
    again = _first_step(last_result())
    assert again < 2.0 and again < first, (first, again)


def test_a_model_made_only_of_torchs_layers_is_compiled(shell):
    # dynamo skips torch's own frames: compiling the DDP wrapper or nn.Module.compile() traced nothing here
    run_cell(shell, SETUP.format(shuffle=False).replace(
        "model = Net()", "model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))"))
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns)
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    assert "--compile: compiled" in cap.stderr or "--compile: traced again" in cap.stderr, cap.stderr
    _assert_weights(ns, ref_model)
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    assert "--compile: the compiled model was reused, nothing recompiled" in cap.stderr, cap.stderr


def test_a_layer_replaced_in_a_compiled_cell_comes_back_and_the_next_cell_compiles_anew(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    ns = shell.user_ns
    model = ns["model"]
    dp_cell(shell, f"{CPU2} --compile", "model.out = nn.Linear(12, 3)\n"
                                        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            + TRAIN.replace("- y) ** 2", "[:, :2] - y) ** 2"))
    assert ns["model"] is model and model.out.out_features == 3     # the notebook's model took the layer
    assert all("forward" not in vars(m) for m in model.modules())   # and nothing compiled came with it
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN.replace("- y) ** 2", "[:, :2] - y) ** 2"))
    assert "--compile: compiled" in cap.stderr or "--compile: traced again" in cap.stderr, cap.stderr
    assert "model: the last cell replaced layers" in cap.stderr, cap.stderr


def test_a_new_model_of_the_same_class_trains_in_the_kept_compiled_model(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, f"{CPU2} --compile", TRAIN)
    # New weights and a fresh optimizer, the class unchanged: the shipped weights go into the kept model.
    run_cell(shell, "torch.manual_seed(7); model = Net(); "
                    "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)")
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns)
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    assert "--compile: the compiled model was reused" in cap.stderr, cap.stderr
    _assert_weights(ns, ref_model)


def test_a_changed_global_that_forward_reads_is_seen(shell):
    run_cell(shell, "SCALE = 1.0\n" + SETUP.format(shuffle=False).replace(
        "torch.tanh(self.hidden(x))", "torch.tanh(self.hidden(x) * SCALE)"))
    dp_cell(shell, f"{CPU2} --compile", TRAIN)
    run_cell(shell, "SCALE = 0.25")
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns)      # forward reads the notebook's SCALE: 0.25
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    assert "model: Net's code or a global it reads changed" in cap.stderr, cap.stderr
    _assert_weights(ns, ref_model)


def test_a_changed_partial_that_forward_reads_is_seen(shell):
    # a partial compares by what it holds (its func, args and keywords), not by its empty __dict__
    run_cell(shell, "from functools import partial\nimport torch.nn.functional as F\n"
                    "act = partial(F.leaky_relu, negative_slope=0.1)\n" + SETUP.format(shuffle=False).replace(
                        "torch.tanh(self.hidden(x))", "act(self.hidden(x))"))
    dp_cell(shell, f"{CPU2} --compile", TRAIN)
    run_cell(shell, "act = partial(F.leaky_relu, negative_slope=0.5)")
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns)      # forward reads the notebook's act: slope 0.5
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    assert "the compiled model was reused" not in cap.stderr, cap.stderr
    assert "model: Net's code or a global it reads changed" in cap.stderr, cap.stderr
    _assert_weights(ns, ref_model)


def test_a_changed_model_class_is_compiled_again_with_a_note(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    dp_cell(shell, f"{CPU2} --compile", TRAIN)
    # A new forward, with a constant drawn now. Dynamo traces it again; inductor may still find the
    # graph in its on-disk cache (torch passes float constants to graphs as inputs), so the note says
    # "compiled N graphs" or "traced again ... from inductor's cache", with the reason either way.
    scale = 1 + random.random() / 1000
    run_cell(shell, SETUP.format(shuffle=False).replace("torch.tanh(self.hidden(x))",
                                                        f"torch.tanh(self.hidden(x) * {scale!r})"))
    ns = shell.user_ns
    ref_model, _, _ = _reference(ns)
    _, cap = dp_cell(shell, f"{CPU2} --compile", TRAIN)
    assert re.search(r"--compile: (compiled \d+ graphs?|traced again) \(model: Net was defined again\)",
                     cap.stderr), cap.stderr
    _assert_weights(ns, ref_model)


def test_a_compile_error_is_a_worker_error_at_the_cells_line(shell):
    run_cell(shell, SETUP.format(shuffle=False))
    before = {k: v.clone() for k, v in shell.user_ns["model"].state_dict().items()}
    with pytest.raises(WorkerError) as err:
        dp_cell(shell, f"{CPU2} --compile", """
            x = torch.randn(4, 7)              # the model takes 6 features
            model(x).sum().backward()
        """)
    tb = err.value.remote_traceback
    assert "line 4, in <module>\n    model(x).sum().backward()" in tb, tb   # the magic line is line 1
    for k, v in shell.user_ns["model"].state_dict().items():
        assert torch.equal(v, before[k])      # the notebook's model is untouched


@pytest.mark.parametrize("line, says", [
    (f"{CPU2} --compile fastest", "reduce-overhead"),
    (f"{CPU2} --strategy dp --compile", "--strategy ddp"),
])
def test_bad_compile_options_are_refused_before_any_process(shell, line, says):
    run_cell(shell, SETUP.format(shuffle=False))
    with pytest.raises(UsageError, match=says):
        dp_cell(shell, line, TRAIN)


def test_a_model_the_notebook_compiled_trains_with_and_without_compile_and_stays_usable(shell):
    # Introduction to torch.compile: `model = torch.compile(model)` in an earlier cell. The ranks
    # wrapped torch's OptimizedModule in DDP, whose forward tests the module's truth: len() raised.
    run_cell(shell, SETUP.format(shuffle=False) + "model = torch.compile(model)\n")
    ns = shell.user_ns
    inner = ns["model"]._orig_mod   # (the reference trains the model inside, eagerly)
    notes = []
    for line in (f"{CPU2} --compile", f"{CPU2} --compile", CPU2):
        ref_model, _, _ = _reference({**ns, "model": inner})
        _, cap = dp_cell(shell, line, TRAIN)
        _assert_weights({"model": inner}, ref_model)
        notes.append(cap.stderr)
    assert "--compile: the compiled model was reused, nothing recompiled" in notes[1], notes[1]
    assert type(ns["model"]).__name__ == "OptimizedModule" and ns["model"]._orig_mod is inner
    result, out, _ = run_cell(shell, "import io, pickle\n"
                                     "y = model(X[:2]); torch.save(model.state_dict(), io.BytesIO())\n"
                                     "pickled = len(pickle.dumps(model))")
    assert result.success, out


def test_the_notebooks_torch_compile_settings_apply_on_every_rank(shell):
    # A rank's graph-break warning says to set torch._dynamo.config.capture_scalar_outputs = True:
    # set in the notebook, it must reach the ranks (it did not: they kept torch's defaults).
    import torch._dynamo.config
    import torch._inductor.config
    from torch.utils._config_module import _UNSET_SENTINEL
    run_cell(shell, SETUP.format(shuffle=False) + "import torch._dynamo\n"
                                                  "torch._dynamo.config.capture_scalar_outputs = True\n")
    read = ("out = model(X[:2])\n"
            "flags = [torch._dynamo.config.capture_scalar_outputs, torch._inductor.config.freezing]\n")
    try:
        dp_cell(shell, CPU2, read)
        assert shell.user_ns["flags"] == [True, False]
        with torch._inductor.config.patch(freezing=True):
            dp_cell(shell, CPU2, read)
        assert shell.user_ns["flags"] == [True, True]
        dp_cell(shell, CPU2, read)   # back at torch's default in the notebook: on the ranks too
        assert shell.user_ns["flags"] == [True, False]
    finally:
        torch._dynamo.config._config["capture_scalar_outputs"].user_override.set(_UNSET_SENTINEL)
    dp_cell(shell, CPU2, read)
    assert shell.user_ns["flags"] == [False, False]


# The "compiled optimizer" tutorial as written, and a compiled loss, in the notebook; the training loop through them
COMPILED_FUNCTIONS = """
@torch.compile
def lossf(a, b):
    return ((a - b) ** 2).mean()

@torch.compile(fullgraph=False)
def fn():
    opt.step()
"""


def through_compiled_functions(train: str) -> str:
    """``train`` calling COMPILED_FUNCTIONS' functions, binding ``graphs``: how many graphs the rank compiled."""
    return train.replace("((model(x) - y) ** 2).mean()", "lossf(model(x), y)").replace("opt.step()", "fn()") + (
        "import torch._dynamo.utils\ngraphs = torch._dynamo.utils.counters['stats']['unique_graphs']\n")


def test_functions_the_notebook_compiled_are_compiled_again_on_the_ranks(shell):
    # Refused before ("cannot pickle 'DynamoTLS' object"); now each rank compiles the plain function with
    # the notebook's options, and training equals the eager one.
    run_cell(shell, SETUP.format(shuffle=False) + COMPILED_FUNCTIONS)
    ns = shell.user_ns
    lossf, fn = ns["lossf"], ns["fn"]
    ref_model, _, _ = _reference(ns)
    dp_cell(shell, CPU2, through_compiled_functions(TRAIN))
    _assert_weights(ns, ref_model)
    assert ns["graphs"] >= 2, ns["graphs"]   # rank 0 compiled both (eagerly, nothing would be counted)
    assert ns["lossf"] is lossf and ns["fn"] is fn   # the notebook's compiled functions, still usable there
    assert float(lossf(torch.ones(2), torch.zeros(2))) == 1.0


def test_a_scripted_module_made_in_the_notebook_is_refused_with_what_to_do(shell):
    # The advice was "Create such objects inside the cell": a module made there trains no notebook weights.
    run_cell(shell, SETUP.format(shuffle=False) + "smodel = torch.jit.script(Net())\n")
    with pytest.raises(UsageError) as err:
        dp_cell(shell, CPU2, TRAIN.replace("((model(x) - y) ** 2).mean()", "((smodel(x) - y) ** 2).mean()"))
    says = "smodel is a RecursiveScriptModule: train the nn.Module it was made from"
    assert says in str(err.value) and "Create such objects" not in str(err.value), str(err.value)
