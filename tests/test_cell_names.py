"""Which names a cell reads, and which notebook functions it reaches (gpumagic.cell.names)."""
from __future__ import annotations

import ast

from gpumagic.cell.names import (
    attributes_assigned,
    free_reads,
    items_assigned,
    names_assigned,
    names_deleted,
    notebook_names,
    used_names,
)


def test_the_shells_names_are_not_the_users_unless_the_user_bound_them_anew():
    shell_out, shell_exit = {}, object()
    hidden = {"Out": shell_out, "In": [], "exit": shell_exit}
    ns = {**hidden, "_": 5, "_i3": "x", "_12": 1, "model": 1, "loss": 2}
    assert notebook_names(["Out", "In", "exit", "_", "_i3", "_12", "model", "absent"], ns, hidden) == ["model"]
    ns["Out"] = tuple   # ``Out = namedtuple("Out", ...)`` in a notebook cell: the user's now, and read by the cell
    ns["exit"] = 3
    assert notebook_names(["Out", "In", "exit", "loss"], ns, hidden) == ["Out", "exit", "loss"]


def test_used_names_follow_notebook_functions():
    ns = {"__name__": "__main__"}
    exec("def step():\n    return model(x)\nmodel = 1\nx = 2\n", ns)
    assert used_names(ast.parse("step()"), ns) == ["step", "model", "x"]


def test_used_names_follow_decorated_functions_and_not_attribute_names():
    # opt.step() in train_step made a notebook value called step count as read (a compiled function that
    # cannot travel: the cell was refused); @torch.compile's wrapper hid the function from the search.
    import functools
    ns = {"__name__": "__main__"}
    exec("def train_step(x):\n    opt.step()\n    return model(x)\n"
         "def evaluate():\n    return model(test_x)\n"
         "model = opt = test_x = 1\nstep = train_step\n", ns)
    ns["evaluate_wrapped"] = functools.wraps(ns["evaluate"])(lambda *a: None)   # as @torch.no_grad() wraps
    assert used_names(ast.parse("train_step(1)"), ns) == ["train_step", "opt", "model"]
    assert used_names(ast.parse("evaluate_wrapped()"), ns) == ["evaluate_wrapped", "model", "test_x"]



def test_used_names_follow_notebook_decorators_decorated_methods_and_wrapper_loops():
    # A notebook decorator's wrapper reads the function through its closure, not a global; a method under
    # @torch.no_grad() or a property is no plain function of the class: their globals were not shipped.
    import types
    ns = {"__name__": "__main__"}
    exec("import functools\n"
         "def timed(fn):\n    @functools.wraps(fn)\n    def wrapper(*a):\n        return fn(*a)\n    return wrapper\n"
         "def plain(fn):\n    def inner(*a):\n        return fn(*a)\n    return inner\n"
         "@timed\ndef step(x):\n    return model(x)\n"
         "@plain\ndef load():\n    return loader\n"
         "def no_grad(fn):\n    return functools.wraps(fn)(lambda *a: None)\n"
         "class Runner:\n    @no_grad\n    def evaluate(self):\n        return val_x\n"
         "    @property\n    def conf(self):\n        return cfg\n"
         "model = loader = val_x = cfg = 1\n", ns)
    assert used_names(ast.parse("step(1)"), ns) == ["step", "model"]
    assert used_names(ast.parse("load()"), ns) == ["load", "loader"]
    assert used_names(ast.parse("Runner()"), ns) == ["Runner", "val_x", "cfg"]
    # A library function whose __wrapped__ leads back to itself: the search ends.
    first = types.FunctionType((lambda: 0).__code__, {})
    second = types.FunctionType(first.__code__, {})
    first.__wrapped__, second.__wrapped__ = second, first
    ns["looped"] = first
    assert used_names(ast.parse("looped()"), ns) == ["looped"]


def test_free_reads_skip_names_the_cell_binds_first():
    src = ("it = iter(loader)\n"
           "for i in range(n):\n"
           "    if i == 2:\n"
           "        t0 = clock()\n"
           "    x, y = next(it)\n"
           "    out = model(x)\n"
           "    seen.append(t0)\n"
           "total += 1\n")
    assert free_reads(ast.parse(src)) == ["iter", "loader", "range", "n", "clock", "next", "model", "seen",
                                          "t0", "total"]


def test_names_assigned_reach_past_a_lambda_and_leave_out_nested_scopes():
    src = ("for x in loader:\n"
           "    key = lambda b: b[0]\n"        # a nested scope in the loop: what follows it still counts
           "    loss = key(x)\n"
           "total = sum(v for v in range(3))\n"  # v is the generator's own
           "if ready:\n"
           "    def evaluate(m):\n"
           "        inner = 1\n"
           "import os.path\n"
           "from math import cos as c\n")
    assert names_assigned(ast.parse(src)) == ["x", "key", "loss", "total", "evaluate", "os", "c"]


def test_a_deleted_name_is_read_from_the_notebook_and_named_as_deleted():
    tree = ast.parse("del tmp, d[k]\nnew = 1\ndel new\nif flag:\n    del other\ndef f():\n    del local\n")
    assert names_deleted(tree) == ["tmp", "new", "other"]
    assert free_reads(tree) == ["tmp", "d", "k", "flag", "other"]   # new was bound by the cell first


def test_attributes_assigned_through_a_chain_name_the_object_they_land_on():
    tree = ast.parse("args.epochs = 2\ncfg.optim.lr = 0.1\ncfg.optim.steps += 1\nrows[0].x = 1\n")
    assert attributes_assigned(tree) == {"args": ["epochs"], "cfg.optim": ["lr", "steps"]}


def test_items_assigned_name_the_notebook_object_reached_through_an_item():
    tree = ast.parse("held['n'] = 2\ncfgs[0].lr = 0.5\ndel cache[k]\npreds[i:j] += out\nargs.lr = 1\n"
                     "x = d['a']\nobj.parts[1].w = 3\n")
    assert items_assigned(tree) == {"held": ["held['n']"], "cfgs": ["cfgs[0].lr"], "cache": ["cache[k]"],
                                    "preds": ["preds[i:j]"], "obj": ["obj.parts[1].w"]}


def test_names_a_function_of_the_cell_declares_global_and_binds_are_assigned():
    src = ("def main():\n"
           "    global ran, np, only_read\n"
           "    import numpy as np\n"
           "    ran = 2\n"
           "    local = 3\n"
           "    print(only_read)\n"
           "    def inner():\n"
           "        global deep\n"
           "        deep += 1\n"
           "main()\n")
    assert names_assigned(ast.parse(src)) == ["main", "np", "ran", "deep"]
