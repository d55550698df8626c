"""%gpumem --vars over the autograd memory mistakes training notebooks make: each kept graph is named
under the right variable with the bytes torch itself saved (counted here from shapes, or by a pack hook
on a second, identical forward)."""
from __future__ import annotations

import json
import time

import pytest

from tests.conftest import run_cell
from tests.test_magics_gpumem_autograd import row, vars_json

pytestmark = pytest.mark.usefixtures("no_last_error")

B, IN, HIDDEN, OUT = 64, 32, 256, 10
F32, BF16 = 4, 2
# Linear -> ReLU -> Linear, then pow(2).mean(): backward needs the ReLU's output and the second Linear's
# output (pow's input); the batch (first Linear) and the second weight are the variables' x and model.
ACT = (B * HIDDEN + B * OUT) * F32
BATCH = B * IN * F32
PARAMS = (IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT) * F32

MODEL = f"""
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear({IN}, {HIDDEN}), nn.ReLU(), nn.Linear({HIDDEN}, {OUT}))
x = torch.randn({B}, {IN})
"""

# The test's reference: the distinct storages a pack hook sees on a second, identical forward, less those
# the named variables hold. Torch passes every saved tensor to the hook but "wrapped numbers" (a Python
# scalar turned into a 0-dim float64 tensor, as in `q * scale`), which the reference cannot see.
REFERENCE = """
def _saved_by_torch(_fn, *_held):
    _held_ptrs = {t.untyped_storage().data_ptr() for t in _held}
    _seen = {}
    def _pack(t):
        _seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
        return t
    with torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
        _fn()
    _new = [v for p, v in _seen.items() if p not in _held_ptrs]
    return sum(n for n, _ in _new), {str(d) for _, d in _new}
"""


def ok(shell, source: str) -> str:
    result, out, _ = run_cell(shell, source)
    assert result.success, result.error_in_exec or result.error_before_exec
    return out


AUTOGRAD_NOTE = "autograd: what a result's graph keeps for backward"


# --------------------------------------------------------------------------- eval loops that keep graphs

@pytest.mark.parametrize("steps", [1, 3, 10])
def test_total_loss_summed_without_no_grad_grows_with_every_step(shell, no_cuda_init, steps):
    ok(shell, MODEL + f"""
total_loss = 0
for step in range({steps}):
    x = torch.randn({B}, {IN})        # a fresh batch each step: only the last one is still a variable
    loss = model(x).pow(2).mean()
    total_loss += loss                # the leak: each step's graph hangs on the sum's
""")
    held = vars_json(shell)
    # Every step's activations, and every batch but the last (which `x` holds).
    assert row(held, "total_loss")["parts"] == {"tensors": F32, "autograd": steps * ACT + (steps - 1) * BATCH}
    # `loss` keeps the last step's graph, which is part of the sum's: shared, counted once in the total.
    assert row(held, "loss")["parts"] == {"tensors": F32, "autograd": ACT}
    assert row(held, "loss")["shared_with"] == ["total_loss"] and row(held, "loss")["shared"] == ACT
    assert held["totals"] == {"cpu": 2 * F32 + steps * (ACT + BATCH) + PARAMS}
    assert any(n.startswith(AUTOGRAD_NOTE) for n in held["notes"])


def test_the_fixed_eval_loops_keep_no_graph(shell, no_cuda_init):
    ok(shell, MODEL + """
total_item = 0.0
total_detached = torch.zeros(())
with torch.no_grad():
    total_no_grad = 0
    for step in range(5):
        total_no_grad += model(x).pow(2).mean()
for step in range(5):
    loss = model(x).pow(2).mean()
    total_item += loss.item()
    total_detached += loss.detach()
del loss
""")
    held = vars_json(shell)
    assert row(held, "total_item") is None                       # a float
    assert row(held, "total_no_grad")["parts"] == {"tensors": F32}
    assert row(held, "total_detached")["parts"] == {"tensors": F32}
    assert not any(n.startswith(AUTOGRAD_NOTE) for n in held["notes"])


def test_a_list_of_losses_holds_every_graph_and_a_list_of_items_nothing(shell, no_cuda_init):
    ok(shell, MODEL + f"""
losses, items = [], []
for step in range(5):
    x = torch.randn({B}, {IN})
    loss = model(x).pow(2).mean()
    losses.append(loss)
    items.append(loss.item())
del loss
""")
    held = vars_json(shell)
    assert row(held, "losses")["parts"] == {"tensors": 5 * F32, "autograd": 5 * ACT + 4 * BATCH}
    assert row(held, "items") is None
    assert [v["name"] for v in held["variables"]] == ["losses", "model", "x"]


