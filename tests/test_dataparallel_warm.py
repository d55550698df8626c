"""gpumagic.dataparallel.strategies.ddp_warm: when a rank may train the model it compiled in an earlier cell.

A model is shipped here as to a rank: cloudpickle, in this process, hands back the
same class object for a class it has seen, with fresh copies of its functions.
"""
from __future__ import annotations

import cloudpickle
import torch
from torch import nn

from gpumagic.dataparallel.strategies.ddp_warm import Adopted, WarmModels, _same, follow_kept

OPTIONS = (("gradient_as_bucket_view", True),), "fp32", "default", "cpu"


def _net_class(width: int = 4):
    class Net(nn.Module):   # a local class: not importable by name, so cloudpickle ships it by value
        def __init__(self):
            super().__init__()
            self.hidden = nn.Linear(3, width)
            self.out = nn.Linear(width, 1)

        def forward(self, x):
            return self.out(torch.tanh(self.hidden(x)))
    return Net


def _ship(obj):
    return cloudpickle.loads(cloudpickle.dumps(obj))


def _function(source: str, **names):
    ns = dict(names)
    exec(source, ns)
    return ns["f"]


def test_the_same_model_shipped_again_is_adopted_with_the_functions_it_was_compiled_with():
    model = _net_class()()
    first = _ship(model)
    forward = type(first).forward
    warm = WarmModels()
    warm.keep("model", first, first, OPTIONS)
    with torch.no_grad():
        model.hidden.weight.mul_(2)        # changed in the notebook between cells
        model.out.training = False
    again = _ship(model)
    assert type(again) is type(first) and type(again).forward is not forward   # what a rank sees
    found = warm.adopt("model", again, OPTIONS)
    assert isinstance(found, Adopted) and found.module is first and found.wrapper is first
    assert type(first).forward is forward                # compiled code hangs off this function
    assert torch.equal(first.hidden.weight, model.hidden.weight)   # the shipped weights, copied in
    assert first.out.training is False                   # and its plain attributes
    assert found.replaced[id(again.hidden.weight)] is first.hidden.weight
    assert found.replaced[id(again.out)] is first.out
    assert (again.hidden.weight.device, again.hidden.weight.data_ptr()) in found.copied


def test_a_model_that_differs_is_not_adopted_and_says_why():
    model = _net_class()()
    warm = WarmModels()
    kept = _ship(model)
    warm.keep("model", kept, kept, OPTIONS)
    assert warm.adopt("model", _ship(model), OPTIONS[:2] + ("reduce-overhead", "cpu")) == \
        "other --compile or DDP options"
    assert warm.adopt("model", _ship(model), OPTIONS) == "first cell"     # the mismatch let it go
    kept = _ship(model)
    warm.keep("model", kept, kept, OPTIONS)
    assert warm.adopt("model", _ship(_net_class()()), OPTIONS) == "Net was defined again"
    warm.keep("model", kept, kept, OPTIONS)
    model.out = nn.Linear(4, 2)
    assert warm.adopt("model", _ship(model), OPTIONS) == "its layers, shapes or dtypes changed"
    model = _net_class()()
    kept = _ship(model)
    warm.keep("model", kept, kept, OPTIONS)
    model.hidden = nn.Linear(3, 4).double()
    model.out = nn.Linear(4, 1).double()
    assert warm.adopt("model", _ship(model), OPTIONS) == "its layers, shapes or dtypes changed"


def test_a_layer_the_cell_replaced_in_the_kept_model_is_not_trained_again():
    model = _net_class()()
    kept = _ship(model)
    warm = WarmModels()
    warm.keep("model", kept, kept, OPTIONS)
    kept.out = nn.Linear(4, 1)      # DDP was built over the old layer's parameters
    assert warm.adopt("model", _ship(model), OPTIONS) == "the last cell replaced layers"


def test_retain_only_lets_go_of_models_the_cell_does_not_train():
    model = _net_class()()
    warm = WarmModels()
    warm.keep("a", model, model, OPTIONS)
    warm.keep("b", model, model, OPTIONS)
    warm.retain_only(["b"])
    assert list(warm.kept) == ["b"]


