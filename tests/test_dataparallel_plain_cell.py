"""%%dataparallel cells that must leave the notebook as the same plain cell would (CPU, gloo, 2 ranks):
gradients accumulated across cells, items a notebook function sets on a notebook tensor or array, an
fsdp cell's optimizer state, ``torch.jit.script`` in the cell, and models held two levels deep in a
notebook object."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gpumagic.errors import WorkerError
from tests.conftest import run_cell
from tests.dataparallel_helpers import REGRESSION, dp_cell, last_result, notebook_from, trained_in_one_process

CPU2 = "--nprocs 2"

SETUP = REGRESSION

ACCUMULATE = """
for x, y in loader:
    ((model(x) - y) ** 2).mean().backward()
"""


def _setup(shell, source=SETUP):
    return notebook_from(shell, source)


def _close(a, b, tol=1e-5):
    return all(torch.allclose(p, q, atol=tol, rtol=0) for p, q in zip(a.state_dict().values(),
                                                                        b.state_dict().values()))


def _grads(module):
    return [p.grad for p in module.parameters()]


def test_gradients_accumulate_across_cells_as_in_one_process(shell):
    ns = _setup(shell)
    ref = copy.deepcopy(ns["model"])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):                       # two cells of backward() without zero_grad()
        for x, y in ns["loader"]:
            ((ref(x) - y) ** 2).mean().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp_cell(shell, CPU2, ACCUMULATE)
    # (a pass that runs backward() without a step accumulates: no "evaluation without no_grad" warning)
    assert not [w for w in caught if "no optimizer step followed" in str(w.message)]
    first = [g.clone() for g in _grads(ns["model"])]
    dp_cell(shell, CPU2, ACCUMULATE + "opt.step()\n")
    # the second cell's ranks started from the first cell's gradients: twice the first cell's
    for g, r, f in zip(_grads(ns["model"]), _grads(ref), first):
        assert torch.allclose(g, r, atol=1e-5, rtol=0)
        assert torch.allclose(g, 2 * f, atol=1e-5, rtol=0)
    ref_opt.step()
    assert _close(ns["model"], ref)
    # zero_grad() in a later cell still starts afresh
    dp_cell(shell, CPU2, "opt.zero_grad()\n" + ACCUMULATE)
    ref_opt.zero_grad()
    for x, y in ns["loader"]:
        ((ref(x) - y) ** 2).mean().backward()
    for g, r in zip(_grads(ns["model"]), _grads(ref)):
        assert torch.allclose(g, r, atol=1e-5, rtol=0)


def test_items_a_notebook_function_sets_come_back(shell):
    ns = _setup(shell, SETUP + """
preds = torch.zeros(32)
seen = np.zeros(4, dtype=np.int64)
untouched = torch.arange(5.0)
def fill(i, x):
    preds[i * 8:(i + 1) * 8] = model(x).squeeze(1)
    seen[i] += 1