def test_outputs_under_no_grad_and_integer_predictions_keep_no_graph(shell, no_cuda_init):
    ok(shell, MODEL + """
model.eval()
with torch.no_grad():
    outputs = model(x)
preds = [model(x).argmax(1) for _ in range(3)]   # no no_grad, but an integer result has no graph
probs = model(x).softmax(-1)                       # no no_grad: this one keeps the forward's graph
""")
    held = vars_json(shell)
    assert row(held, "outputs")["parts"] == {"tensors": B * OUT * F32}
    assert row(held, "preds")["parts"] == {"tensors": 3 * B * 8}     # int64 indices
    # softmax saves its own output (probs itself); the ReLU output and the second Linear's input are one storage.
    assert row(held, "probs")["parts"] == {"tensors": B * OUT * F32, "autograd": B * HIDDEN * F32}


# --------------------------------------------------------------------------- real layers

def test_a_cnn_result_counts_activations_bn_statistics_and_max_pool_indices(shell, no_cuda_init):
    ok(shell, """
import torch
from torch import nn
torch.manual_seed(0)
cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                    nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                    nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
images = torch.randn(4, 3, 32, 32)
logits = cnn(images)
""" + REFERENCE + """
expected, dtypes = _saved_by_torch(lambda: cnn(images), images, *cnn.parameters(), *cnn.buffers())
""")
    ns = shell.user_ns
    assert "torch.int64" in ns["dtypes"]       # the max-pooling indices are among what backward needs
    held = vars_json(shell)
    assert row(held, "logits")["parts"] == {"tensors": 4 * 10 * F32, "autograd": ns["expected"]}
    assert ns["expected"] > 4 * 8 * 32 * 32 * F32     # at least the first conv's output
    assert row(held, "cnn")["parts"] == {"params": sum(p.numel() * 4 for p in ns["cnn"].parameters()),
                                         "buffers": sum(b.nbytes for b in ns["cnn"].buffers())}


def test_a_transformer_encoder_layer_with_masks(shell, no_cuda_init):
    ok(shell, """
import torch
from torch import nn
torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
seq = torch.randn(4, 10, 32)
causal = nn.Transformer.generate_square_subsequent_mask(10)
padding = torch.zeros(4, 10, dtype=torch.bool)
padding[:, -2:] = True
encoded = layer(seq, src_mask=causal, src_key_padding_mask=padding)
""" + REFERENCE + """
expected, dtypes = _saved_by_torch(lambda: layer(seq, src_mask=causal, src_key_padding_mask=padding),
                                   seq, causal, padding, *layer.parameters())
""")
    ns = shell.user_ns
    held = vars_json(shell)
    assert row(held, "encoded")["parts"] == {"tensors": 4 * 10 * 32 * F32, "autograd": ns["expected"]}


def test_multihead_attention_counts_its_wrapped_scale_too(shell, no_cuda_init):
    ok(shell, """
import torch
from torch import nn
torch.manual_seed(0)
mha = nn.MultiheadAttention(32, 4, batch_first=True, dropout=0.1)
seq = torch.randn(4, 10, 32)
padding = torch.zeros(4, 10, dtype=torch.bool)
padding[:, -2:] = True
attended, weights = mha(seq, seq, seq, key_padding_mask=padding)
""" + REFERENCE + """
expected, dtypes = _saved_by_torch(lambda: mha(seq, seq, seq, key_padding_mask=padding),
                                   seq, padding, *mha.parameters())
""")
    ns = shell.user_ns
    held = vars_json(shell)
    # `q * scale` saves the Python float as a 0-dim float64 tensor (8 bytes) that pack hooks never see.
    graph = ns["expected"] + 8
    assert row(held, "attended")["parts"] == {"tensors": 4 * 10 * 32 * F32, "autograd": graph}
    # The averaged attention weights are a second result of the same forward: a part of its graph, shared.
    assert 0 < row(held, "weights")["parts"]["autograd"] < graph
    assert row(held, "weights")["shared_with"] == ["attended"]


# --------------------------------------------------------------------------- checkpointing, autocast, compile