def test_functions_are_the_same_when_their_code_defaults_closures_and_globals_read_are():
    source = "def f(x, k=2):\n    return helper(x) * SCALE + k\n"
    helper = _function("def f(x):\n    return x + 1\n")
    same_helper = _function("def f(x):\n    return x + 1\n")
    other_helper = _function("def f(x):\n    return x + 2\n")
    base = _function(source, SCALE=1.0, helper=helper)
    assert _same(base, _function(source, SCALE=1.0, helper=same_helper))
    assert not _same(base, _function(source, SCALE=0.5, helper=helper))        # a global it reads
    assert not _same(base, _function(source, SCALE=1.0, helper=other_helper))  # a function it calls
    assert not _same(base, _function(source.replace("k=2", "k=3"), SCALE=1.0, helper=helper))
    assert not _same(base, _function(source.replace("+ k", "- k"), SCALE=1.0, helper=helper))
    assert _same(base, _function(source, SCALE=1.0, helper=helper, unrelated=object()))
    # names read inside nested code (a comprehension, a lambda) count too
    nested = "def f(xs):\n    return [g(x) for x in xs]\n"
    assert not _same(_function(nested, g=helper), _function(nested, g=other_helper))


def test_recursive_functions_compare_without_looping():
    source = "def f(n):\n    return 1 if n < 2 else n * f(n - 1)\n"
    a, b = _function(source), _function(source)
    assert _same(a, b)


def test_tensors_compare_by_value_and_other_objects_must_be_the_same_object():
    t = torch.zeros(2)
    assert _same(t, torch.zeros(2)) and not _same(t, torch.ones(2)) and not _same(t, torch.zeros(3))
    assert not _same(t, torch.zeros(2, dtype=torch.float64))
    assert not _same(nn.Linear(1, 1), nn.Linear(1, 1))
    assert _same({"a": (1, 2.0)}, {"a": (1, 2.0)}) and not _same({"a": 1}, {"a": 2})
    assert _same({1, 2}, {1, 2}) and not _same([1], (1,))


def test_what_refers_to_the_shipped_model_follows_the_kept_one():
    model = _net_class()()
    kept = _ship(model)
    warm = WarmModels()
    warm.keep("model", kept, kept, OPTIONS)

    class Averaged(nn.Module):   # as torch.optim.swa_utils.AveragedModel holds its model
        def __init__(self, module):
            super().__init__()
            self.module = module

    shipped = _ship(model)
    opt = torch.optim.SGD(shipped.parameters(), lr=0.1, momentum=0.9)
    opt.state[shipped.out.bias]["momentum_buffer"] = torch.ones(1)
    ns = {"model": shipped, "head": shipped.out, "ema": Averaged(shipped), "models": [shipped],
          "pair": (shipped, 1), "by_name": {"m": shipped}, "opt": opt}
    found = warm.adopt("model", shipped, OPTIONS)
    assert isinstance(found, Adopted)
    ns["model"] = found.wrapper
    follow_kept(ns, found.replaced)
    assert ns["head"] is kept.out and ns["ema"].module is kept
    assert ns["models"][0] is kept and ns["pair"] == (kept, 1) and ns["by_name"]["m"] is kept
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in kept.parameters()]
    assert torch.equal(opt.state[kept.out.bias]["momentum_buffer"], torch.ones(1))


def test_objects_the_forward_reads_are_alike_when_their_attributes_are():
    """A config namespace or an activation module is shipped anew each cell: the same when equal."""
    import types
    cfg = types.SimpleNamespace(scale=2.0, mode="tanh")
    act = nn.GELU(approximate="tanh")
    assert _same(_ship(cfg), _ship(cfg)) and _same(_ship(act), _ship(act))
    assert not _same(_ship(cfg), _ship(types.SimpleNamespace(scale=3.0, mode="tanh")))
    assert not _same(_ship(act), _ship(nn.GELU()))
    f = _function("def f(x):\n    return act(x) * cfg.scale\n", act=act, cfg=cfg)
    g = _function("def f(x):\n    return act(x) * cfg.scale\n", act=_ship(act), cfg=_ship(cfg))
    assert _same(f, g)
    g.__globals__["cfg"] = types.SimpleNamespace(scale=3.0, mode="tanh")
    assert not _same(f, g)