""")
    preds, seen = ns["preds"], ns["seen"]
    dp_cell(shell, CPU2, """
        with torch.no_grad():
            for i, (x, y) in enumerate(loader):
                fill(i, x)
        """)
    with torch.no_grad():
        expected = ns["model"](ns["X"]).squeeze(1)
    assert ns["preds"] is preds and ns["seen"] is seen          # filled in place, as a plain cell does
    assert torch.allclose(preds, expected, atol=1e-6, rtol=0)
    assert seen.tolist() == [1, 1, 1, 1]
    assert torch.equal(ns["untouched"], torch.arange(5.0))
    assert "preds" in last_result().values and "untouched" not in last_result().values


def test_a_scripted_model_is_the_users_module_and_comes_back(shell):
    ns = _setup(shell)
    ref = trained_in_one_process(ns)
    dp_cell(shell, CPU2, """
        for x, y in loader:
            opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
        scripted = torch.jit.script(model)
        kind = type(scripted).__name__
        agree = torch.allclose(scripted(X), model(X))
        """)
    assert ns["kind"] == "RecursiveScriptModule" and ns["agree"] is True
    assert _close(ns["model"], ref)
    scripted = ns["scripted"]
    assert isinstance(scripted, torch.jit.ScriptModule)
    # as after a plain cell: the notebook's model scripted, sharing its parameters
    assert scripted[0].weight is ns["model"][0].weight
    assert torch.allclose(scripted(ns["X"]), ns["model"](ns["X"]))


def test_training_a_scripted_model_is_refused_with_what_to_do(shell):
    ns = _setup(shell)
    before = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    with pytest.raises(WorkerError) as err:
        dp_cell(shell, CPU2, """
            scripted = torch.jit.script(model)
            for x, y in loader:
                opt.zero_grad(); ((scripted(x) - y) ** 2).mean().backward(); opt.step()
            """)
    assert err.value.exc_type == "UnaveragedParameters"
    assert "torch.jit.script" in err.value.message and "model(...)" in err.value.message
    assert all(torch.equal(v, before[k]) for k, v in ns["model"].state_dict().items())


NESTED = SETUP + """
class Parts:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt
class Deep:                              # the model two attributes down
    def __init__(self, parts, loader):
        self.parts, self.loader = parts, loader
    def epoch(self):
        for x, y in self.loader:
            self.parts.opt.zero_grad(); ((self.parts.model(x) - y) ** 2).mean().backward(); self.parts.opt.step()
class Nets:                              # the model in a dict attribute
    def __init__(self, model, opt):
        self.nets, self.opt = {"g": model}, opt
    def epoch(self, data):
        for x, y in data:
            self.opt.zero_grad(); ((self.nets["g"](x) - y) ** 2).mean().backward(); self.opt.step()
class Listed:                            # the model in a list attribute
    def __init__(self, model, opt):
        self.models, self.opt = [model], opt
    def epoch(self, data):
        for x, y in data:
            self.opt.zero_grad(); ((self.models[0](x) - y) ** 2).mean().backward(); self.opt.step()