CHECKPOINTED = f"""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
stem = nn.Linear({IN}, {HIDDEN})
block = nn.Sequential(nn.Linear({HIDDEN}, {HIDDEN}), nn.ReLU(), nn.Linear({HIDDEN}, {OUT}))
x = torch.randn({B}, {IN})
loss = checkpoint(block, stem(x), use_reentrant=REENTRANT).pow(2).mean()
rng_bytes = torch.get_rng_state().numel()
"""
BLOCK_PARAMS = (HIDDEN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT) * F32


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_blocks_kept_input_counts_for_the_loss(shell, no_cuda_init, reentrant):
    ok(shell, CHECKPOINTED.replace("REENTRANT", str(reentrant)))
    rng = shell.user_ns["rng_bytes"]
    held = vars_json(shell)
    # The block's activations are not kept (that is checkpointing); its input is (the stem's output,
    # no variable holds it), with the CPU random state to replay it, and the block's output (pow's input).
    graph = B * HIDDEN * F32 + rng + B * OUT * F32
    assert row(held, "loss")["parts"] == {"tensors": F32, "autograd": graph}
    # Kept deep (six levels down a trainer's history), the same graph counts the same.
    ok(shell, "class Trainer: pass\ntrainer = Trainer()\ntrainer.history = {'runs': [{'train': [[loss]]}]}\n"
              "del loss")
    held = vars_json(shell)
    assert row(held, "trainer")["parts"] == {"tensors": F32, "autograd": graph}
    # With `block` gone, the graph alone keeps its weights (to run it again): they count for the loss.
    ok(shell, "del block")
    assert row(vars_json(shell), "trainer")["parts"] == {"tensors": F32, "autograd": graph + BLOCK_PARAMS}


def test_an_autocast_result_counts_the_bf16_casts_it_saved(shell, no_cuda_init):
    ok(shell, MODEL + """
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = model(x).float().pow(2).mean()
""" + REFERENCE + """
def _again():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x).float().pow(2).mean()
expected, dtypes = _saved_by_torch(_again, x, *model.parameters())
""")
    # bf16 copies of the batch and of the second weight (new storages, no variable holds them), the
    # ReLU's bf16 output, and the float32 copy pow squares.
    by_shape = (B * IN + HIDDEN * OUT + B * HIDDEN) * BF16 + B * OUT * F32
    assert shell.user_ns["expected"] == by_shape
    held = vars_json(shell)
    assert row(held, "loss")["parts"] == {"tensors": F32, "autograd": by_shape}
    assert row(held, "model")["parts"] == {"params": PARAMS}      # the casts are not the model's


def test_a_torch_compile_result_counts_what_the_compiled_graph_saved(shell):
    # (no `no_cuda_init`: inductor asks torch.cuda about devices while it compiles, which is torch's own doing)
    ok(shell, MODEL + REFERENCE)
    result, out, _ = run_cell(shell, "compiled = torch.compile(model)\nloss = compiled(x).pow(2).mean()")
    if not result.success:
        pytest.skip(f"torch.compile is not usable here: {result.error_in_exec!r}"[:300])
    ok(shell, "expected, dtypes = _saved_by_torch(lambda: compiled(x).pow(2).mean(), x, *model.parameters())")
    expected = shell.user_ns["expected"]
    assert expected > 0
    held = vars_json(shell)
    assert row(held, "loss")["parts"] == {"tensors": F32, "autograd": expected}
    # the compiled module is the model (its _orig_mod): shared, not counted twice
    assert row(held, "compiled")["shared_with"] == ["model"]
    assert held["totals"] == {"cpu": F32 + expected + PARAMS + BATCH}


def test_a_torchscript_result_whose_saved_tensors_torch_hides_gets_a_note(shell, no_cuda_init):
    # After its profiling runs, a scripted model's forward is one DifferentiableGraphBackward node: a C++
    # node torch gives no Python view of, so what it saved (the Tanh output) cannot be read.
    ok(shell, MODEL.replace("nn.ReLU()", "nn.Tanh()") + """
import warnings
scripted = torch.jit.script(model)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _ in range(3):
        loss = scripted(x).pow(2).mean()
hidden = type(loss.grad_fn.next_functions[0][0].next_functions[0][0]).__name__
""")
    if shell.user_ns["hidden"] != "CppFunction":
        pytest.skip("this torch runs the scripted forward op by op: every saved tensor is readable")
    held = vars_json(shell)
    # pow's input is readable; the note says the rest is not counted rather than showing it as nothing.
    assert row(held, "loss")["parts"] == {"tensors": F32, "autograd": B * OUT * F32}
    assert "autograd graphs of loss: what 1 DifferentiableGraphBackward node saved is hidden inside torch " \
           "(TorchScript, a C++ extension's autograd Function), so it is not counted." in held["notes"]


