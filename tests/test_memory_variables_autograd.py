"""What an autograd graph keeps, read without running the notebook's code (saved-tensor hooks,
checkpointing, custom Functions) and without keeping anything alive."""
from __future__ import annotations

import gc
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from gpumagic.memory import variables


def parts(ns, name, **kw):
    return variables.variable_memory(ns, **kw)[name].parts


def test_tensors_packed_by_saved_tensor_hooks_count_and_no_unpack_hook_runs():
    unpacked = []
    w = torch.randn(100, 100, requires_grad=True)
    x = torch.randn(8, 100)

    def pack(t):              # as torch.autograd.graph.save_on_cpu does: keep a copy, not the tensor
        return ("copy", t.detach().clone())

    def unpack(packed):       # notebook code: must not run for a report
        unpacked.append(packed)
        return packed[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = torch.tanh(x @ w).sum()
    # mm saves x (copied: 3,200 bytes) for w's gradient; tanh saves its output (copied: 3,200 bytes).
    assert parts({"w": w, "x": x, "loss": loss}, "loss") == {"tensors": 4, "autograd": 2 * 8 * 100 * 4}
    assert unpacked == []


def test_a_checkpointed_block_is_not_run_again_and_its_kept_input_counts():
    calls = []
    layer = torch.nn.Linear(64, 64)

    def block(h):
        calls.append(1)
        return torch.relu(layer(h)).exp()

    x = torch.randn(16, 64)
    h = x * 2                                 # the checkpoint's input: kept to run the block again later
    h.requires_grad_()
    out = checkpoint(block, h, use_reentrant=False)
    loss = out.sum()
    del h
    calls.clear()
    got = parts({"x": x, "layer": layer, "loss": loss}, "loss")
    assert calls == []                        # reading the saved tensors did not recompute the block
    # The block's activations are not stored (that is checkpointing); what is: its input (16 x 64 floats)
    # and the CPU random state to replay it with, both through the unpack hook's closure.
    rng_state = torch.get_rng_state().numel()   # a uint8 tensor
    assert got == {"tensors": 4, "autograd": 16 * 64 * 4 + rng_state}
    # The closure reaches the block's module too: its weights are the loss's once `layer` is gone.
    got = parts({"x": x, "loss": loss}, "loss")
    assert got == {"tensors": 4, "autograd": 16 * 64 * 4 + rng_state + (64 * 64 + 64) * 4}
    assert calls == []


def test_a_custom_functions_saved_tensors_and_ctx_attributes_count():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a * 2)      # 400 bytes, saved the documented way
            ctx.mask = torch.ones(50)         # 200 bytes kept as a ctx attribute
            return a * 3

        @staticmethod
        def backward(ctx, grad):
            return grad * 3

    a = torch.randn(100, requires_grad=True)
    out = Scale.apply(a)
    assert parts({"a": a, "out": out}, "out") == {"tensors": 400, "autograd": 600}
    out.sum().backward()                      # frees the saved tensors; the ctx attribute stays
    assert parts({"a": a, "out": out}, "out") == {"tensors": 400, "autograd": 200}


def test_a_buffer_assigned_an_undetached_result_counts_the_graph_for_its_module():
    class Running(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(10, 10)
            self.register_buffer("mean", torch.zeros(10))

        def forward(self, x):
            y = torch.sigmoid(self.lin(x))
            self.mean = y.mean(0)             # the classic leak: the buffer keeps the batch's graph
            return y

    net = Running()
    x = torch.randn(32, 10)
    net(x)
    # sigmoid saves its output (32 x 10 floats); the Linear saved x (the variable x holds it).
    assert parts({"net": net, "x": x}, "net") == {"params": 440, "buffers": 40, "autograd": 32 * 10 * 4}


def test_the_report_keeps_nothing_alive():
    w = torch.randn(50, 50, requires_grad=True)
    hidden = torch.randn(20, 50) @ w
    ref = StorageWeakRef(hidden.untyped_storage())
    loss = torch.sigmoid(hidden).sum()       # sigmoid saves its output; mm saved the random input
    del hidden
    report = variables.variable_memory({"w": w, "loss": loss})
    assert report["loss"].parts == {"tensors": 4, "autograd": 2 * 20 * 50 * 4}
    del loss
    gc.collect()
    assert ref.expired()                      # the report (still alive here) holds no tensor of the graph
    assert report.rows


def test_a_deep_graph_is_bounded_and_fast():
    leaf = torch.ones(10, requires_grad=True)
    y = leaf
    for _ in range(30_000):
        y = y.exp()
    started = time.perf_counter()
    report = variables.variable_memory({"leaf": leaf, "y": y}, max_nodes=20_000)
    assert time.perf_counter() - started < 5    # about 0.3 s here; unbounded it would read 30,000 nodes
    assert report["y"].parts == {"tensors": 40, "autograd": 19_999 * 40}
    assert "autograd graphs of y: more than 20,000 nodes; the saved tensors of the rest were not counted." \
        in report.notes


def test_a_torch_that_cannot_show_saved_tensors_unpacked_counts_none_and_says_so(monkeypatch):
    from gpumagic.memory import autograd_graph
    monkeypatch.setattr(autograd_graph, "saved_tensors_readable", lambda torch: False)
    w = torch.randn(50, 50, requires_grad=True)
    x = torch.randn(20, 50)
    loss = torch.sigmoid(x @ w).sum()
    report = variables.variable_memory({"w": w, "x": x, "loss": loss})
    assert report["loss"].parts == {"tensors": 4}     # no guess, and no unpacking to find out
    assert report.notes == ["autograd: this torch cannot show a saved tensor without unpacking it (which may "
                            "run notebook code), so what graphs saved for backward is not counted."]