deep = Deep(Parts(model, opt), loader)
nets = Nets(model, opt)
listed = Listed(model, opt)
"""


def _one_epoch(ns, model=None):
    model = model if model is not None else copy.deepcopy(ns["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in ns["loader"]:
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return model


@pytest.mark.parametrize("cell", ["deep.epoch()\n", "nets.epoch(loader)\n", "listed.epoch(loader)\n"])
def test_a_model_two_levels_down_in_a_notebook_object_trains_averaged(shell, cell):
    ns = _setup(shell, NESTED)
    reference = _one_epoch(ns)
    dp_cell(shell, CPU2, cell)
    assert last_result().modules == ["model"]
    assert _close(ns["model"], reference, tol=1e-6)
    # the notebook's objects hold the notebook's model again, not a wrapper
    assert ns["deep"].parts.model is ns["model"] and ns["nets"].nets["g"] is ns["model"]
    assert ns["listed"].models == [ns["model"]] and ns["listed"].models[0] is ns["model"]


FSDP2 = "--strategy fsdp --devices cpu --nprocs 2"


def test_an_fsdp_cells_optimizer_state_comes_back_private(shell):
    ns = _setup(shell, SETUP.replace("torch.optim.SGD(model.parameters(), lr=0.1)",
                                     "torch.optim.Adam(model.parameters(), lr=0.01)"))
    ref = copy.deepcopy(ns["model"])
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    train = "for x, y in loader:\n    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()\n"
    for _ in range(3):
        for x, y in ns["loader"]:
            ref_opt.zero_grad()
            ((ref(x) - y) ** 2).mean().backward()
            ref_opt.step()
    for _ in range(2):   # the second cell continues from the ranks' kept shards
        dp_cell(shell, FSDP2, train)
        moments = [v for st in ns["opt"].state.values() for v in st.values() if v.dim()]
        assert moments and not any(v.is_shared() for v in moments)
    # state the notebook shares itself (for %%sharedtrain's one shared state) stays shared
    run_cell(shell, "for st in opt.state.values():\n    st['exp_avg'].share_memory_()")
    dp_cell(shell, FSDP2, train)
    assert all(st["exp_avg"].is_shared() and not st["exp_avg_sq"].is_shared() for st in ns["opt"].state.values())
    assert _close(ns["model"], ref)
    for st, rst in zip(ns["opt"].state.values(), ref_opt.state.values()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(st[k], rst[k], atol=1e-6, rtol=0)


def test_fsdp_and_launch_cells_say_the_notebooks_gradients_are_not_carried(capsys):
    from gpumagic.dataparallel.strategies.ddp_grads import not_carried, notebook_grads
    model = torch.nn.Linear(3, 1)
    assert notebook_grads({"model": model}) == {}           # no gradients: nothing to carry
    assert not_carried({"model": model}, "why") == {} and capsys.readouterr().err == ""   # nothing said
    model(torch.ones(2, 3)).sum().backward()
    carried = notebook_grads({"model": model})
    assert carried["model"]["weight"] is model.weight.grad
    assert torch.equal(carried["model"]["bias"], torch.tensor([2.0]))
    capsys.readouterr()
    for how in ("--strategy fsdp shards them", "in launch mode the cell's framework owns them"):
        assert not_carried({"model": model}, how) == {}
        said = capsys.readouterr()
        text = said.out + said.err
        assert "the gradients on the parameters of model, left by an earlier cell, are not carried" in text


def test_a_rank_starts_from_the_notebooks_gradients_and_its_store_lets_them_go():
    from gpumagic.dataparallel.strategies.ddp_grads import start_from
    from gpumagic.procs.tensor_cache import TensorStore
    model = torch.nn.Linear(512, 512)
    grad = torch.full((512, 512), 0.5)                   # 1 MiB: large enough to be kept by key
    data = torch.randn(512, 512)
    store = TensorStore()
    keys = store.rebuild([grad, data])
    assert len(keys) == 2
    left = start_from({"model": model}, {"model": {"weight": grad}}, [grad, data], store)
    assert model.weight.grad is grad and model.bias.grad is None
    assert left == [data] and len(store) == 1            # the data stays kept, the gradient is the model's now
    model(torch.ones(1, 512)).sum().backward()           # a plain process's backward adds to it
    assert torch.equal(model.weight.grad, torch.full((512, 512), 1.5))


def test_a_compile_cell_scripts_and_traces_the_users_module(shell):
    """--compile compiles the ranks' ``forward`` in place: ``torch.jit.trace(model, X)`` raised "using FX to
    torch.jit.trace a dynamo-optimized function" there. Both read the module's own forward now."""
    ns = _setup(shell)
    reference = _one_epoch(ns)
    dp_cell(shell, CPU2 + " --compile", """
        for x, y in loader:
            opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()
        scripted = torch.jit.script(model)
        traced = torch.jit.trace(model, X)
        agree = [torch.allclose(m(X), model(X), atol=1e-6) for m in (scripted, traced)]
        still_compiled = hasattr(model.module.forward, "_gpumagic_forward")
        """)
    assert ns["agree"] == [True, True] and ns["still_compiled"] is True
    assert _close(ns["model"], reference)
    assert torch.allclose(ns["scripted"](ns["X"]), reference(ns["X"]), atol=1e-5, rtol=0)
    assert any(n.startswith("traced (torch.jit.trace(model") for n in last_result().not_returned)


def test_a_global_bound_by_a_function_of_the_cell_comes_back(shell):
    # torch's DDP tutorial shape: a main() the cell defines and calls, setting a notebook global.
    _setup(shell)
    dp_cell(shell, CPU2, """
        import torch.distributed as dist
        def main():
            global world, steps
            world = dist.get_world_size()
            steps = 0
            for x, y in loader:
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                steps += 1
        main()
        """)
    # every rank steps once per global batch (each takes its half of the batch), as one process does
    assert (shell.user_ns["world"], shell.user_ns["steps"]) == (2, 4)
