"""%%dataparallel --strategy fsdp on the CPU, for real: two gloo worker processes sharding with FSDP2.

The model has repeated blocks (the FSDP units); its training under the magic
must equal single-process training, its tensors must come back into the same
objects without the kernel holding a second copy, and the ranks' shards must
carry over to the next cell.
"""
from __future__ import annotations

import copy
import textwrap

import pytest
import torch
from IPython.core.error import UsageError

from gpumagic.dataparallel.ranks.local import POOL_NAME
from gpumagic.errors import WorkerError
from gpumagic.procs import pool as poolmod
from tests.conftest import run_cell
from tests.dataparallel_helpers import dp_cell, dp_pool, last_result, wait_dead

FSDP2 = "--strategy fsdp --devices cpu --nprocs 2"

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))

class Net(nn.Module):
    def __init__(self, width=64, depth=3):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.out = nn.Linear(width, 2)
    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
X = torch.randn(64, 6)
Y = torch.randn(64, 2)
loader = DataLoader(TensorDataset(X, Y), batch_size=16)
losses = []
"""

TRAIN = """
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
"""


@pytest.fixture(scope="module", autouse=True)
def _stop_pool_after_module():
    yield
    poolmod.stop_pool(POOL_NAME)


def _reference(ns, epochs):
    """The notebook's model and optimizer trained in this process on whole batches."""
    model = copy.deepcopy(ns["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    # a copy: load_state_dict keeps CPU tensors as they are, and these steps must not move the notebook's
    opt.load_state_dict(copy.deepcopy(ns["opt"].state_dict()))
    losses = []
    for _ in range(epochs):
        for x, y in ns["loader"]:
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return model, opt, losses


def _assert_close_state(model, opt, ref_model, ref_opt, tol=1e-5):
    for (name, a), b in zip(model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.allclose(a, b, atol=tol, rtol=0), name
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for idx, st in mine["state"].items():
        assert st.keys() == theirs["state"][idx].keys()
        for k, v in st.items():
            assert torch.allclose(v, theirs["state"][idx][k], atol=tol, rtol=0), (idx, k)
    assert [g["lr"] for g in mine["param_groups"]] == [g["lr"] for g in theirs["param_groups"]]


def _setup(shell, source=SETUP):
    result, text, _ = run_cell(shell, source)
    assert result.success, text
    return shell.user_ns


def test_training_equals_one_process_and_the_weights_come_back_in_place(shell):
    ns = _setup(shell)
    ref_model, ref_opt, ref_losses = _reference(ns, epochs=2)
    params = {n: p for n, p in ns["model"].named_parameters()}
    _, cap = dp_cell(shell, FSDP2, TRAIN)
    assert "--strategy fsdp: model sharded over the ranks; blocks: Block" in cap.stderr
    assert "2 ranks (gloo, fsdp), 8 optimizer steps each; trained state loaded into model, opt" in cap.stderr
    model, opt = ns["model"], ns["opt"]
    _assert_close_state(model, opt, ref_model, ref_opt)
    assert len(ns["losses"]) == len(ref_losses)     # rank 0's: each is the loss of its half of a batch
    # the same Parameter objects, their storage now shared memory the ranks wrote into
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(p.is_shared() for p in model.parameters())
    # a fresh AdamW's state: the kernel made its tensors in shared memory, rank 0 wrote into them, no
    # copy of it travelled; then it became the notebook's own memory, as after a plain cell
    moments = [v for st in opt.state.values() for v in st.values() if v.dim()]
    assert len(moments) == 2 * len(params) and not any(v.is_shared() for v in moments)
    assert last_result().returned_bytes < sum(v.numel() * v.element_size() for v in moments) / 4


def test_a_second_cell_continues_from_the_shards_the_ranks_kept(shell):
    ns = _setup(shell)
    ref_model, ref_opt, ref_losses = _reference(ns, epochs=4)
    dp_cell(shell, FSDP2, TRAIN)
    pointers = {n: p.data_ptr() for n, p in ns["model"].named_parameters()}
    _, cap = dp_cell(shell, FSDP2, TRAIN)
    second = last_result()
    assert "sharded over the ranks" not in cap.stderr        # nothing sharded anew
    weight_bytes = sum(p.numel() * 4 for p in ns["model"].parameters())
    assert second.shipped_bytes <= (ns["X"].numel() + ns["Y"].numel()) * 4   # the data, not the model
    assert second.returned_bytes < weight_bytes / 4          # everything written in place
    assert {n: p.data_ptr() for n, p in ns["model"].named_parameters()} == pointers
    _assert_close_state(ns["model"], ns["opt"], ref_model, ref_opt)
    assert len(ns["losses"]) == len(ref_losses)


def test_changes_in_the_notebook_reach_the_ranks(shell):
    ns = _setup(shell)
    dp_cell(shell, FSDP2, TRAIN)
    # weights changed behind autograd's back, and a hyperparameter: the ranks' shards are stale
    run_cell(shell, "model.inp.weight.data.zero_()\nopt.param_groups[0]['lr'] = 0.0\n"
                    "opt.param_groups[0]['weight_decay'] = 0.0\nbefore = model.state_dict()\n"
                    "before = {k: v.clone() for k, v in before.items()}")
    dp_cell(shell, FSDP2, TRAIN + "zeros = model.inp.weight.full_tensor().abs().sum().item()\n")
    assert ns["zeros"] == 0.0            # the ranks trained from the zeroed weights ...
    for k, v in ns["model"].state_dict().items():
        assert torch.equal(v, ns["before"][k]), k     # ... with lr 0: nothing moved


def test_keep_optimizer_leaves_its_state_in_the_workers_and_continues(shell):
    ns = _setup(shell)
    run_cell(shell, "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)")
    ref = copy.deepcopy(ns["model"])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=4, gamma=0.5)
    for _ in range(4):
        for x, y in ns["loader"]:
            ref_opt.zero_grad()
            ((ref(x) - y) ** 2).mean().backward()
            ref_opt.step()
            ref_sched.step()
    body = TRAIN.replace("opt.step()\n", "opt.step()\n        sched.step()\n")
    _, cap = dp_cell(shell, FSDP2 + " --keep-optimizer", body)
    assert "kept sharded in the workers (a later --strategy fsdp cell continues from it): opt" in cap.stderr
    assert ns["opt"].state_dict()["state"] == {}          # the notebook's optimizer holds no moments ...
    assert ns["opt"].param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 2)   # ... but its schedule moved
    dp_cell(shell, FSDP2 + " --keep-optimizer", body)
    for (name, a), b in zip(ns["model"].state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), name
    assert ns["sched"].last_epoch == ref_sched.last_epoch == 16


def test_buffers_come_back_from_rank0_and_the_ranks_never_write_the_notebooks(shell):
    ns = _setup(shell, SETUP + "\nmodel.blocks[0].norm = nn.BatchNorm1d(64)\n"
                               "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    before = ns["model"].blocks[0].norm.running_mean.clone()
    with pytest.raises(WorkerError):   # trained, then failed: the statistics the ranks moved stay theirs
        dp_cell(shell, FSDP2, TRAIN + "raise RuntimeError('after training')\n")
    assert torch.equal(ns["model"].blocks[0].norm.running_mean, before)
    dp_cell(shell, FSDP2, TRAIN + "import torch.distributed as dist\n"
                                  "seen = model.blocks[0].norm.running_mean.tolist()\n")
    after = ns["model"].blocks[0].norm.running_mean
    assert torch.equal(after, torch.tensor(ns["seen"])) and not torch.equal(after, before)   # rank 0's statistics


def test_a_meta_model_is_initialised_on_the_ranks_and_stays_there(shell, tmp_path):
    ns = _setup(shell, SETUP + "\nwith torch.device('meta'):\n    model = Net(width=32, depth=4)\n"
                               "opt = torch.optim.AdamW(model.parameters(), lr=0.01)\n")
    _, cap = dp_cell(shell, FSDP2, TRAIN)
    first = list(ns["losses"])
    assert all(p.is_meta for p in ns["model"].parameters())        # the kernel never held the weights
    assert ns["opt"].state_dict()["state"] == {}
    assert "trained state kept sharded in the workers (a later --strategy fsdp cell continues from it): " \
           "model, opt" in cap.stderr
    assert all(v == v for v in first) and first[-1] < first[0]
    # the next cell continues; a checkpoint written from the cell holds the trained weights
    path = tmp_path / "ckpt"
    dp_cell(shell, FSDP2, TRAIN + textwrap.dedent(f"""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        dcp.save(get_model_state_dict(model), checkpoint_id={str(path)!r})
        with torch.no_grad():
            check = float(((model(X) - Y) ** 2).mean())
    """))
    second = ns["losses"][8:]
    assert len(second) == 8 and sum(second[4:]) < sum(first[4:]) < sum(first[:4])
    run_cell(shell, textwrap.dedent(f"""
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save({str(path)!r}, {str(tmp_path / 'model.pt')!r})
        saved = Net(width=32, depth=4)
        saved.load_state_dict(torch.load({str(tmp_path / 'model.pt')!r}))
        with torch.no_grad():
            check_here = float(((saved(X) - Y) ** 2).mean())
    """))
    assert ns["check_here"] == pytest.approx(ns["check"], abs=1e-5)


def test_bad_wrap_and_framework_cells_are_refused_before_anything_starts(shell):
    ns = _setup(shell)
    poolmod.stop_pool(POOL_NAME)
    before = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    with pytest.raises(UsageError) as err:
        dp_cell(shell, FSDP2 + " --wrap TransformerBlock", TRAIN)
    text = str(err.value)
    assert "--wrap TransformerBlock: model (Net) has no such submodule class" in text
    assert "its candidate block classes are Block" in text
    with pytest.raises(UsageError) as err:
        dp_cell(shell, FSDP2, "from torch.nn.parallel import DistributedDataParallel as DDP\nDDP(model)\n")
    assert "--strategy fsdp shards a hand-written loop's model, but the cell builds its own " \
           "DistributedDataParallel" in str(err.value)
    assert dp_pool() is None                                    # no process started
    assert not any(p.is_shared() for p in ns["model"].parameters())   # nothing moved either
    assert all(torch.equal(v, before[k]) for k, v in ns["model"].state_dict().items())


def test_a_rank_error_leaves_the_notebooks_model_and_optimizer_untouched(shell):
    ns = _setup(shell)
    dp_cell(shell, FSDP2, TRAIN)                  # the ranks now hold shards, the notebook the weights
    before = copy.deepcopy(ns["model"].state_dict())
    opt_before = copy.deepcopy(ns["opt"].state_dict())
    pids = list(dp_pool().pids)
    failing = TRAIN + ("import torch.distributed as dist\n"
                       "if dist.get_rank() == 1:\n    raise ValueError('rank one fails')\n")
    with pytest.raises(WorkerError) as err:
        dp_cell(shell, FSDP2, failing)
    assert (err.value.rank, err.value.exc_type) == (1, "ValueError")
    assert wait_dead(pids) == []
    for k, v in ns["model"].state_dict().items():
        assert torch.equal(v, before[k]), k
    for idx, st in ns["opt"].state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, opt_before["state"][idx][k]), (idx, k)
    # a fresh pool trains from the notebook's state, as one process would
    ref_model, ref_opt, _ = _reference(ns, epochs=2)
    dp_cell(shell, FSDP2, TRAIN)
    assert dp_pool().pids != pids
    _assert_close_state(ns["model"], ns["opt"], ref_model, ref_opt)


def _shared_state(opt) -> list:
    return [(idx, k) for idx, st in opt.state_dict()["state"].items() for k, v in st.items()
            if isinstance(v, torch.Tensor) and v.dim() and v.is_shared()]


@pytest.mark.parametrize("ending", ["error", "interrupt"])
def test_a_failed_cell_leaves_the_optimizers_state_in_the_notebooks_own_memory(shell, tmp_path, ending):
    # The cell moves the optimizer's state into shared memory for the ranks; however it ends, that state is
    # the notebook's own again (a later %%sharedtrain cell would otherwise take it as shared on purpose)
    from tests.dataparallel_helpers import interrupt_once_training
    ns = _setup(shell)
    dp_cell(shell, FSDP2, TRAIN)
    opt = ns["opt"]
    assert _shared_state(opt) == [] and len(opt.state) == len(list(ns["model"].parameters()))
    before = copy.deepcopy(opt.state_dict())
    marker = tmp_path / "training"
    failing = TRAIN + f"open({str(marker)!r}, 'w').close()\n" + (
        "import torch.distributed as dist\nif dist.get_rank() == 1:\n    raise ValueError('rank one fails')\n"
        if ending == "error" else "import time\nwhile True:\n    time.sleep(0.05)\n")
    if ending == "error":
        with pytest.raises(WorkerError):
            dp_cell(shell, FSDP2, failing)
    else:
        interrupt_once_training(shell, FSDP2, failing, marker)
    assert _shared_state(opt) == []
    for idx, st in opt.state_dict()["state"].items():   # and as it was before the cell
        for k, v in st.items():
            assert torch.equal(v, before["state"][idx][k]), (idx, k)
    assert all(p.is_shared() for p in ns["model"].parameters())   # (the model stays in shared memory)


def test_autocast_in_the_cell_gathers_weights_in_its_dtype(shell):
    ns = _setup(shell)
    ref = copy.deepcopy(ns["model"])
    start = copy.deepcopy(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    for _ in range(2):
        for x, y in ns["loader"]:
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ((ref(x) - y) ** 2).mean()
            loss.backward()
            ref_opt.step()
    body = TRAIN.replace("        loss = ((model(x) - y) ** 2).mean()\n",
                         "        with torch.autocast('cpu', dtype=torch.bfloat16):\n"
                         "            loss = ((model(x) - y) ** 2).mean()\n"
                         "        low = model.blocks[0].fc.weight.dtype\n")
    _, cap = dp_cell(shell, FSDP2, body)
    assert "under autocast(bfloat16): parameters are gathered in bfloat16, gradients reduced in float32" \
        in cap.stderr
    assert all(p.dtype == torch.float32 for p in ns["model"].parameters())   # the sharded master weights
    # bf16 matmuls either way: the same training to bf16's precision (Adam's sign-like steps amplify
    # rounding in the smallest gradients, so compare how far each tensor moved, not elementwise)
    for (name, a), b in zip(ns["model"].state_dict().items(), ref.state_dict().values()):
        moved = (b - start[name]).norm()
        assert (a - b).norm() < 0.1 * moved, name


def test_an_interrupt_while_the_weights_are_written_back_is_said(shell, capsys):
    import types

    from gpumagic.dataparallel.kernel import train
    from gpumagic.dataparallel.kernel.notebook import Notebook
    from gpumagic.dataparallel.protocol import CellCode, Writing
    from gpumagic.dataparallel.ranks.kept import Kept, Sharded
    from gpumagic.procs.relays import Relays

    class Ranks:   # rank 0 has started writing into the notebook's tensors when the interrupt comes
        devices, kept = ["cpu", "cpu"], Kept({("key",)}, Sharded())

        def run(self, task, meta, data, on_output, on_message, on_tick):
            on_message(0, Writing())
            raise KeyboardInterrupt

        def interrupted_note(self) -> str:
            return "interrupted"

    ranks = Ranks()
    order = types.SimpleNamespace(all_output=False, code=CellCode(None, "<cell>", ""))
    read = types.SimpleNamespace(notebook=Notebook.of(shell), ns=shell.user_ns,
                                 strategy=types.SimpleNamespace(splits=True))
    with pytest.raises(KeyboardInterrupt):
        train._run_on(ranks, order, None, read, Relays())
    assert "stopped while rank 0 was writing the trained state into the notebook's tensors" in capsys.readouterr().err
    assert ranks.kept.sharded is None and ranks.kept.tensors == set()   # the next cell ships everything again


def test_an_interrupt_while_the_state_moves_into_shared_memory_leaves_none_there(shell, monkeypatch):
    import types

    from gpumagic.dataparallel.kernel.notebook import Notebook
    from gpumagic.dataparallel.kernel.read import read_cell
    from gpumagic.dataparallel.plan import make_plan
    from gpumagic.dataparallel.ranks.kept import Kept
    from gpumagic.procs import bulk
    ns = _setup(shell)
    model, opt = ns["model"], ns["opt"]
    model(ns["X"]).sum().backward()
    opt.step()                                  # state for every parameter, in the notebook's own memory
    real, calls = bulk.share_in_place, []

    def share_then_interrupt(tensors):
        calls.append(1)
        if len(calls) == 2:   # the optimizer's state moved, then the interrupt
            raise KeyboardInterrupt
        return real(tensors)
    monkeypatch.setattr(bulk, "share_in_place", share_then_interrupt)
    ranks = types.SimpleNamespace(kept=Kept())
    plan = make_plan(strategy="fsdp", nprocs=2, gpus=[])
    read = read_cell(Notebook.of(shell), TRAIN, plan, "%%dataparallel --strategy fsdp")
    read.strategy.check_cell(read)
    with pytest.raises(KeyboardInterrupt):
        read.strategy.before(read, ranks)
    assert len(calls) == 2 and _shared_state(opt) == []
