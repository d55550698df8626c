"""``%%dataparallel --cluster`` on a cluster the notebook started itself, as ipyparallel's docs start one:
``cluster = ipp.Cluster(n=2); rc = cluster.start_and_connect_sync()`` in a cell, ``%px`` before and after,
then ``--cluster PROFILE`` (the cluster has a random ``cluster_id``, so its files are not the
``ipcontroller-client.json`` that ``ipcluster start`` writes).

The fixtures are those of tests/test_dataparallel_cluster.py: a temporary ``IPYTHONDIR`` and, at the end,
no process left.
"""
from __future__ import annotations

import time

import psutil
import pytest
from IPython.core.error import UsageError

from gpumagic.dataparallel.ranks import cluster_setup as clustermod
from tests.cluster_helpers import describe, wait_gone
from tests.conftest import run_cell
from tests.dataparallel_helpers import last_result
from tests.test_dataparallel_cluster import (  # noqa: F401 - fixtures
    TRAIN,
    WORLD,
    _isolated,
    assert_trained_like,
    assert_untouched,
    cell,
    reference,
    setup,
    snapshot,
    status_rows,
)

pytest.importorskip("ipyparallel")
pytestmark = pytest.mark.filterwarnings("ignore:the cell reads no DataLoader")

PROFILE = "nb"
START = f"""
import ipyparallel as ipp
cluster = ipp.Cluster(n=2, profile={PROFILE!r}, log_level=40)
rc = cluster.start_and_connect_sync()
"""


def forget_px_magics(shell) -> None:
    """As in a fresh kernel: no ``%px`` yet (the tests' shell is shared with other cluster tests)."""
    for kind in ("line", "cell"):
        table = shell.magics_manager.magics[kind]
        for name in [n for n, f in table.items() if type(getattr(f, "__self__", None)).__name__ == "ParallelMagics"]:
            del table[name]


def ok(shell, source: str) -> str:
    result, text, _ = run_cell(shell, source)
    assert result.success, text
    return text