# --------------------------------------------------------------------------- who holds the graph

def test_two_losses_of_one_forward_share_its_graph(shell, no_cuda_init):
    ok(shell, MODEL + "out = model(x)\nmse = out.pow(2).mean()\nl1 = out.abs().mean()\ndel out")
    held = vars_json(shell)
    # Both keep the ReLU output and `out` (pow and abs each saved it): one graph, shared, counted once.
    graph = B * HIDDEN * F32 + B * OUT * F32
    for name, other in (("mse", "l1"), ("l1", "mse")):
        assert row(held, name)["parts"] == {"tensors": F32, "autograd": graph}
        assert row(held, name)["shared"] == graph and row(held, name)["shared_with"] == [other]
    assert held["totals"] == {"cpu": 2 * F32 + graph + PARAMS + BATCH}


def test_a_deleted_models_parameters_count_for_the_loss_and_the_optimizer_both_keeping_them(shell, no_cuda_init):
    ok(shell, MODEL + "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "loss = model(x).pow(2).mean()\ndel model")
    held = vars_json(shell)
    assert row(held, "opt")["parts"] == {"params": PARAMS}
    assert row(held, "loss")["parts"] == {"tensors": F32, "autograd": ACT + PARAMS}
    assert row(held, "loss")["shared"] == PARAMS and row(held, "loss")["shared_with"] == ["opt"]
    assert held["totals"] == {"cpu": F32 + ACT + PARAMS + BATCH}


def test_losses_kept_in_a_dict_and_as_an_attribute(shell, no_cuda_init):
    ok(shell, MODEL + """
class Trainer:
    def __init__(self, model):
        self.model = model
        self.last_loss = None
    def step(self, x):
        self.last_loss = self.model(x).pow(2).mean()
trainer = Trainer(model)
trainer.step(x)
history = {"train": [model(x).pow(2).mean(), model(x).pow(2).mean()], "epoch": 1}
""")
    held = vars_json(shell)
    # The trainer holds the model (params) and its last loss's graph; the weights are not counted twice.
    assert row(held, "trainer")["parts"] == {"params": PARAMS, "tensors": F32, "autograd": ACT}
    assert row(held, "history")["parts"] == {"tensors": 2 * F32, "autograd": 2 * ACT}
    assert row(held, "model")["shared_with"] == ["trainer"]


def test_grads_made_with_create_graph_keep_their_graph_for_the_model(shell, no_cuda_init):
    # backward(create_graph=True) (a gradient penalty, then no second backward): each parameter's .grad
    # keeps the graph that computes it, and that graph what it saved (torch warns of this very leak).
    ok(shell, MODEL.replace("nn.ReLU()", "nn.Tanh()") + """
import warnings
from torch.multiprocessing.reductions import StorageWeakRef
loss = model(x).pow(2).mean()
_seen = {}
def _pack(t):
    _seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), StorageWeakRef(t.untyped_storage()))
    return t
with warnings.catch_warnings(), torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
    warnings.simplefilter("ignore")
    loss.backward(create_graph=True)
del loss, _pack
import gc; gc.collect()
_held = {t.untyped_storage().data_ptr() for t in [x, *model.parameters(), *(p.grad for p in model.parameters())]}
expected = sum(n for p, (n, ref) in _seen.items() if p not in _held and not ref.expired())
""")
    expected = shell.user_ns["expected"]
    assert expected >= 2 * B * HIDDEN * F32       # at least the Tanh output, saved twice over
    held = vars_json(shell)
    assert row(held, "model")["parts"] == {"params": PARAMS, "grads": PARAMS, "autograd": expected}
    assert any(n.startswith(AUTOGRAD_NOTE) for n in held["notes"])


def test_create_graph_grads_with_an_optimizer_count_for_the_model_while_it_is_there(shell, no_cuda_init):
    ok(shell, MODEL.replace("nn.ReLU()", "nn.Tanh()") + """
import warnings
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(x).pow(2).mean()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    loss.backward(create_graph=True)
del loss
""")
    held = vars_json(shell)
    graph = row(held, "model")["parts"]["autograd"]
    assert graph > 0
    # The optimizer reaches the grads' graphs through the model's parameters: the model's, as they are.
    assert row(held, "opt") is None
    assert row(held, "model")["shared"] == 0
    # With the model gone, the optimizer alone keeps the parameters, their grads and the grads' graphs.
    ok(shell, "del model")
    held = vars_json(shell)
    assert row(held, "opt")["parts"] == {"params": PARAMS, "grads": PARAMS, "autograd": graph}


def test_an_object_with_an_optimizer_and_a_loss_names_the_parameters_params(shell, no_cuda_init):
    ok(shell, MODEL + """
class Step:
    pass
step = Step()
step.opt = torch.optim.SGD(model.parameters(), lr=0.1)
step.last_loss = model(x).pow(2).mean()
del model
""")
    # The loss's graph reaches the parameters too, but they are the optimizer's parameters: "params".
    assert row(vars_json(shell), "step")["parts"] == {"params": PARAMS, "tensors": F32, "autograd": ACT}


def test_a_kept_grad_fn_holds_its_graph(shell, no_cuda_init):
    ok(shell, MODEL + "loss = model(x).pow(2).mean()\nnode = loss.grad_fn\ndel loss")
    held = vars_json(shell)
    # The node is the graph: it keeps everything the loss kept, but the loss's own 4 bytes.
    assert row(held, "node")["parts"] == {"autograd": ACT}
    assert row(held, "node")["type"] == "MeanBackward0"


# --------------------------------------------------------------------------- speed

def test_vars_on_a_graph_of_five_thousand_nodes_is_fast(shell, no_cuda_init):
    ok(shell, """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
x = torch.randn(2, 8)
running = 0
for step in range(1000):     # five nodes a step: addmm, relu, addmm, pow, mean; plus the sum's add
    running = 0.9 * running + 0.1 * model(x).pow(2).mean()
def _count(fn):
    seen, todo = set(), [fn]
    while todo:
        n = todo.pop()
        if n is not None and n not in seen:
            seen.add(n)
            todo.extend(f for f, _ in n.next_functions)
    return len(seen)
nodes = _count(running.grad_fn)
""")
    assert 5_000 <= shell.user_ns["nodes"] < 20_000
    started = time.perf_counter()
    held = vars_json(shell)
    assert time.perf_counter() - started < 1.0
    # Each step saved the ReLU output (2 x 16) and the second Linear's output (2 x 4), and two 0.9/0.1
    # scalars (wrapped numbers, float64) for its multiplies.
    per_step = (2 * 16 + 2 * 4) * F32
    assert row(held, "running")["parts"]["autograd"] >= 1000 * per_step
    assert not any("more than" in n for n in held["notes"])


# --------------------------------------------------------------------------- a real notebook

KERNEL_CELLS = [
    "%load_ext gpumagic",
    MODEL + "total_loss = 0\nfor step in range(3):\n    total_loss += model(x).pow(2).mean()",
    "%gpumem --vars",
    "held = %gpumem --vars --json\nimport json; print(json.dumps(held))",
]


@pytest.fixture(scope="module")
def notebook():
    from tests.notebook_helpers import run_notebook
    return run_notebook(KERNEL_CELLS, timeout=120, allow_errors=True)


def test_a_notebook_shows_the_autograd_part_and_its_note(notebook):
    from tests.notebook_helpers import stream_text
    (shown,) = [o.data for o in notebook.cells[2].outputs if o.output_type == "display_data"]
    graph = 3 * ACT
    assert "autograd 199.5 KiB" in shown["text/html"]
    assert "autograd: what a result&#x27;s graph keeps for backward" in shown["text/html"]
    loss_line = next(line for line in shown["text/plain"].splitlines() if line.startswith("total_loss"))
    assert "tensors 4 B, autograd 199.5 KiB" in loss_line            # 3 x 68,096 bytes
    assert AUTOGRAD_NOTE in shown["text/plain"]
    out = stream_text(notebook.cells[3])
    held = json.loads(out)
    assert [(v["name"], v["parts"]) for v in held["variables"]][0] == \
        ("total_loss", {"tensors": F32, "autograd": graph})
