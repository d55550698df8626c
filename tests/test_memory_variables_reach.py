"""--vars on namespaces as notebooks build them: exact bytes, nothing missed, no notebook code run."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from gpumagic.memory import free, variables


def rows(ns, **kw):
    return {r.name: r.nbytes for r in variables.variable_memory(ns, **kw).rows}


def storage_bytes(*tensors) -> int:
    """Ground truth: each distinct storage's bytes once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_lazy_layers_and_tensors_kept_as_module_attributes():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.LazyLinear(3)        # no memory until its first call
            self.cache = torch.zeros(1000)            # not a buffer, still memory the model keeps
            self.blocks = [torch.nn.Linear(10, 10)]   # a plain list: not registered, still alive

    net = Net()
    rep = variables.variable_memory({"net": net})
    params = storage_bytes(net.body.weight, net.body.bias)
    block = storage_bytes(net.blocks[0].weight, net.blocks[0].bias)
    assert rep["net"].parts == {"params": params + block, "tensors": 4000}


def test_slots_dataclasses_and_deep_notebook_objects():
    @dataclasses.dataclass(slots=True)
    class Batch:
        x: torch.Tensor

    class Pair:
        __slots__ = ("a", "__b", "unset")

        def __init__(self):
            self.a = torch.zeros(10)
            self.__b = torch.zeros(20)

    class Run:
        def __init__(self):
            self.cfg = {"runs": [{"hist": (torch.zeros(30),)}]}   # five containers down from the list

    assert rows({"batch": Batch(torch.zeros(100)), "pair": Pair(), "runs": [Run()]}) == \
        {"batch": 400, "pair": 120, "runs": 120}



def test_an_object_first_reached_deep_through_a_back_reference_is_still_read():
    class Trainer:
        pass

    class Callback:
        pass

    class Data:
        pass

    trainer, callback, data = Trainer(), Callback(), Data()
    callback.trainer = trainer
    callback.seen = {"batches": [data]}          # data six levels down this way: its cache is cut...
    trainer.callbacks = [callback]
    trainer.data = data                          # ...and one level down this way
    data.cache = {"x": [torch.zeros(500)]}
    assert rows({"trainer": trainer}) == {"trainer": 2000}

def test_scanning_runs_no_notebook_code():
    ran = []

    class Proxy:                    # a lazy object: any attribute read would load it
        def __init__(self):
            self.t = torch.zeros(10)

        def __getattribute__(self, name):
            ran.append(name)
            return object.__getattribute__(self, name)

    class Dynamic:
        __slots__ = ()

        def __getattr__(self, name):
            ran.append(name)
            raise AttributeError(name)

    class Computed:
        def __init__(self):
            self._w = torch.zeros(5)

        @property
        def w(self):
            ran.append("w")
            return self._w * 2

    class LoadingDict(dict):
        def values(self):
            ran.append("values")
            return super().values()

    ns = {"proxy": Proxy(), "dyn": Dynamic(), "comp": Computed(), "d": LoadingDict(t=torch.zeros(3))}
    ran.clear()
    assert rows(ns) == {"proxy": 40, "comp": 20, "d": 12}
    assert ran == []


def test_an_optimizer_alone_holds_its_parameters_and_gradients():
    model = torch.nn.Linear(100, 100)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 100)).sum().backward()
    opt.step()
    params = 100 * 100 * 4 + 100 * 4
    state = 2 * params + 2 * 4
    with_model = variables.variable_memory({"model": model, "opt": opt})
    assert with_model["opt"].parts == {"state": state} and with_model["opt"].shared == 0
    del model                       # the parameters live on through the optimizer
    alone = variables.variable_memory({"opt": opt})
    assert alone["opt"].parts == {"state": state, "params": params, "grads": params}
    assert alone.totals == {"cpu": state + 2 * params}


def test_storages_over_one_numpy_array_count_each_byte_once():
    a = np.zeros(1000)
    whole, first, second = torch.from_numpy(a), torch.from_numpy(a[:500]), torch.from_numpy(a[500:])
    assert variables.variable_memory({"first": first, "whole": whole}).totals == {"cpu": 8000}
    assert variables.variable_memory({"whole": whole, "second": second}).totals == {"cpu": 8000}
    assert rows({"first": first, "whole": whole}) == {"whole": 8000, "first": 4000}


