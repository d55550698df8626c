"""Planning a %%dataparallel cell (gpumagic.dataparallel.plan): devices, strategy, backend, bad options."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from gpumagic.dataparallel.plan import make_plan


def test_plan_picks_cpu_processes_without_gpus():
    plan = make_plan(nprocs=3, gpus=[])
    assert (plan.strategy, plan.devices, plan.backend) == ("ddp", ["cpu"] * 3, "gloo")
    assert make_plan(gpus=[]).devices == ["cpu", "cpu"]
    assert make_plan(strategy="dp", gpus=[]).devices == ["cpu"]


@pytest.mark.parametrize("kwargs, says", [
    (dict(nprocs=0), "--nprocs 1"),
    (dict(devices="tpu"), "valid choices: cpu"),
    (dict(devices="cuda:3"), "cpu"),
    (dict(backend="nccl"), "gloo"),
    (dict(strategy="horovod"), "ddp, dp"),
    (dict(devices="cpu", nprocs=2, timeout=-1), "positive"),
])
def test_plan_rejects_bad_input_naming_what_works(kwargs, says):
    with pytest.raises(UsageError) as err:
        make_plan(gpus=[], **kwargs)
    assert says in str(err.value)
