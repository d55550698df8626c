"""--vars and what callables keep alive: partials, closures, bound methods; shared storage named."""
from __future__ import annotations

import functools

import torch

from gpumagic.memory import variables


def rows(ns, **kw):
    return {r.name: r.nbytes for r in variables.variable_memory(ns, **kw).rows}


def train(x, model=None, lr=0.1):
    return model


def test_a_partial_a_closure_and_a_bound_method_count_what_they_keep_alive():
    model = torch.nn.Linear(100, 100)           # 40,400 bytes of parameters
    params = 100 * 100 * 4 + 100 * 4

    def make_loss():
        target = torch.zeros(1000)              # 4,000 bytes only the closure holds
        return lambda out: (out - target).sum()

    class Runner:
        def __init__(self):
            self.cache = torch.zeros(300)       # 1,200 bytes

        def run(self):
            return self.cache

    def scaled(x, weight=torch.ones(50), *, bias=torch.ones(25)):  # noqa: B008 - defaults are kept alive too
        return x * weight + bias

    ns = {
        "step": functools.partial(train, model=model),
        "first": functools.partial(train, torch.zeros(10)),
        "loss": make_loss(),
        "run": Runner().run,
        "scaled": scaled,
        "add": torch.zeros(64).add_,            # a builtin method: its tensor
    }
    assert rows(ns) == {"step": params, "first": 40, "loss": 4000, "run": 1200, "scaled": 300, "add": 256}
    assert variables.variable_memory(ns)["step"].parts == {"params": params}


def test_shared_storage_counts_once_and_names_who_else_holds_it():
    model = torch.nn.Linear(100, 100)
    params = 100 * 100 * 4 + 100 * 4
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 100)).sum().backward()
    opt.step()
    state = 2 * params + 2 * 4                  # exp_avg, exp_avg_sq and two step counters
    ns = {"model": model, "opt": opt, "step": functools.partial(train, model=model),
          "forward": model.forward, "update": opt.step}
    rep = variables.variable_memory(ns)
    assert rows(ns) == {"model": 2 * params, "step": 2 * params, "forward": 2 * params,
                        "opt": state, "update": state}
    assert rep["model"].shared == 2 * params and rep["model"].shared_with == ["forward", "step"]
    assert rep["opt"].parts == {"state": state} and rep["opt"].shared_with == ["update"]
    assert rep.totals == {"cpu": 2 * params + state}            # each storage once
    line = next(line for line in rep.text().splitlines() if line.startswith("model "))
    assert line.endswith("78.9 KiB with forward, step")
    assert rep.as_dict()["variables"][0]["shared_with"]
    assert "a function or partial over a variable" in rep.notes[0]


def test_a_closure_over_another_variable_is_shared_not_double_counted():
    weights = torch.zeros(1024)

    def make():
        w = weights
        return lambda: w.sum()

    rep = variables.variable_memory({"weights": weights, "total": make()})
    assert rows({"weights": weights, "total": make()}) == {"weights": 4096, "total": 4096}
    assert rep["total"].shared_with == ["weights"] and rep.totals == {"cpu": 4096}


def test_globals_and_unbound_cells_are_not_a_functions_memory():
    ns: dict = {}
    exec("import torch\nbig = torch.zeros(1000)\ndef uses_global():\n    return big.sum()", ns)
    assert rows(ns) == {"big": 4000}            # its globals are the notebook's, listed by name

    def unbound():
        def inner():
            return value
        if False:
            value = torch.zeros(5)              # makes `value` a closure cell, never filled
        return inner
    assert unbound().__closure__ and rows({"f": unbound()}) == {}


def test_reading_a_partial_subclass_runs_none_of_its_code():
    ran = []

    class Loud(functools.partial):
        def __getattribute__(self, name):
            ran.append(name)
            return super().__getattribute__(name)

    p = Loud(train, torch.zeros(10), model=torch.zeros(20))
    p.extra = torch.zeros(5)                    # a partial's own attributes count too
    ran.clear()
    assert rows({"p": p}) == {"p": 140}
    assert ran == []


def test_a_class_whose_metaclass_hash_raises_is_still_read():
    class Meta(type):
        def __hash__(cls):
            raise RuntimeError("unhashable class")

    class Odd(metaclass=Meta):
        pass

    odd = Odd()
    odd.t = torch.zeros(3)
    assert rows({"odd": odd}) == {"odd": 12}