def test_retained_gradients_generators_and_odd_tensors():
    x = torch.ones(100, requires_grad=True)
    y = x * 2
    y.retain_grad()
    y.sum().backward()

    def batches():
        batch = torch.zeros(1000)
        yield batch.sum()
        yield 0

    started = batches()
    next(started)
    csr = torch.eye(10).to_sparse_csr()
    # x is listed: y's graph keeps it (and its gradient) alive, which would be y's memory otherwise.
    ns = {"x": x, "y": y, "started": started, "fresh": batches(),
          "csr": csr, "c": torch.ones(10, dtype=torch.complex128),
          "flags": torch.ones(10, dtype=torch.bool), "none": torch.zeros(0),
          "nested": torch.nested.nested_tensor([torch.ones(3, 4), torch.ones(5, 4)], layout=torch.jagged),
          "view": torch.zeros(10, 1).expand(10, 1000)}
    assert rows(ns) == {"x": 800, "y": 800, "started": 4000, "c": 160,
                        "csr": storage_bytes(csr.crow_indices(), csr.col_indices(), csr.values()),
                        "flags": 10, "nested": 128, "view": 40}
    assert next(started) == 0       # the scan read the generator's locals, it did not advance it


def test_output_history_note_leaves_out_what_variables_hold():
    w, gone = torch.zeros(1000), torch.zeros(500)
    out = {2: w, 3: w[:10], 4: gone}
    rep = variables.variable_memory({"w": w}, history=out)
    assert rep.totals == {"cpu": 4000}
    assert rep.notes == ["the output history (Out[...]) still holds tensors: 2.0 KiB on cpu that no variable "
                         "holds; `%gpumem --free --history` lets them go."]
    assert variables.variable_memory({"w": w}, history={2: w}).notes == []
    assert free.free_memory(history={2: w}, user_ns={"w": w}).notes == \
        ["this kernel has not initialised CUDA, so it holds no cached GPU blocks."]
    assert rep.as_dict()["notes"] == rep.notes


def test_one_hundred_thousand_small_tensors_under_three_names_stay_fast(monkeypatch):
    walks = []
    walk = variables.Collector.walk

    def counting(self, obj, depth=0, part="tensors"):
        if depth == 0:
            walks.append(obj)
        return walk(self, obj, depth, part)
    monkeypatch.setattr(variables.Collector, "walk", counting)
    small = [torch.zeros(4) for _ in range(10**5)]
    start = time.perf_counter()
    rep = variables.variable_memory({"small": small, "same": small, "again": small})
    took = time.perf_counter() - start
    assert rep.totals == {"cpu": 16 * 10**5} and len(rep.rows) == 3
    assert len(walks) == 1          # one walk for one object, whatever its names
    assert took < 3, took


def test_deques_and_queues_hold_their_tensors():
    # A replay buffer or the last losses kept in a deque (with their graphs) was memory no row showed.
    import collections
    import queue

    class Window(collections.deque):
        def __iter__(self):
            raise RuntimeError("a subclass's iterator is notebook code; the scan does not call it")

    losses = collections.deque(maxlen=3)
    losses.extend(torch.zeros(250) for _ in range(5))   # the three kept: 3,000 bytes
    window = Window([torch.zeros(10)])
    pending = queue.Queue()
    pending.put(torch.zeros(100))
    assert rows({"losses": losses, "window": window, "pending": pending}) == \
        {"losses": 3000, "pending": 400, "window": 40}


def test_a_kept_error_holds_every_frame_of_its_traceback():
    def layer(n):
        act = torch.zeros(100 * (n + 1))     # noqa: F841 - the activation the frame keeps
        if n == 0:
            raise RuntimeError("out of memory")
        layer(n - 1)

    try:
        layer(11)                              # twelve frames deep: deeper than max_depth
    except RuntimeError as exc:
        kept = exc
    assert rows({"kept": kept}) == {"kept": sum(400 * (n + 1) for n in range(12))}
