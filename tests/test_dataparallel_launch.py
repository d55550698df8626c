"""Launch mode on a rank (gpumagic.dataparallel.strategies.launch_rank): torchrun's environment, kernel-made
TrainingArguments resolved again, Lightning's process-starting launchers run in place."""
from __future__ import annotations

import ast
import gc
import inspect
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from gpumagic.dataparallel.strategies import launch_rank as launchmod
from gpumagic.dataparallel.strategies.launch_rank import (
    forget_kernel_process,
    launched,
    run_lightning_launchers_in_place,
    torchrun_environment,
)
from gpumagic.procs.rendezvous import free_loopback_port
from tests.conftest import ROOT

REQUIRED = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
            "GROUP_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"}


def agent_worker_env_keys() -> set[str]:
    """The variables the installed torch's LocalElasticAgent puts in every worker's environment, read from its
    source: the ``worker_env`` dict literal of ``_start_workers``, and what ``_set_local_rank_env`` always sets."""
    from torch.distributed.elastic.agent.server import local_elastic_agent as agent
    keys: set[str] = set()
    start = ast.parse(textwrap.dedent(inspect.getsource(agent.LocalElasticAgent._start_workers)))
    for node in ast.walk(start):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                isinstance(t, ast.Name) and t.id == "worker_env" for t in node.targets):
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    local = ast.parse(textwrap.dedent(inspect.getsource(agent.LocalElasticAgent._set_local_rank_env)))
    for node in ast.walk(local):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    keys.discard("CUDA_VISIBLE_DEVICES")   # only in virtual-local-rank mode, or passed through as it was
    return keys


@pytest.fixture
def launchers_restored(monkeypatch):
    """Whatever run_lightning_launchers_in_place does to this process is undone after the test."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in launchmod._LAUNCHER_MODULES:
        if name in sys.modules:
            cls = sys.modules[name]._MultiProcessingLauncher
            monkeypatch.setattr(cls, "launch", cls.__dict__["launch"])
    return monkeypatch


@pytest.fixture
def lightning_launchers(monkeypatch):
    """Lightning's two _MultiProcessingLauncher classes, restored after the test."""
    pytest.importorskip("lightning")
    from lightning.fabric.strategies.launchers import multiprocessing as fabric_mp
    from lightning.pytorch.strategies.launchers import multiprocessing as pl_mp
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    classes = [pl_mp._MultiProcessingLauncher, fabric_mp._MultiProcessingLauncher]
    for name in launchmod._LAUNCHER_MODULES:
        if name in sys.modules and sys.modules[name]._MultiProcessingLauncher not in classes:
            classes.append(sys.modules[name]._MultiProcessingLauncher)
    for cls in classes:
        monkeypatch.setattr(cls, "launch", cls.__dict__["launch"])
    return classes


# --- torchrun's environment -----------------------------------------------------------------------

