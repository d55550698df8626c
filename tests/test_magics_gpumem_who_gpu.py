"""The floors of ``%gpumem --who`` and ``--reclaim`` on a real GPU (run on the GPU machine: ``pytest -m gpu``).

Two other kernels, under a real Jupyter server, whose notebooks hold 10 and 20 GiB; one orphaned
gpumagic worker holding 5 GiB; one process of another user (``nobody``). ``--who`` names them all
within 2 s, and what it lists sums within 2 % of NVML's used memory; ``--reclaim`` frees the orphan's
5 GiB within 5 s and touches nothing else. This process never makes a CUDA context meanwhile.

Needs root (another user's process is started as ``nobody``) and jupyter_server, ipykernel and
jupyter_client (wheels: ``bash ../shared/gpu/prepare.sh jupyter_server``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpumagic.devices import jupyter_servers, visible_gpus
from gpumagic.devices.gpu_processes import who
from gpumagic.devices.memory import listed_processes
from gpumagic.devices.process_names import Kind
from gpumagic.memory.reclaim import reclaim
from gpumagic.procs import marks
from tests.sharing_helpers import Started, alive, floors

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

GiB = 2**30


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("another user's process is started as nobody, which needs root")
    pytest.importorskip("jupyter_server")
    home = tmp_path_factory.mktemp("floors")
    saved = os.environ.get(marks.DIR_ENV)
    os.environ[marks.DIR_ENV] = str(home / "marks")
    started = Started()
    try:
        yield floors(started, home, on_gpu=True)
    finally:
        started.end_all()
        if saved is None:
            os.environ.pop(marks.DIR_ENV, None)
        else:
            os.environ[marks.DIR_ENV] = saved


def nvml_view() -> dict:
    """Per GPU: NVML's used bytes and ``{pid: bytes}`` of its processes, read directly."""
    from gpumagic.devices import nvml
    nv = nvml.lib()
    return {g.device: (nv.nvmlDeviceGetMemoryInfo(g.handle).used, listed_processes(g.handle) or {})
            for g in visible_gpus()}


def test_who_names_every_process_within_2_s_and_sums_to_nvml(scene):
    jupyter_servers.forget()
    began = time.monotonic()
    report = who()
    took = time.monotonic() - began
    view = nvml_view()
    print(f"\n%gpumem --who took {took:.3f} s\n{report.text()}")
    assert took < 2.0
    found = {p.pid: (row.device, p) for row, p in report.processes()}
    for notebook, (kid, pid, gib) in scene.kernels.items():
        device, proc = found[pid]
        assert proc.who.kind is Kind.KERNEL and proc.who.notebook == notebook and proc.who.kernel_id == kid
        assert proc.who.label == f"kernel {kid[:8]} ({notebook})"
        assert gib * GiB <= proc.used <= (gib + 1) * GiB   # its tensor and its CUDA context
    device, proc = found[scene.orphan]
    assert proc.who.kind is Kind.ORPHAN and proc.who.rank == 0
    assert proc.who.label == f"orphan: rank 0 of kernel pid {scene.dead_kernel}, which is gone"
    assert 5 * GiB <= proc.used <= 6 * GiB
    device, proc = found[scene.other]
    assert proc.who.kind is Kind.OTHER_USER and proc.who.user == scene.other_user == "nobody"
    assert proc.who.label == "another user's process (nobody)" and proc.who.cwd is None
    for row in report.devices:
        used, listed = view[row.device]
        assert {p.pid: p.used for p in row.processes} == listed   # each figure is NVML's own
        if listed:
            print(f"{row.device}: listed {row.listed / GiB:.2f} GiB of NVML's {used / GiB:.2f} GiB used "
                  f"({100 * (used - row.listed) / used:.2f} % not held by a listed process)")
            assert abs(used - row.listed) <= 0.02 * used
    # Naming reads NVML only: a fresh process that names them makes no CUDA context (this one may have
    # made one in an earlier test).
    code = ("import os, torch\nfrom gpumagic.devices.gpu_processes import who\nreport = who()\n"
            "mine = [p for _, p in report.processes() if p.pid == os.getpid()]\n"
            "print(torch.cuda.is_initialized(), len(mine), len({p.pid for _, p in report.processes()}))")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert fresh.stdout.split() == ["False", "0", str(len(found))], fresh.stderr[-2000:]


def test_reclaim_frees_the_orphans_5_gib_within_5_s_and_touches_nothing_else(scene):
    before = nvml_view()
    began = time.monotonic()
    report = reclaim()
    took = time.monotonic() - began
    after = nvml_view()
    print(f"\n%gpumem --reclaim took {took:.3f} s\n{report.text()}")
    assert took < 5.0
    assert [(e.pid, e.outcome) for e in report.ended] == [(scene.orphan, "ended by SIGTERM")]
    assert not alive(scene.orphan)
    assert report.freed >= 5 * GiB
    others = [pid for _, pid, _ in scene.kernels.values()] + [scene.other]
    assert all(alive(pid) for pid in others)
    held_before = {pid: b for _, listed in before.values() for pid, b in listed.items()}
    held_after = {pid: b for _, listed in after.values() for pid, b in listed.items()}
    assert scene.orphan in held_before and scene.orphan not in held_after
    assert {pid: held_after[pid] for pid in others} == {pid: held_before[pid] for pid in others}
