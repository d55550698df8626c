"""Which variables hold memory (--vars) and freeing it (--free), as plain functions."""
from __future__ import annotations

import torch

from gpumagic.memory import free, variables

MiB = 2**20


# --------------------------------------------------------------------------- --vars

def test_tensor_sizes_are_exact():
    ns = {"x": torch.zeros(1000, 3, dtype=torch.float64), "small": torch.ones(7, dtype=torch.int16),
          "n": 3, "s": "text"}
    rep = variables.variable_memory(ns)
    assert rep["x", "cpu"].nbytes == 24_000
    assert rep["small"].nbytes == 14
    assert [r.name for r in rep.rows] == ["x", "small"]
    assert rep.totals == {"cpu": 24_014}


def test_views_and_aliases_count_their_storage_once():
    base = torch.zeros(1000)
    ns = {"base": base, "window": base[10:20], "grid": base.view(10, 100), "alias": base}
    rep = variables.variable_memory(ns)
    # A view keeps its whole storage alive.
    assert {r.name: r.nbytes for r in rep.rows} == {"base": 4000, "window": 4000, "grid": 4000, "alias": 4000}
    assert all(r.shared == 4000 for r in rep.rows)
    assert rep.totals == {"cpu": 4000}


def test_module_params_buffers_and_grads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.BatchNorm1d(20), torch.nn.Linear(20, 5))
    model(torch.randn(4, 10)).sum().backward()
    rep = variables.variable_memory({"model": model})
    row = rep["model"]
    params = (10 * 20 + 20 + 20 + 20 + 20 * 5 + 5) * 4   # weights, biases, BatchNorm affine
    buffers = (20 + 20) * 4 + 8                          # running mean/var, num_batches_tracked
    assert row.parts == {"params": params, "buffers": buffers, "grads": params}
    assert row.nbytes == 2 * params + buffers
    assert row.type == "Sequential"


def test_tied_weights_count_once():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)
            self.out = torch.nn.Linear(8, 50, bias=False)
            self.out.weight = self.emb.weight
    rep = variables.variable_memory({"lm": Tied()})
    assert rep["lm"].parts == {"params": 50 * 8 * 4}


def test_adam_state_is_the_optimizers_memory():
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    rep = variables.variable_memory({"model": model, "opt": opt})
    param_bytes = (16 * 4 + 4) * 4
    # exp_avg and exp_avg_sq per parameter, plus a float32 step counter each.
    assert rep["opt"].parts == {"state": 2 * param_bytes + 2 * 4}
    assert rep["model"].nbytes == 2 * param_bytes  # params and grads
    assert rep.totals["cpu"] == 4 * param_bytes + 8
    assert [r.name for r in rep.rows] == ["opt", "model"]


def test_nested_containers_bounded_and_cycle_safe():
    t1, t2, t3 = torch.ones(100), torch.ones(200, dtype=torch.float64), torch.ones(3, 3)
    loop = [t1]
    loop.append(loop)
    deep = torch.ones(5000)
    too_deep = [[[[[[deep]]]]]]
    ns = {"data": {"train": [t1, (t2, {"deep": t3})], "n": 3}, "loop": loop, "too_deep": too_deep,
          "plain": [1, 2, "x"]}
    rep = variables.variable_memory(ns, max_depth=4)
    assert rep["data"].nbytes == 400 + 1600 + 36
    assert rep["loop"].nbytes == 400
    assert "too_deep" not in {r.name for r in rep.rows}
    assert variables.variable_memory(ns, max_depth=8)["too_deep"].nbytes == 20_000
    assert rep.totals == {"cpu": 400 + 1600 + 36}  # t1 held by two variables, counted once


def test_meta_sparse_hidden_and_sorting():
    dense = torch.eye(50)
    ns = {"meta": torch.empty(10**6, device="meta"),
          "sparse": dense.to_sparse(),           # 50 values (float32) and 2x50 int64 indices
          "big": torch.ones(10_000), "mid": torch.ones(1000), "_private": torch.ones(10**5),
          "Out": {1: torch.ones(10**5)}}
    rep = variables.variable_memory(ns, hidden={"Out"})
    assert [r.name for r in rep.rows] == ["big", "mid", "sparse"]
    assert rep["sparse"].nbytes == 50 * 4 + 2 * 50 * 8
    sizes = [r.nbytes for r in rep.rows]
    assert sizes == sorted(sizes, reverse=True)


def test_device_filter_and_no_torch_objects():
    rep = variables.variable_memory({"x": torch.ones(10)}, device="cuda:0")
    assert rep.rows == [] and rep.totals == {}
    assert "No variable holds tensor memory" in rep.text()


# --------------------------------------------------------------------------- --free

def test_free_collects_cycles_and_reports_cpu_memory():
    def make_garbage():
        cycle = [torch.ones(64 * MiB // 4)]  # 64 MiB, pages touched
        cycle.append(cycle)
    import gc
    gc.disable()   # the cycle must still be there when free_memory collects: no automatic collection first
    try:
        make_garbage()
        rep = free.free_memory()
    finally:
        gc.enable()
    assert rep.collected >= 1
    cpu = rep["cpu"]
    assert cpu.freed == cpu.before - cpu.after
    assert cpu.freed > 48 * MiB
    assert "freed" in rep.text() and "not initialised CUDA" in rep.text()


def test_objects_attributes_count_and_the_output_history_is_noted():
    import argparse
    import math

    class Holder:                                    # a notebook class keeping a tensor
        def __init__(self):
            self.w = torch.zeros(1000)
            self.name = "h"

    ns = {"h": Holder(), "cfg": argparse.Namespace(table=torch.ones(250, dtype=torch.float64)),
          "math": math, "Holder": Holder, "fn": test_tensor_sizes_are_exact}
    rep = variables.variable_memory(ns, history={3: torch.zeros(500)})
    assert {r.name: r.nbytes for r in rep.rows} == {"h": 4000, "cfg": 2000}   # modules, classes, functions: none
    assert rep.totals == {"cpu": 6000}                                         # the history is no variable
    assert any("the output history (Out[...]) still holds tensors: 2.0 KiB on cpu" in n for n in rep.notes)
    empty = variables.variable_memory({}, history={3: torch.zeros(500)})
    assert "No variable holds tensor memory." in empty.text() and "Out[...]" in empty.text()