@pytest.mark.usefixtures("setup")
def test_a_cluster_the_notebook_started_is_found_by_its_profile(shell):
    ns = shell.user_ns
    before_procs = {c.pid for c in psutil.Process().children(recursive=True)}
    forget_px_magics(shell)
    ok(shell, START.replace("rc = cluster.start_and_connect_sync()", "cluster.start_cluster_sync()"))
    cluster = ns["cluster"]
    try:
        assert cluster.cluster_id != ""           # ipp.Cluster's own default: a random id
        # a --cluster cell before the notebook has a client: %px is left to the notebook's own client
        end = time.monotonic() + 60
        while True:   # (the engines register a few seconds after start_cluster_sync returns)
            try:
                cell(shell, f"--cluster {PROFILE} --nprocs 2", WORLD)
                break
            except UsageError as exc:
                if time.monotonic() > end or "engine" not in str(exc):
                    raise
                time.sleep(0.5)
        ok(shell, "rc = cluster.connect_client_sync()\nrc.wait_for_engines(2)")
        ok(shell, "%px import os\n%px engine_pid = os.getpid()")
        pids = ns["rc"][:]["engine_pid"]

        # --cluster PROFILE: the cluster running in that profile, whatever its id
        ref_model, ref_opt = reference(ns)
        model = ns["model"]
        t0 = time.monotonic()
        cell(shell, f"--cluster {PROFILE}", TRAIN)
        assert time.monotonic() - t0 < 30
        assert ns["model"] is model
        assert_trained_like(ns, ref_model, ref_opt)
        assert sorted(last_result().pids) == sorted(pids)
        # the engines are the user's still: %px state and the client as before
        ok(shell, "%px same = engine_pid == os.getpid()")
        assert ns["rc"][:]["same"] == [True, True]

        # no --nprocs after --nprocs 1: every engine again, not the one of the last cell
        cell(shell, f"--cluster {PROFILE} --nprocs 1", WORLD)
        assert ns["ws"] == 1
        cell(shell, f"--cluster {PROFILE}", WORLD)
        assert ns["ws"] == 2, "a cell without --nprocs ran on the ranks of the last --nprocs 1 cell"

        # two clusters running in the profile: the one in use serves on; found afresh, which one is for the
        # user to say
        other = None
        try:
            import ipyparallel as ipp
            other = ipp.Cluster(n=0, profile=PROFILE, log_level=40)
            other.start_controller_sync()
            cell(shell, f"--cluster {PROFILE}", WORLD)
            assert ns["ws"] == 2
            # 'cluster stop' forgets a cluster it did not start, and says that it keeps running
            text = ok(shell, "%dataparallel cluster stop")
            assert "the cluster was stopped" not in text and "keeps running" in text, text
            assert clustermod.current_cluster() is None and cluster.controller.poll() is None
            ok(shell, "assert rc[:].apply_sync(lambda: 1) == [1, 1]")
            ok(shell, "%px same = engine_pid == os.getpid()")   # (gpumagic's client is closed now)
            with pytest.raises(UsageError) as err:
                shell.run_cell_magic("dataparallel", f"--cluster {PROFILE}", WORLD)
            message = str(err.value)
            assert "2 clusters run in profile" in message, message
            assert cluster.cluster_file in message and other.cluster_file in message
        finally:
            if other is not None:
                other.stop_cluster_sync()
        cell(shell, f"--cluster {PROFILE}", WORLD)    # one cluster in the profile again: found
        assert ns["ws"] == 2

        # the user stops the cluster between cells: the next cell says so at once, status says it too
        before = snapshot(ns)
        ok(shell, "cluster.stop_cluster_sync()")
        t0 = time.monotonic()
        with pytest.raises(UsageError) as err:
            shell.run_cell_magic("dataparallel", f"--cluster {PROFILE}", TRAIN)
        assert time.monotonic() - t0 < 5
        assert f"no cluster is running in profile {PROFILE!r}" in str(err.value)
        assert "controller the last cell used is gone" in str(err.value)
        assert_untouched(ns, before)
    finally:
        cluster.stop_cluster_sync()
        clustermod.stop_cluster()
    new = {c.pid for c in psutil.Process().children(recursive=True)} - before_procs
    left = wait_gone(new, timeout=15)
    assert left == [], describe(left)


@pytest.mark.usefixtures("setup")
def test_status_and_the_next_cell_say_the_controller_is_gone(shell):
    """A cluster found by its client file, stopped by the user between cells: ``%dataparallel status`` does
    not list its engines as alive, and the next cell is a UsageError before anything travels."""
    ns = shell.user_ns
    ok(shell, START)
    cluster = ns["cluster"]
    try:
        ok(shell, "import glob\n"
                  "client_file = glob.glob(cluster.profile_dir + '/security/ipcontroller-*-client.json')[0]")
        line = f"--cluster {ns['client_file']}"
        cell(shell, line, WORLD)
        assert ns["ws"] == 2
        ok(shell, "cluster.stop_cluster_sync()")
        text, rows = status_rows(shell)
        assert "controller gone" in text, text
        assert [r["alive"] for r in rows] == ["no", "no"], text
        before = snapshot(ns)
        t0 = time.monotonic()
        with pytest.raises(UsageError) as err:
            shell.run_cell_magic("dataparallel", line, TRAIN)
        assert time.monotonic() - t0 < 5
        assert "controller the last cell used is gone" in str(err.value), str(err.value)
        assert_untouched(ns, before)
    finally:
        cluster.stop_cluster_sync()
        clustermod.stop_cluster()


@pytest.mark.usefixtures("setup")
def test_a_cluster_started_by_the_magic_is_found_by_its_profile_too(shell):
    ok(shell, "%dataparallel cluster start -n 2 --profile started")
    try:
        started = clustermod.current_cluster()
        cell(shell, "--cluster", WORLD)
        pids = last_result().pids
        cell(shell, "--cluster started", WORLD)
        assert shell.user_ns["ws"] == 2
        # the same ranks (not formed again through a second client)
        assert clustermod.current_cluster() is started and last_result().pids == pids
        assert last_result().pool_started is False
    finally:
        ok(shell, "%dataparallel cluster stop")
