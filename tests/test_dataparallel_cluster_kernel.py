"""A cluster started in a real Jupyter kernel ends with the kernel, however Jupyter ends it.

Once a local ``%%dataparallel`` pool has run, multiprocessing's resource tracker
is the kernel's child; it ignores SIGTERM, so ipykernel's shutdown waits on it
and Jupyter SIGTERMs the kernel before its exit hooks run. The cluster's
watcher (gpumagic.dataparallel.ranks.cluster_watch) stops the controller and engines
then; ``%dataparallel cluster stop`` releases it.
"""
from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from tests.cluster_helpers import descendants, describe, wait_gone
from tests.conftest import ROOT

pytest.importorskip("ipyparallel")

START = "%load_ext gpumagic\n%dataparallel cluster start --engines local -n 2"
CLUSTER_PIDS = """
import json as _json
from gpumagic.dataparallel.ranks import cluster_setup as _cs
_d = _json.load(open(_cs._started.cluster.cluster_file))
_pids = [_d["controller"]["state"]["pid"]] + [e["pid"] for s in _d["engines"]["sets"].values()
                                               for e in s["engines"].values()]
"""
LOCAL_CELL = """
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1)),
                                     batch_size=8)
"""
TRAIN = ("%%dataparallel --nprocs 2\nfor x, y in loader:\n"
         "    opt.zero_grad(); ((model(x) - y) ** 2).mean().backward(); opt.step()\n")


def _watchers() -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if "gpumagic.dataparallel.ranks.cluster_watch" in " ".join(p.info["cmdline"] or []):
            out.append(p.pid)
    return out


def _run(kc, code: str, timeout: float = 180) -> dict:
    reply = kc.execute_interactive(code, timeout=timeout, user_expressions={"pids": "_pids"} if "_pids" in code
                                   else None)
    assert reply["content"]["status"] == "ok", reply["content"]
    return reply["content"]


@pytest.mark.parametrize("ending", ["shutdown", "cluster stop"])
def test_a_cluster_started_in_the_kernel_ends_with_it(tmp_path, monkeypatch, ending):
    from jupyter_client.manager import start_new_kernel
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    watchers_before = set(_watchers())
    km, kc = start_new_kernel(kernel_name="python3", cwd=ROOT)
    cluster: set = set()
    try:
        _run(kc, START)
        got = _run(kc, CLUSTER_PIDS)["user_expressions"]["pids"]["data"]["text/plain"]
        for pid in json.loads(got):
            cluster |= descendants(pid)
        assert len(cluster) >= 3 and set(_watchers()) - watchers_before
        _run(kc, LOCAL_CELL)
        _run(kc, TRAIN)                   # starts the resource tracker that stalls ipykernel's shutdown
        if ending == "cluster stop":
            _run(kc, "%dataparallel cluster stop")
            assert wait_gone(cluster, timeout=30) == [], describe(cluster)
        started = time.monotonic()
        km.shutdown_kernel(now=False)     # what Jupyter's "Shut down" and "Restart" do
        left = wait_gone(cluster, timeout=30)
        assert left == [], f"after {time.monotonic() - started:.0f} s: {describe(left)}"
        assert wait_gone(set(_watchers()) - watchers_before, timeout=10) == []
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        for pid in wait_gone(cluster, timeout=1):
            psutil.Process(pid).kill()


def _cluster_processes(ipython_dir) -> list[int]:
    """Every process ipyparallel launched for a profile under ``ipython_dir``, whoever its parent is now."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("IPP_PROFILE_DIR", "").startswith(str(ipython_dir)):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_a_kernel_killed_while_its_cluster_starts_leaves_nothing(tmp_path, monkeypatch):
    # killed (as by the OOM killer, or a hard restart) once the engines are starting: the watcher, started
    # before the cluster, stops the controller, its schedulers and the engines, recorded by ipyparallel or not
    import signal

    from jupyter_client.manager import start_new_kernel
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    watchers_before = set(_watchers())
    km, kc = start_new_kernel(kernel_name="python3", cwd=ROOT)
    seen: set = set()
    try:
        _run(kc, "%load_ext gpumagic")
        kernel = psutil.Process(km.provisioner.pid)
        kc.execute("%dataparallel cluster start --engines local -n 2")
        deadline = time.monotonic() + 120
        while not any("ipyparallel.engine" in describe([p]) for p in seen) and time.monotonic() < deadline:
            seen |= {c.pid for c in kernel.children(recursive=True)}
            time.sleep(0.01)
        assert any("ipyparallel.engine" in describe([p]) for p in seen), "the engines never started"
        os.kill(kernel.pid, signal.SIGKILL)
        started = time.monotonic()
        left = wait_gone(set(_cluster_processes(tmp_path)) | seen, timeout=30)
        assert left == [], f"after {time.monotonic() - started:.0f} s: {describe(left)}"
        assert wait_gone(set(_watchers()) - watchers_before, timeout=10) == []
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        for pid in wait_gone(set(_cluster_processes(tmp_path)) | seen, timeout=1):
            psutil.Process(pid).kill()