def test_a_model_let_go_says_why_in_the_next_cells_note():
    model = _net_class()()
    warm = WarmModels()
    kept = _ship(model)
    warm.keep("model", kept, kept, OPTIONS)
    after = WarmModels(warm.let_go("the last cell failed"))
    assert after.adopt("model", _ship(model), OPTIONS) == "the last cell failed"
    assert after.adopt("model", _ship(model), OPTIONS) == "first cell"      # said once


def test_a_model_a_cell_did_not_train_says_so_when_it_is_trained_again_not_first_cell():
    # `model` compiled, then a cell on `bad` only (which failed): the next cell on `model` is not its first.
    model = _net_class()()
    warm = WarmModels()
    kept = _ship(model)
    warm.keep("model", kept, kept, OPTIONS)
    warm.retain_only(["bad"])
    after = WarmModels(warm.let_go("the last cell failed"))
    assert after.adopt("model", _ship(model), OPTIONS) == "a cell in between did not train it, which let it go"


def test_partials_and_bound_methods_the_forward_reads_compare_by_what_they_hold():
    """``act = partial(F.leaky_relu, negative_slope=0.1)`` and ``g = Scaler(10.0).apply`` are shipped anew each
    cell; with other arguments, keywords or another object they are different, whatever their empty ``__dict__``."""
    import functools

    import torch.nn.functional as F

    class Scaler:   # a local class: shipped by value, as a notebook class is
        def __init__(self, factor):
            self.factor = factor

        def apply(self, x):
            return x * self.factor

    leaky = functools.partial(F.leaky_relu, negative_slope=0.1)
    assert _same(_ship(leaky), _ship(leaky))   # the same partial shipped again: nothing to recompile
    assert not _same(_ship(leaky), _ship(functools.partial(F.leaky_relu, negative_slope=0.2)))
    assert not _same(_ship(leaky), _ship(functools.partial(F.elu, negative_slope=0.1)))
    assert not _same(_ship(functools.partial(torch.clamp, min=0.0)), _ship(functools.partial(torch.clamp, 1.0)))
    scaler = Scaler(10.0)
    assert _same(_ship(scaler.apply), _ship(scaler.apply))
    assert not _same(_ship(scaler.apply), _ship(Scaler(20.0).apply))
    assert not _same(_ship([1].append), _ship([2].append))   # a builtin bound to other data
    # read as globals of the forward's code, as a notebook's forward reads them
    source = "def f(x):\n    return g(act(x))\n"
    f = _function(source, act=_ship(leaky), g=_ship(scaler.apply))
    assert _same(f, _function(source, act=_ship(leaky), g=_ship(scaler.apply)))
    assert not _same(f, _function(source, act=functools.partial(F.leaky_relu, negative_slope=0.2),
                                  g=_ship(scaler.apply)))
    assert not _same(f, _function(source, act=_ship(leaky), g=Scaler(20.0).apply))


def test_a_partial_held_as_an_attribute_that_changed_is_not_adopted():
    import functools

    import torch.nn.functional as F
    Net = _net_class()

    class Leaky(Net):
        def __init__(self, slope):
            super().__init__()
            self.act = functools.partial(F.leaky_relu, negative_slope=slope)

        def forward(self, x):
            return self.out(self.act(self.hidden(x)))

    kept = _ship(Leaky(0.1))
    warm = WarmModels()
    warm.keep("model", kept, kept, OPTIONS)
    assert warm.adopt("model", _ship(Leaky(0.2)), OPTIONS) == "Leaky.act changed"
    kept = _ship(Leaky(0.1))
    warm.keep("model", kept, kept, OPTIONS)
    assert isinstance(warm.adopt("model", _ship(Leaky(0.1)), OPTIONS), Adopted)   # unchanged: reused


def test_objects_whose_state_is_not_all_in_their_dict_are_different_when_in_doubt():
    """A subclass of a C type keeps state outside ``__dict__`` (a dict subclass's items): never
    judged alike by its ``__dict__`` alone."""
    class Table(dict):
        pass

    class Slots:
        __slots__ = ("scale",)

        def __init__(self, scale):
            self.scale = scale

    assert not _same(_ship(Table(a=1)), _ship(Table(a=2)))
    assert not _same(_ship(Slots(1.0)), _ship(Slots(2.0)))
    assert _same(_ship(Slots(1.0)), _ship(Slots(1.0)))
