"""What a %%dataparallel cell did, bound in the notebook as ``dataparallel`` (as %%sharedtrain binds ``sharedtrain``),
and the same training from plain Python (gpumagic.dataparallel.kernel.train.train_parallel), on two CPU ranks."""
from __future__ import annotations

import copy

import pytest
import torch
from IPython.core.error import UsageError

from gpumagic.dataparallel.kernel.result import DataParallelResult
from gpumagic.dataparallel.kernel.train import train_parallel
from gpumagic.dataparallel.protocol import RankStats
from tests.dataparallel_helpers import REGRESSION, dp_cell, notebook_from, trained_in_one_process

CELL = ("for x, y in loader:\n"
        "    opt.zero_grad(); loss = ((model(x) - y) ** 2).mean(); loss.backward(); opt.step()\n"
        "    losses.append(loss.item())\n"
        "loss.item()\n")


def _namespace() -> dict:
    ns: dict = {}
    exec(REGRESSION + "losses = []\n", ns)
    return ns


def test_the_magic_binds_what_the_cell_did_as_dataparallel(shell):
    ns = notebook_from(shell, REGRESSION + "losses = []\n")
    value, cap = dp_cell(shell, "--nprocs 2", CELL)
    result = ns["dataparallel"]
    assert isinstance(result, DataParallelResult) and result.value == value == ns["losses"][-1]
    assert result.per_rank == {0: RankStats(steps=4, samples=16, seconds=result.per_rank[0].seconds, backwards=4,
                                            first_step=result.per_rank[0].first_step),
                               1: RankStats(steps=4, samples=16, seconds=result.per_rank[1].seconds, backwards=4,
                                            first_step=result.per_rank[1].first_step)}
    assert result.summary() in cap.stderr and "losses" in result.values
    # a cell that fails leaves the notebook as it was, the last result with it
    with pytest.raises(UsageError):
        dp_cell(shell, "--nprocs 2", "z = 1\n")
    assert ns["dataparallel"] is result


def test_train_parallel_trains_a_plain_namespace_as_the_magic_does(shell):
    ns = _namespace()
    model, opt, losses = ns["model"], ns["opt"], ns["losses"]
    reference = trained_in_one_process(ns)
    result = train_parallel(ns, CELL, nprocs=2, seed=0)
    assert isinstance(result, DataParallelResult) and "dataparallel" not in ns   # returned, not bound
    assert ns["model"] is model and ns["opt"] is opt and ns["losses"] is losses and len(losses) == 4
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert result.value == losses[-1] and [s.steps for s in result.per_rank.values()] == [4, 4]
    assert result.devices == ["cpu", "cpu"] and result.backend == "gloo"


def test_train_parallel_takes_the_magics_options_by_their_python_names(shell):
    ns = _namespace()
    before = copy.deepcopy(ns["model"])
    result = train_parallel(ns, CELL, strategy="dp", model="model")
    assert result.devices == ["cpu"] and result.modules == ["model"] and result.calls == 4   # in this process
    assert any(not torch.equal(a, b) for a, b in zip(ns["model"].parameters(), before.parameters()))
    with pytest.raises(UsageError, match="--wrap configure"):
        train_parallel(_namespace(), CELL, nprocs=2, wrap="Block")
    with pytest.raises(TypeError, match="IPython shell or a namespace dict"):
        train_parallel([], CELL, nprocs=2)


def test_the_help_shows_each_strategys_options_in_a_group_of_its_own(shell):
    help_text = shell.magics_manager.magics["cell"]["dataparallel"].__doc__
    groups = ["--strategy ddp (the default): gpumagic's DDP wrapper:",
              "--strategy fsdp: the model's parameters, gradients and optimizer state sharded over the ranks:",
              "launch mode: the cell's framework distributes:",
              "--cluster: the ranks are the engines of an ipyparallel cluster:"]
    at = [help_text.index(g) for g in groups]
    assert at == sorted(at)
    sections = dict(zip(groups, [help_text[a:b] for a, b in zip(at, at[1:] + [len(help_text)])]))
    assert all(f in sections[groups[0]] for f in ("--static-graph", "--find-unused", "--bucket-mb", "--grad-dtype",
                                                  "--compile"))
    assert "--wrap" in sections[groups[1]] and "--keep-optimizer" in sections[groups[1]]
    assert "--launch" in sections[groups[2]] and "--engines" in sections[groups[3]]
    assert help_text.index("--timeout") < at[0]   # the options every strategy takes come first