def test_torchrun_environment_for_one_rank(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert torchrun_environment(1, 4, 29511, "run-7") == {
        "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "ROLE_RANK": "1", "ROLE_NAME": "default",
        "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "ROLE_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "run-7",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")   # the kernel's own value is kept, as torchrun does
    assert torchrun_environment(1, 4, 29511, "run-7")["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    on_cpu = torchrun_environment(0, 2, 1234, "r", master_addr="10.0.0.5", on_cpu=True)
    assert on_cpu["ACCELERATE_USE_CPU"] == "true"
    assert (on_cpu["MASTER_ADDR"], on_cpu["RANK"], on_cpu["WORLD_SIZE"]) == ("10.0.0.5", "0", "2")


def test_torchrun_environment_has_what_the_elastic_agent_sets():
    agent = agent_worker_env_keys()
    assert REQUIRED <= agent, "the installed torch's agent no longer sets some of these: update REQUIRED"
    ours = set(torchrun_environment(0, 2, 29500, "r"))
    assert REQUIRED <= ours
    # A variable a newer torch's agent adds fails here.
    assert agent <= ours


def test_torchrun_environment_sets_nccl_async_error_handling_as_torchrun_does():
    assert agent_worker_env_keys() <= set(torchrun_environment(0, 2, 29500, "r"))


# --- launched(): set during the block, restored exactly after -------------------------------------

def test_launched_sets_the_environment_and_restores_it(launchers_restored):
    mp = launchers_restored
    mp.setenv("RANK", "7")
    mp.setenv("MASTER_PORT", "1111")
    mp.setenv("OMP_NUM_THREADS", "3")
    for name in ("LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU", "GROUP_RANK"):
        mp.delenv(name, raising=False)
    before = dict(os.environ)
    with launched(rank=1, world_size=2, master_port=29555, run_id="gm-1", on_cpu=True):
        inside = dict(os.environ)
    assert dict(os.environ) == before
    expected = torchrun_environment(1, 2, 29555, "gm-1", on_cpu=True)
    assert {k: inside.get(k) for k in expected} == expected
    assert inside["ACCELERATE_USE_CPU"] == "true"
    assert inside["OMP_NUM_THREADS"] == "3"        # the worker's own share, kept
    assert {k: v for k, v in inside.items() if k not in expected} == \
        {k: v for k, v in before.items() if k not in expected}


def test_launched_restores_the_environment_after_an_exception(launchers_restored):
    mp = launchers_restored
    mp.setenv("WORLD_SIZE", "9")
    mp.delenv("RANK", raising=False)
    mp.delenv("ACCELERATE_USE_CPU", raising=False)
    before = dict(os.environ)
    with pytest.raises(ZeroDivisionError):
        with launched(rank=0, world_size=2, master_port=29556, run_id="gm-2", on_cpu=True):
            assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "2")
            1 / 0   # noqa: B018
    assert dict(os.environ) == before
    assert "RANK" not in os.environ and os.environ["WORLD_SIZE"] == "9"


def test_what_a_launch_cell_set_in_the_environment_ends_with_it(launchers_restored):
    # accelerate's FSDP plugin sets ACCELERATE_USE_FSDP=true: the next cell's Accelerator (a fresh
    # torchrun process under torchrun) must not find it
    mp = launchers_restored
    mp.setenv("KEPT_FROM_BEFORE", "1")
    mp.delenv("ACCELERATE_USE_FSDP", raising=False)
    before = dict(os.environ)
    with launched(rank=0, world_size=2, master_port=29557, run_id="gm-3", on_cpu=True):
        os.environ["ACCELERATE_USE_FSDP"] = "true"
        os.environ["KEPT_FROM_BEFORE"] = "changed"
        del os.environ["KEPT_FROM_BEFORE"]
    assert dict(os.environ) == before


def test_launched_sets_accelerate_use_cpu_only_on_cpu(launchers_restored):
    mp = launchers_restored
    mp.delenv("ACCELERATE_USE_CPU", raising=False)
    with launched(rank=0, world_size=1, master_port=29557, run_id="gm-3", on_cpu=False):
        assert "ACCELERATE_USE_CPU" not in os.environ
        assert os.environ["LOCAL_RANK"] == "0"
    mp.setenv("ACCELERATE_USE_CPU", "false")   # the kernel's own setting is left alone on GPU ranks
    with launched(rank=0, world_size=1, master_port=29557, run_id="gm-3", on_cpu=False):
        assert os.environ["ACCELERATE_USE_CPU"] == "false"
    with launched(rank=0, world_size=1, master_port=29557, run_id="gm-3", on_cpu=True):
        assert os.environ["ACCELERATE_USE_CPU"] == "true"
    assert os.environ["ACCELERATE_USE_CPU"] == "false"


def test_launched_gives_omp_num_threads_where_unset(launchers_restored):
    launchers_restored.delenv("OMP_NUM_THREADS", raising=False)
    with launched(rank=0, world_size=2, master_port=29558, run_id="gm-4", on_cpu=True):
        assert os.environ["OMP_NUM_THREADS"] == str(torch.get_num_threads())
    assert "OMP_NUM_THREADS" not in os.environ


# --- TrainingArguments made in the kernel ---------------------------------------------------------

TRAINING_ARGUMENTS_RANK = """\
import json, sys
import torch.distributed as dist
from transformers import TrainingArguments
from gpumagic.dataparallel.strategies.launch_rank import forget_kernel_process, launched
rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
args = TrainingArguments(output_dir=outdir, report_to=[])     # made "in the kernel": one process
out = {"before": [args.world_size, args.process_index, args.parallel_mode.value, "_setup_devices" in vars(args)],
       "group_before": dist.is_initialized()}
ns = {"args": args, "n": 3, "text": "x"}
with launched(rank, world, port, "ta-run", on_cpu=True):
    out["refreshed"] = forget_kernel_process(ns)
    out["cached"] = "_setup_devices" in vars(args)
    out["inside"] = [args.world_size, args.process_index, args.parallel_mode.value, args.device.type,
                     dist.get_world_size(), dist.get_rank(), dist.get_backend()]
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_kernel_training_arguments_see_the_rank_they_run_in(tmp_path):
    """Two real processes: arguments made before launched() count one process; forget_kernel_process inside
    it works their device out again, and accelerate forms the group through MASTER_ADDR:MASTER_PORT (with no
    process group at all, PartialState would form one, so this cannot be checked in a single process)."""
    pytest.importorskip("transformers")
    port = free_loopback_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-c", TRAINING_ARGUMENTS_RANK, str(r), "2", str(port),
                               str(tmp_path / f"out{r}")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    for rank, got in enumerate(results):
        assert got["before"] == [1, 0, "not_parallel", True]
        assert got["group_before"] is False
        assert got["refreshed"] == ["args"]
        assert got["cached"] is True
        assert got["inside"] == [2, rank, "distributed", "cpu", 2, rank, "gloo"]


def test_forget_kernel_process_leaves_other_values_alone():
    class TrainingArguments:      # the name alone is not enough: it must be transformers'
        _setup_devices = "cpu"
    value = TrainingArguments()
    value.__dict__["_setup_devices"] = "cuda:0"
    ns = {"args": value, "n": 1, "f": len}
    assert forget_kernel_process(ns) == []
    assert value.__dict__["_setup_devices"] == "cuda:0"


# --- Lightning's launchers ------------------------------------------------------------------------

def stub_launcher(cls, externally: bool | None):
    launcher = cls.__new__(cls)
    environment = None if externally is None else types.SimpleNamespace(creates_processes_externally=externally)
    launcher._strategy = types.SimpleNamespace(cluster_environment=environment)
    return launcher


def test_lightning_launchers_run_in_place_when_processes_exist(lightning_launchers):
    for cls in lightning_launchers:
        calls: list = []

        def spawning(self, function, *args, calls=calls, **kwargs):
            calls.append((self, function, args, kwargs))
            return "spawned"

        cls.launch = spawning
        run_lightning_launchers_in_place()
        patched = cls.__dict__["launch"]
        assert patched._gpumagic_in_place is True
        run_lightning_launchers_in_place()
        assert cls.__dict__["launch"] is patched          # patched once
        trainer = object()

        def fit(a, b=0):
            return ("ran", os.getpid(), a, b)

        here = stub_launcher(cls, True)
        assert here.launch(fit, 1, b=2, trainer=trainer) == ("ran", os.getpid(), 1, 2)
        assert calls == []
        for externally in (False, None):
            elsewhere = stub_launcher(cls, externally)
            assert elsewhere.launch(fit, 1, b=2, trainer=trainer) == "spawned"
            assert calls[-1] == (elsewhere, fit, (1,), {"b": 2, "trainer": trainer})
        assert len(calls) == 2


def test_lightning_environment_under_launched_runs_in_place(lightning_launchers, monkeypatch):
    """With the real LightningEnvironment: torchrun's LOCAL_RANK makes it say processes exist."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cls = lightning_launchers[0]
    launcher = cls.__new__(cls)
    launcher._strategy = types.SimpleNamespace(cluster_environment=LightningEnvironment())
    spawned = []
    monkeypatch.setattr(cls, "launch", lambda self, function, *a, **k: spawned.append(function))
    with launched(rank=0, world_size=1, master_port=free_loopback_port(), run_id="lt", on_cpu=True):
        assert launcher.launch(lambda: "in place") == "in place"
    assert spawned == []
    assert launcher.launch(print) is None        # outside: the original, which would start processes
    assert spawned == [print]


IMPORT_HOOK = """\
import json, os, sys, types
from gpumagic.dataparallel.strategies import launch_rank as launch
names = ["lightning.pytorch.strategies.launchers.multiprocessing",
         "lightning.fabric.strategies.launchers.multiprocessing"]
launch.run_lightning_launchers_in_place()
before = [n in sys.modules for n in names]
import lightning.pytorch.strategies.launchers.multiprocessing   # imported after the call
out = {"before": before, "patched": []}
for n in names:
    cls = sys.modules[n]._MultiProcessingLauncher
    launcher = cls.__new__(cls)
    launcher._strategy = types.SimpleNamespace(
        cluster_environment=types.SimpleNamespace(creates_processes_externally=True))
    out["patched"].append([getattr(cls.launch, "_gpumagic_in_place", False),
                           launcher.launch(lambda x, **kw: [x, sorted(kw), os.getpid()], 5, trainer="t")])
out["pid"] = os.getpid()
print(json.dumps(out))
"""


def test_lightning_launchers_imported_later_are_patched_on_import():
    pytest.importorskip("lightning")
    proc = subprocess.run([sys.executable, "-c", IMPORT_HOOK], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] == [False, False]
    # kwargs.pop("trainer"): the function gets no trainer, as under torchrun's launcher.
    assert out["patched"] == [[True, [5, [], out["pid"]]], [True, [5, [], out["pid"]]]]


# --- whether a launch-mode cell distributed anything -------------------------------------------------

def test_distribution_watch_counts_ddp_wrapping_and_restores_init(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    from gpumagic.dataparallel.strategies.launch_rank import DistributionWatch
    original, fsdp_original = DistributedDataParallel.__init__, FullyShardedDataParallel.__init__
    model = torch.nn.Linear(2, 2)
    with DistributionWatch() as idle:
        model(torch.randn(1, 2)).sum().backward()
    assert (idle.wrapped, idle.distributed([model])) == (0, False)
    assert DistributedDataParallel.__init__ is original
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(KeyError), DistributionWatch() as watch:
            ddp = DistributedDataParallel(model)
            ddp(torch.randn(1, 2)).sum().backward()
            raise KeyError("the cell fails after wrapping")
    finally:
        # The DDP object goes before its group: a gloo group destroyed under a live DDP object can
        # block that object's collection later (see gpumagic.procs.process_group).
        ddp = None
        gc.collect()
        dist.destroy_process_group()
    assert DistributedDataParallel.__init__ is original
    assert FullyShardedDataParallel.__init__ is fsdp_original
    assert watch.wrapped == 1 and watch.distributed([model]) is True
