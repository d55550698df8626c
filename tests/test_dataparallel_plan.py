"""Planning a %%dataparallel cell (gpumagic.dataparallel.plan): devices, the strategy with its own options,
backend, bad options."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from gpumagic.dataparallel.plan import make_plan
from gpumagic.dataparallel.strategies.ddp import Ddp
from gpumagic.dataparallel.strategies.dp import Dp
from gpumagic.dataparallel.strategies.fsdp import Fsdp
from gpumagic.dataparallel.strategies.launch import Launch


def test_plan_picks_cpu_processes_without_gpus():
    plan = make_plan(nprocs=3, gpus=[])
    assert (plan.strategy, plan.devices, plan.backend) == (Ddp(), ["cpu"] * 3, "gloo")
    assert make_plan(gpus=[]).devices == ["cpu", "cpu"]
    dp = make_plan(strategy="dp", gpus=[])
    assert dp.devices == ["cpu"] and isinstance(dp.strategy, Dp)


def test_gpus_a_cpu_only_torch_cannot_use_hold_no_ranks(monkeypatch):
    from gpumagic import devices
    from gpumagic.devices import Gpu
    gpus = [Gpu(0, "GPU-a", None, "Fake GPU"), Gpu(1, "GPU-b", None, "Fake GPU")]
    monkeypatch.setattr(devices, "torch_cpu_only", lambda: True)
    plan = make_plan(gpus=gpus)
    assert (plan.devices, plan.backend) == (["cpu", "cpu"], "gloo")
    with pytest.raises(UsageError, match=r"--devices cuda:0,cuda:1: GPUs are not usable by this torch .*"
                                         r"valid choices: cpu"):
        make_plan(devices="cuda:0,cuda:1", gpus=gpus)


@pytest.mark.parametrize("kwargs, says", [
    (dict(nprocs=0), "--nprocs 1"),
    (dict(devices="tpu"), "valid choices: cpu"),
    (dict(devices="cuda:3"), "cpu"),
    (dict(backend="nccl"), "gloo"),
    (dict(strategy="horovod"), "ddp, fsdp, dp"),
    (dict(devices="cpu", nprocs=2, timeout=-1), "positive"),
])
def test_plan_rejects_bad_input_naming_what_works(kwargs, says):
    with pytest.raises(UsageError) as err:
        make_plan(gpus=[], **kwargs)
    assert says in str(err.value)


# --- launch mode: options of gpumagic's DDP wrapper do not apply --------------------------------------

@pytest.mark.parametrize("kwargs, flags", [
    (dict(compile="default"), "--compile"),
    (dict(static_graph=True), "--static-graph"),
    (dict(find_unused=True), "--find-unused"),
    (dict(grad_dtype="bf16"), "--grad-dtype"),
    (dict(bucket_mb=25), "--bucket-mb"),
    (dict(static_graph=True, bucket_mb=50, grad_dtype="bf16", compile="default"),
     "--static-graph, --bucket-mb, --grad-dtype, --compile"),
])
def test_launch_refuses_the_ddp_wrapper_options_naming_them(kwargs, flags):
    with pytest.raises(UsageError) as err:
        make_plan(launch=True, gpus=[], **kwargs)
    verb = "configure" if "," in flags else "configures"
    assert str(err.value).startswith(f"{flags} {verb} gpumagic's DDP wrapper, and with --launch the cell's own")
    assert "valid choices: --devices, --nprocs" in str(err.value)
    plan = make_plan(gpus=[], **kwargs)               # without --launch they are fine...
    with pytest.raises(UsageError, match=f"^{flags} configures? .* in launch mode \\(the cell builds a Lightning"):
        plan.strategy.for_launch("the cell builds a Lightning Trainer (L.Trainer)", plan.devices)   # ...until launch


def test_launch_plan_keeps_the_options_that_apply():
    plan = make_plan(launch=True, gpus=[], nprocs=2, timeout=60, seed=3, all_output=True, models="net")
    assert (plan.strategy, plan.devices, plan.backend, plan.timeout, plan.seed, plan.all_output, plan.models) == (
        Launch("--launch"), ["cpu", "cpu"], "gloo", 60.0, 3, True, ["net"])
    assert isinstance(make_plan(gpus=[]).strategy, Ddp)


def test_launch_with_strategy_dp_is_refused():
    with pytest.raises(UsageError) as err:
        make_plan(strategy="dp", launch=True, gpus=[])
    assert str(err.value) == ("--launch runs the cell in worker processes, as torchrun would; --strategy dp runs it "
                              "in the kernel; valid choices: --strategy ddp --launch, --strategy dp")


@pytest.mark.parametrize("devices", [["cuda:1"], ["cuda:1", "cuda:0"], ["cuda:0", "cuda:2"]])
def test_launch_needs_gpus_cuda0_to_n_in_order(devices):
    with pytest.raises(UsageError) as err:
        Ddp().for_launch("--launch", devices)
    text = str(err.value)
    assert text.startswith(f"--devices {','.join(devices)}: with --launch, rank k uses GPU LOCAL_RANK=k")
    assert "cuda:0 to cuda:N-1 in order" in text and "CUDA_VISIBLE_DEVICES" in text
    n = len(devices)
    assert text.endswith(f"valid choices: --nprocs {n}, {','.join(f'cuda:{i}' for i in range(n))}")


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:1"], ["cpu", "cpu", "cpu"]])
def test_launch_accepts_gpus_in_order_and_cpu_ranks(devices):
    assert Ddp().for_launch("--launch", devices) == Launch("--launch")


# --- --strategy fsdp ---------------------------------------------------------------------------------

def test_fsdp_plan_has_worker_processes_and_its_options():
    plan = make_plan(strategy="fsdp", wrap="Block, Head", keep_optimizer=True, gpus=[])
    assert (plan.strategy, plan.devices, plan.backend) == (Fsdp(["Block", "Head"], True), ["cpu", "cpu"], "gloo")
    assert plan.strategy.processes and make_plan(strategy="fsdp", gpus=[]).strategy.wrap is None


@pytest.mark.parametrize("kwargs, says", [
    (dict(strategy="ddp", wrap="Block"), "--wrap configure(s) the sharding of --strategy fsdp"),
    (dict(strategy="dp", keep_optimizer=True), "--keep-optimizer"),
    (dict(strategy="fsdp", wrap=" , "), "--wrap is empty"),
    (dict(strategy="fsdp", static_graph=True), "--static-graph with --strategy fsdp"),
    (dict(strategy="fsdp", compile="default"), "--compile with --strategy fsdp"),
    (dict(strategy="fsdp", grad_dtype="bf16"), "--grad-dtype with --strategy fsdp"),
    (dict(strategy="fsdp", launch=True), "--launch runs the cell's own distribution"),
    (dict(strategy="fsdp", cluster="started"), "--cluster: the engines run --strategy ddp"),
])
def test_fsdp_options_are_checked_before_anything_starts(kwargs, says):
    with pytest.raises(UsageError) as err:
        make_plan(gpus=[], **kwargs)
    assert says in str(err.value)
    assert "valid choices" in str(err.value)


# --- --cluster: the engines are the ranks -------------------------------------------------------------

def test_cluster_plan_leaves_devices_to_the_engines():
    plan = make_plan(cluster="myprofile", nprocs=4, gpus=[])
    assert (plan.cluster, plan.nprocs, plan.devices, plan.strategy) == ("myprofile", 4, [], Ddp())


@pytest.mark.parametrize("kwargs, says", [
    (dict(strategy="dp"), "--cluster: the engines run --strategy ddp (and launch mode); --strategy dp"),
    (dict(devices="cpu"), "--devices names this machine's"),
    (dict(oversubscribe=True), "--oversubscribe is about this machine's cores"),
    (dict(cluster=""), "--cluster: name the cluster"),
])
def test_cluster_plan_refuses_this_machines_options(kwargs, says):
    kwargs = {"cluster": "started", **kwargs}
    with pytest.raises(UsageError) as err:
        make_plan(gpus=[], **kwargs)
    assert says in str(err.value) and "valid choices" in str(err.value)


@pytest.mark.parametrize("given, flag", [(dict(seed=3), "--seed"), (dict(timeout=60), "--timeout"),
                                         (dict(all_output=True), "--all-output"),
                                         (dict(static_graph=True), "--static-graph"),
                                         (dict(bucket_mb=50), "--bucket-mb")])
def test_options_of_worker_processes_are_refused_with_strategy_dp(given, flag):
    with pytest.raises(UsageError) as err:
        make_plan(strategy="dp", gpus=[], **given)
    assert str(err.value) == (f"{flag} applies to worker processes (--strategy ddp or fsdp); --strategy dp runs "
                              f"the cell in the kernel; valid choices: --strategy ddp {flag}, --strategy dp")


def test_each_strategy_owns_its_options():
    plan = make_plan(gpus=[], static_graph=True, bucket_mb=50, grad_dtype="BF16", compile="reduce-overhead")
    assert plan.strategy == Ddp(static_graph=True, bucket_mb=50, grad_dtype="bf16", compile="reduce-overhead")
    assert Ddp.OPTIONS == ("static_graph", "find_unused", "bucket_mb", "grad_dtype", "compile")
    assert Fsdp.OPTIONS == ("wrap", "keep_optimizer") and Dp.OPTIONS == ()
    with pytest.raises(UsageError, match="valid choices: default, reduce-overhead"):
        make_plan(gpus=[], compile="fast")
