"""--vars runs none of the notebook's code, and a variable it cannot read is named, not dropped."""
from __future__ import annotations

import torch

from gpumagic.memory import variables


def rows(ns, **kw):
    return {r.name: r.nbytes for r in variables.variable_memory(ns, **kw).rows}


def test_overridden_module_and_optimizer_api_is_not_run():
    ran = []

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(10, 10)
            self.register_buffer("mask", torch.ones(25))

        def parameters(self, recurse=True):
            ran.append("parameters")
            return super().parameters(recurse)

        def modules(self):
            ran.append("modules")
            return super().modules()

    class Wrapped(torch.optim.Optimizer):   # a wrapper (as accelerate's) whose state is a property
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def state(self):
            ran.append("state")
            return self.optimizer.state

        @property
        def param_groups(self):
            ran.append("param_groups")
            return self.optimizer.param_groups

    net = Net()
    opt = torch.optim.Adam(net.parameters())
    net.body(torch.ones(1, 10)).sum().backward()
    opt.step()
    params, state = 440, 2 * 440 + 2 * 4
    ran.clear()                             # Adam(net.parameters()) above was the test's own call
    rep = variables.variable_memory({"net": net, "wrapped": Wrapped(opt)})
    assert rep["net"].parts == {"params": params, "buffers": 100, "grads": params}
    assert rep["wrapped"].parts == {"state": state}     # the wrapped optimizer's state, found in its __dict__
    assert ran == []


def test_a_module_whose_init_skipped_module_init_is_still_counted():
    class Half(torch.nn.Module):
        def __init__(self):
            self.cache = torch.zeros(100)   # super().__init__() forgotten: parameters() raises

    half = Half()
    assert rows({"half": half, "x": torch.zeros(5)}) == {"half": 400, "x": 20}


def test_a_tensor_subclass_is_read_without_its_torch_function():
    ran = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            ran.append(func)
            raise RuntimeError("a notebook's tensor subclass that fails outside its own code")

    logged = torch.zeros(64).as_subclass(Logged)
    assert rows({"logged": logged}) == {"logged": 256}
    assert ran == []


def test_a_variable_that_cannot_be_read_is_named_in_a_note(monkeypatch):
    class Odd:
        pass

    walk = variables.Collector.walk

    def failing(self, obj, depth=0, part="tensors"):
        if type(obj) is Odd:
            raise RuntimeError("unreadable")
        return walk(self, obj, depth, part)
    monkeypatch.setattr(variables.Collector, "walk", failing)
    rep = variables.variable_memory({"odd": Odd(), "x": torch.zeros(5)})
    assert [r.name for r in rep.rows] == ["x"]
    assert rep.notes == ["not read, so not listed: odd (RuntimeError) (reading them failed; the log of "
                         "gpumagic.memory.variables says why)."]
    assert rep.as_dict()["notes"] == rep.notes


def test_scripted_traced_and_compiled_modules_keep_their_parameters_counted():
    # TorchScript keeps a module's registries in C++: its __dict__ has wrappers, or nothing.
    body = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.BatchNorm1d(10))
    scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.BatchNorm1d(10)))
    traced = torch.jit.trace(torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2)),
                             torch.ones(1, 10))
    compiled = torch.compile(body)
    rep = variables.variable_memory({"scripted": scripted, "traced": traced, "compiled": compiled})
    # Linear: 440 bytes; BatchNorm1d: weight and bias 80, running mean and var 80, the batch count 8
    assert rep["scripted"].parts == {"params": 440 + 80, "buffers": 80 + 8}
    assert rep["traced"].parts == {"params": 440 + 88}
    assert rep["compiled"].parts == {"params": 440 + 80, "buffers": 80 + 8}
