"""``%%dataparallel --cluster`` on the CPU, for real: an ipyparallel controller and two engines that say
they are on two hosts (``GPUMAGIC_HOST=host-a`` / ``host-b``), gloo between them.

One hand-started cluster (tests/cluster_helpers.py) serves most tests; the cells
are formed into ranks once and reused, which is itself under test. The tests
that break engines (a rank error leaving rank 0 in a collective, a killed
engine) run after the others, and the cluster's engines are started again
before each test that needs both. The lost controller and the cluster
``%dataparallel cluster start`` starts get clusters of their own. Bad input is
refused with a UsageError before anything starts. ipyparallel's files (profiles,
connection files) go to a temporary ``IPYTHONDIR``, and no process is left at
the end.
"""
from __future__ import annotations

import _thread
import copy
import os
import signal
import socket
import sys
import textwrap
import threading
import time
import warnings

import psutil
import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from gpumagic.dataparallel.ranks import cluster_setup as clustermod
from gpumagic.errors import WorkerDied, WorkerError
from gpumagic.procs.cpus import process_limit
from tests.cluster_helpers import ROOT, HandCluster, deadline, describe, fake_package, living, wait_gone
from tests.conftest import run_cell
from tests.dataparallel_helpers import last_result
from tests.test_magics_dataparallel import SETUP as LOCAL_SETUP

pytest.importorskip("ipyparallel")
pytestmark = pytest.mark.filterwarnings("ignore:the cell reads no DataLoader")

HOSTS = ("host-a", "host-b")

# the notebook of the local-pool tests, its loader unshuffled
SETUP = LOCAL_SETUP.format(shuffle=False)

TRAIN = """
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
final_loss = float(loss.detach())
"""

# Where each rank runs, as the rank sees it, gathered to every rank.
WHERE = """
import os, socket
import torch.distributed as dist
where = (os.environ.get("GPUMAGIC_HOST", socket.gethostname()), os.environ["GROUP_RANK"],
         os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_WORLD_SIZE"], os.getpid(),
         str(next(model.parameters()).device))
everywhere = [None] * dist.get_world_size()
dist.all_gather_object(everywhere, where)
"""

# A hand-written DDP loop that forms its own process group from MASTER_ADDR / MASTER_PORT (launch mode).
HAND_DDP = """
import os
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
dist.init_process_group()
ddp_model = DDP(model)
sampler = DistributedSampler(loader.dataset, shuffle=False)
for epoch in range(2):
    for x, y in DataLoader(loader.dataset, batch_size=8, sampler=sampler):
        opt.zero_grad()
        ((ddp_model(x) - y) ** 2).mean().backward()
        opt.step()
env = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")}
envs = [None] * dist.get_world_size()
dist.all_gather_object(envs, env)
world = dist.get_world_size()
dist.destroy_process_group()
"""

# How many ranks a cell ran on.
WORLD = "import torch.distributed as dist\nws = dist.get_world_size()\nok = float(model(X).sum().detach())\n"

# Both ranks in collectives until interrupted; rank 0 says when it is surely running.
COLLECTIVES = """
import time, torch, torch.distributed as dist
out = model(X)
for i in range(100000):
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 0 and i == 5:
        open({marker!r}, "w").close()
    time.sleep(0.005)
"""


def reference(ns, epochs=2):
    """Copies of the notebook's model and optimizer trained in this process on the full batches."""
    model = copy.deepcopy(ns["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(copy.deepcopy(ns["opt"].state_dict()))   # (its tensors, not the notebook's)
    for _ in range(epochs):
        for x, y in ns["loader"]:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    return model, opt


def assert_trained_like(ns, ref_model, ref_opt, tol=1e-5):
    """The notebook's model and optimizer (momentum) hold what one process trained, within ``tol``."""
    model, opt = ns["model"], ns["opt"]
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, ref_model.state_dict()[name], atol=tol, rtol=0, msg=name)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"],
                                   atol=tol, rtol=0)


def snapshot(ns) -> dict:
    return {k: v.clone() for k, v in ns["model"].state_dict().items()}


def assert_untouched(ns, before: dict) -> None:
    after = ns["model"].state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"the notebook's {k} changed"


def cell(shell, line: str, body: str):
    """``%%dataparallel line`` over ``body``: its value and captured output."""
    with capture_output() as cap:
        value = shell.run_cell_magic("dataparallel", line, textwrap.dedent(body))
    return value, cap


def status_rows(shell) -> tuple[str, list[dict]]:
    """``%dataparallel status``'s text and its cluster table's rows (a local pool's table, listed after
    it when one runs too, ends at the blank line)."""
    import itertools
    with capture_output() as cap:
        shell.run_line_magic("dataparallel", "status")
    text = cap.stdout
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "host"])
    header = lines[at].split()
    rows = [dict(zip(header, line.split())) for line in itertools.takewhile(str.strip, lines[at + 2:])]
    return text, rows


def says_engines_gone(message: str, *names: str) -> bool:
    """A message that names the engine that went away (its host, or ``engine N``) and says it is gone."""
    m = message.lower()
    return any(n.lower() in m for n in names) and any(
        w in m for w in ("gone", "stopped", "died", "dead", "start them again", "restart"))


def engine_of(host: str) -> str:
    """``engine N``: how gpumagic's current ranks name the engine on ``host``."""
    return next(f"engine {r.engine}" for r in clustermod.current_cluster().ranks if r.host == host)


def next_cell_problem(shell, line: str, host: str, engine: str) -> str | None:
    """After the engine on ``host`` went away, what is wrong with the next cell, if anything: it should run
    on both ranks (engines started again), or be refused with an error that says the engine on ``host`` is
    gone; not run on fewer ranks without a word, nor hang."""
    try:
        with deadline(60) as d, capture_output() as cap:
            shell.run_cell_magic("dataparallel", line, WORLD)
    except (UsageError, WorkerError) as exc:
        if not says_engines_gone(str(exc), host, engine):
            return f"the next cell's error does not say that the engine on {host} is gone: {exc}"
        return None
    except KeyboardInterrupt:
        return "the next --cluster cell hung (interrupted after 60 s)"
    assert not d.fired
    ws = shell.user_ns["ws"]
    if ws != 2 and not says_engines_gone(cap.stderr, host, engine):
        return (f"the next --cluster cell ran on {ws} rank(s) of 2, without a word that the engine on {host} "
                f"is gone (its notes: {cap.stderr.strip()!r})")
    return None


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module", autouse=True)
def _isolated(tmp_path_factory):
    """IPYTHONDIR in a temporary directory (profiles, ``cluster start``'s files); engines that
    ``cluster start`` launches import this checkout; at the end, gpumagic forgets its cluster and no
    process started in this module is left."""
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    home = tmp_path_factory.mktemp("ipython")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IPYTHONDIR", str(home))
        mp.setenv("PYTHONPATH", os.pathsep.join([ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                          else [])))
        mp.delenv("GPUMAGIC_HOST", raising=False)
        yield home
        clustermod.stop_cluster()
    new = {c.pid for c in psutil.Process().children(recursive=True)} - before
    left = wait_gone(new, timeout=15)
    assert left == [], f"processes left behind: {describe(left)}"


@pytest.fixture(scope="module")
def hand(tmp_path_factory):
    """The shared cluster: a controller and engines on 'host-a' and 'host-b'."""
    c = HandCluster(tmp_path_factory.mktemp("cluster"), HOSTS)
    try:
        c.start()
        yield c
    finally:
        clustermod.stop_cluster()
        left = c.stop()
        assert left == [], f"cluster processes left behind: {describe(left)}"


@pytest.fixture
def line(hand):
    """``--cluster <the shared cluster's client file>``, both engines running. Where one was started
    again, gpumagic's ranks of the old engines are forgotten so that the next cell forms anew."""
    healed = hand.heal()
    current = clustermod.current_cluster()
    if healed or (current is not None and (current.world_size not in (0, len(HOSTS))
                                           or any(not r.alive for r in current.ranks))):
        clustermod.stop_cluster()
    return f"--cluster {hand.client_file}"


@pytest.fixture
def setup(shell):
    result, text, _ = run_cell(shell, SETUP)
    assert result.success, text
    return shell.user_ns


# ---------------------------------------------------------------- bad input: refused before anything starts

def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("options, says", [
    ("--strategy fsdp", "--strategy fsdp runs on this machine"),
    ("--strategy dp", "--strategy dp runs on this machine"),
    ("--devices cpu", "--devices names this machine's"),
    ("--devices cpu --nprocs 2", "--devices names this machine's"),
])
def test_options_that_choose_this_machines_devices_are_refused(shell, setup, tmp_path, options, says):
    before = _children()
    with pytest.raises(UsageError) as err:
        shell.run_cell_magic("dataparallel", f"--cluster {tmp_path / 'ipcontroller-client.json'} {options}", TRAIN)
    assert says in str(err.value) and "valid choices" in str(err.value)
    assert _children() <= before


def test_no_cluster_reachable_says_how_to_get_one(shell, setup, _isolated):
    before = _children()
    with pytest.raises(UsageError) as err:
        shell.run_cell_magic("dataparallel", "--cluster /nonexistent/ipcontroller-client.json", TRAIN)
    assert "/nonexistent/ipcontroller-client.json: no such file" in str(err.value)
    assert "%dataparallel cluster start --engines local -n 2" in str(err.value)

    t0 = time.monotonic()
    with pytest.raises(UsageError) as err:
        shell.run_cell_magic("dataparallel", "--cluster no-such-profile", TRAIN)
    took = time.monotonic() - t0
    message = str(err.value)
    assert "--cluster no-such-profile" in message and "no ipyparallel cluster reachable" in message
    assert "%dataparallel cluster start --engines local -n 2" in message and "ipcluster start --profile" in message
    assert took < 15.0
    assert _children() <= before and clustermod.current_cluster() is None
    # a profile name that does not exist is an error, not a directory made for it
    made = sorted(p.name for p in _isolated.iterdir() if p.name.startswith("profile_no-such"))
    assert made == [], f"--cluster no-such-profile created {made} in IPYTHONDIR"


def test_cluster_without_a_value_needs_a_started_cluster(shell, setup):
    assert clustermod.current_cluster() is None or not clustermod.current_cluster().owned
    with pytest.raises(UsageError) as err:
        shell.run_cell_magic("dataparallel", "--cluster", TRAIN)
    assert "none is running" in str(err.value)
    assert "%dataparallel cluster start --engines local -n 2" in str(err.value)


def test_ipyparallel_not_installed_says_pip_install(shell, setup, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ipyparallel", None)   # import ipyparallel fails
    for line in (f"--cluster {tmp_path / 'ipcontroller-client.json'}", "--cluster"):
        with pytest.raises(UsageError) as err:
            shell.run_cell_magic("dataparallel", line, TRAIN)
        assert "ipyparallel is not installed" in str(err.value)
        assert "pip install 'gpumagic[cluster]'" in str(err.value)
    with pytest.raises(UsageError, match="pip install"):
        shell.run_line_magic("dataparallel", "cluster start --engines local -n 2")


@pytest.mark.parametrize("missing", ["gpumagic", "torch"])
def test_engines_without_gpumagic_or_torch_are_refused(shell, setup, tmp_path, missing):
    """Engines whose Python cannot import gpumagic (or torch): a UsageError saying to install it there."""
    fake = fake_package(tmp_path / "fake", missing)
    lacking = HandCluster(tmp_path / "cluster", ["host-x"], pythonpath=[str(fake), ROOT]).start()
    try:
        ns = shell.user_ns
        before = snapshot(ns)
        with pytest.raises(UsageError) as err:
            shell.run_cell_magic("dataparallel", f"--cluster {lacking.client_file}", TRAIN)
        message = str(err.value)
        assert f"the engines cannot import {missing}" in message, message
        assert "install gpumagic" in message and "engines' Python environment" in message
        assert_untouched(ns, before)
        assert lacking.engines["host-x"].poll() is None      # nothing was started on, or done to, the engine
    finally:
        clustermod.stop_cluster()
        assert lacking.stop() == []


# ---------------------------------------------------------------- training on two "hosts"

def test_cells_show_no_warnings_about_the_bytes_they_move(shell, setup, line):
    """What travels to the engines and back is gpumagic's business: no torch warning about it in the cell
    (torch says each such warning once per process: this runs first, on fresh engines)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = []
        for body in (TRAIN, "y0 = float(model(X).sum().detach())\n",
                     "v = model(X[:2]).detach()\nw = v * 2\n"):
            _, cap = cell(shell, line, body)
            outputs.append(cap.stdout + cap.stderr)
    unwritable = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "not writable" in str(w.message)]
    unwritable += [o for o in outputs if "not writable" in o]
    assert unwritable == [], unwritable


def test_trains_like_one_process_and_each_rank_is_on_its_host(shell, setup, hand, line):
    ns = setup
    model, opt, losses = ns["model"], ns["opt"], ns["losses"]
    ref_model, ref_opt = reference(ns)
    cell(shell, line, TRAIN + WHERE)

    assert ns["model"] is model and ns["opt"] is opt and ns["losses"] is losses   # the same objects, trained
    assert_trained_like(ns, ref_model, ref_opt)
    assert len(losses) == 8 and ns["final_loss"] == pytest.approx(losses[-1], abs=1e-6)
    result = last_result()
    assert result.devices == ["cpu", "cpu"] and result.backend == "gloo"
    assert {r: s.steps for r, s in result.per_rank.items()} == {0: 8, 1: 8}
    assert {r: s.samples for r, s in result.per_rank.items()} == {0: 64, 1: 64}
    # rank 0 on host-a, rank 1 on host-b: one rank per host, each the first on its host
    pids = {h: hand.engine_pid(h) for h in HOSTS}
    assert ns["everywhere"] == [("host-a", "0", "0", "1", "2", pids["host-a"], "cpu"),
                                ("host-b", "1", "0", "1", "2", pids["host-b"], "cpu")]
    assert result.pids == [pids["host-a"], pids["host-b"]]


def test_status_lists_each_rank_with_its_host(shell, setup, hand, line):
    cell(shell, line, "y0 = float(model(X).sum().detach())\n")
    text, rows = status_rows(shell)
    assert f"%%dataparallel cluster: {hand.client_file}; formed, 2 rank(s), backend gloo" in text
    assert [(r["rank"], r["host"], r["device"], r["LOCAL_RANK"], r["pid"], r["alive"]) for r in rows] == [
        ("0", "host-a", "cpu", "0", str(hand.engine_pid("host-a")), "yes"),
        ("1", "host-b", "cpu", "0", str(hand.engine_pid("host-b")), "yes")]
    assert sorted(int(r["engine"]) for r in rows) == hand.registered()


def test_a_second_cell_reuses_the_ranks_and_the_tensors_they_hold(shell, hand, line):
    result, text, _ = run_cell(shell, "import torch\nfrom torch import nn\nbig = nn.Linear(512, 512)\n"
                                      "bopt = torch.optim.SGD(big.parameters(), lr=0.01)\n")
    assert result.success, text
    body = ("bopt.zero_grad()\nbig(torch.ones(4, 512)).sum().backward()\nbopt.step()\n"
            "s = float(big.weight.detach().sum())\n"
            "import os\npid = os.getpid()\n")
    cell(shell, line, body)
    first = last_result()
    ranks = clustermod.current_cluster()
    assert first.shipped_bytes >= 512 * 512 * 4
    s1 = shell.user_ns["s"]
    recorded = set(ranks.client.hub_history())   # the controller's task records
    t0 = time.monotonic()
    cell(shell, line, body)
    took = time.monotonic() - t0
    second = last_result()
    assert clustermod.current_cluster() is ranks and second.pool_started is False   # not formed again
    assert second.timings["pool_start"] == 0.0 and took < 5.0
    assert second.pids == first.pids and shell.user_ns["pid"] == hand.engine_pid("host-a")
    # the big weight stayed in the engines: not shipped again
    assert second.cached_bytes >= 512 * 512 * 4 and second.shipped_bytes < 512 * 512 * 4
    # and what they kept is the trained weight: one more step of -lr * 4 on each of 512*512 weights
    assert shell.user_ns["s"] == pytest.approx(s1 - 0.01 * 4 * 512 * 512, rel=1e-4)
    assert shell.user_ns["s"] == pytest.approx(float(shell.user_ns["big"].weight.detach().sum()), rel=1e-6)
    # the controller keeps no record of the cell's tasks, and so none of the tensors they carried
    assert set(ranks.client.hub_history()) <= recorded and not ranks.client.results


def test_compiled_models_stay_warm_on_the_engines(shell, setup, hand, line):
    ns = setup
    ref_model, ref_opt = reference(ns, epochs=4)     # two cells of two epochs, momentum carried over
    _, cap = cell(shell, f"{line} --compile", TRAIN)
    assert "--compile: compiled" in cap.stderr or "--compile: traced again" in cap.stderr, cap.stderr
    _, cap = cell(shell, f"{line} --compile", TRAIN)
    assert "--compile: the compiled model was reused, nothing recompiled" in cap.stderr, cap.stderr
    assert_trained_like(ns, ref_model, ref_opt, tol=1e-4)


def test_more_ranks_than_engines_is_refused_and_the_ranks_stay(shell, setup, hand, line):
    cell(shell, line, "a = model(X).shape[0]\n")
    ranks = clustermod.current_cluster()
    pids = list(ranks.pids)
    before = snapshot(setup)
    with pytest.raises(UsageError) as err:
        shell.run_cell_magic("dataparallel", f"{line} --nprocs 3", TRAIN)
    assert "--nprocs 3" in str(err.value) and "has 2 engine(s)" in str(err.value)
    assert "--nprocs 1, --nprocs 2" in str(err.value)
    assert_untouched(setup, before)
    cell(shell, line, "b = model(X).shape[0]\n")                 # the formed ranks, untouched
    assert last_result().pool_started is False and clustermod.current_cluster().pids == pids
    assert shell.user_ns["b"] == 64


# What rank 0's engine listens on while the cell runs (its own sockets: the store's, gloo's).
LISTENING = """
import psutil
listening = sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN})
out = model(X)
"""


def _listening(pid: int) -> set:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def _outsider_writes(port: int) -> bool:
    """Whether another local process can connect to ``port`` as a TCPStore client and write a key there."""
    import datetime

    import torch.distributed as dist
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3))
        store.set("outsider", "was here")
        return True
    except (RuntimeError, ValueError, OSError):   # refused: nothing listens there
        return False


def test_the_rendezvous_store_serves_only_during_a_cell_and_on_loopback_here(shell, setup, hand, line):
    # every engine is on this machine (GPUMAGIC_HOST only names them apart): the unauthenticated store
    # listens on loopback, while a cell runs, and is closed once the cell has ended on every rank
    for _ in range(2):   # (the first cell forms the ranks; the second is a later cell, as most are)
        cell(shell, line, LISTENING)
        during = set(shell.user_ns["listening"])
        assert not [a for a in during if a[0] in ("0.0.0.0", "::")], during   # no socket on every interface
        ranks = clustermod.current_cluster()
        address, port = ranks.last_store
        assert (address, port) == ("127.0.0.1", port) and ("127.0.0.1", port) in during, (ranks.last_store, during)
        after = _listening(ranks.ranks[0].pid)
        assert port not in {p for _, p in after} and after <= during, (port, during, after)
        assert not _outsider_writes(port)


def test_launch_mode_cell_forms_its_group_from_master_addr(shell, setup, hand, line):
    ns = setup
    ref_model, ref_opt = reference(ns)                # DistributedSampler's halves of each batch of 16
    model = ns["model"]
    _, cap = cell(shell, line, HAND_DDP)
    assert "launch mode, because the cell calls init_process_group" in cap.stderr
    assert ns["world"] == 2 and ns["model"] is model
    assert_trained_like(ns, ref_model, ref_opt)
    env0, env1 = ns["envs"]
    assert env0["MASTER_ADDR"] == env1["MASTER_ADDR"] == "127.0.0.1"        # rank 0's engine's address
    assert env0["MASTER_PORT"] == env1["MASTER_PORT"] and int(env0["MASTER_PORT"]) > 0
    assert [(e["RANK"], e["WORLD_SIZE"], e["GROUP_RANK"], e["LOCAL_RANK"]) for e in (env0, env1)] == [
        ("0", "2", "0", "0"), ("1", "2", "1", "0")]
    # the next (hand-written loop) cell still has both ranks
    cell(shell, line, WORLD)
    assert ns["ws"] == 2


# ---------------------------------------------------------------- failures: clear errors, the notebook untouched

def test_an_interrupt_ends_the_cell_within_seconds(shell, setup, hand, line, tmp_path):
    ns = setup
    cell(shell, line, "a = model(X).shape[0]\n")
    before = snapshot(ns)
    marker = tmp_path / "running"
    asked = []

    def interrupt_when_running():
        end = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < end:
            time.sleep(0.02)
        asked.append(time.monotonic())
        _thread.interrupt_main()
    watcher = threading.Thread(target=interrupt_when_running, daemon=True)
    watcher.start()
    with capture_output() as cap, pytest.raises(KeyboardInterrupt):
        shell.run_cell_magic("dataparallel", line, COLLECTIVES.format(marker=str(marker)))
    ended = time.monotonic()
    watcher.join()
    assert marker.exists(), "interrupted before the ranks ran"
    assert ended - asked[0] < 5.0
    assert_untouched(ns, before)
    # the engines either ended the cell (still ranks) or are said to be gone
    st = clustermod.current_cluster().status()
    gone = [r for r in st["ranks"] if not r["alive"]]
    if gone:
        for r in gone:
            assert says_engines_gone(cap.stderr, r["host"], f"engine {r['engine']}"), cap.stderr
    else:
        cell(shell, line, WORLD)
        assert ns["ws"] == 2 and last_result().pids == [hand.engine_pid(h) for h in HOSTS]


def test_an_interrupted_cell_outside_collectives_leaves_the_engines_ranks(shell, setup, hand, line, tmp_path):
    """Ranks in plain Python (no collective) end the cell on SIGINT: the engines stay ranks, and the note says
    the cell ended on them, not that they were stopped."""
    ns = setup
    cell(shell, line, "a = model(X).shape[0]\n")
    pids = [hand.engine_pid(h) for h in HOSTS]
    marker = tmp_path / "running"

    def interrupt_when_running():
        end = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < end:
            time.sleep(0.02)
        _thread.interrupt_main()
    watcher = threading.Thread(target=interrupt_when_running, daemon=True)
    watcher.start()
    body = (f"import time, torch.distributed as dist\nout = model(X)\nif dist.get_rank() == 0:\n"
            f"    open({str(marker)!r}, 'w').close()\nfor i in range(600):\n    time.sleep(0.05)\n")
    with capture_output() as cap, pytest.raises(KeyboardInterrupt):
        shell.run_cell_magic("dataparallel", line, body)
    watcher.join()
    assert "the ranks were stopped" not in cap.stderr and "the cell ended on the engines" in cap.stderr, cap.stderr
    assert living(pids) == pids
    cell(shell, line, WORLD)
    assert ns["ws"] == 2 and last_result().pids == pids


def test_a_rank_error_names_rank_and_line_and_the_stuck_rank_is_said_gone(shell, setup, hand, line):
    ns = setup
    cell(shell, line, "a = model(X).shape[0]\n")
    pids = {h: hand.engine_pid(h) for h in HOSTS}
    engine_a = engine_of("host-a")
    before = snapshot(ns)
    src = (f"%%dataparallel {line}\n"
           "import torch.distributed as dist\n"
           "out = model(X)\n"
           "if dist.get_rank() == 1:\n"
           "    raise ValueError('rank one fails')\n"     # line 5, counting the magic's line
           "dist.barrier()\n")
    t0 = time.monotonic()
    result, out, _ = run_cell(shell, src)
    took = time.monotonic() - t0
    err = result.error_in_exec
    assert isinstance(err, WorkerError) and not isinstance(err, WorkerDied), err
    assert (err.rank, err.pid, err.exc_type) == (1, pids["host-b"], "ValueError")
    assert "rank one fails" in err.message
    assert f"Cell In[{result.execution_count}], line 5" in err.remote_traceback
    assert "raise ValueError('rank one fails')" in err.remote_traceback
    assert_untouched(ns, before)
    assert took < 15.0
    # rank 0 waited in the barrier for a rank that would never come: what became of it is said
    st = clustermod.current_cluster().status()
    alive = {r["host"]: r["alive"] for r in st["ranks"]}
    if not alive["host-a"]:
        assert says_engines_gone(out, "host-a") and f"{engine_a} (rank 0, host-a)" in out, out
        assert wait_gone([pids["host-a"]], timeout=10) == []          # stopped, not left hanging
        _, rows = status_rows(shell)
        assert [(r["host"], r["alive"]) for r in rows] == [("host-a", "no"), ("host-b", "yes")]
        hand.wait_registered(1, timeout=30)                            # the controller saw it go
    assert alive["host-b"] and living([pids["host-b"]]) == [pids["host-b"]]
    problems = [next_cell_problem(shell, line, "host-a", engine_a)]
    # the engine started again, as the note says: the next cell has both ranks again
    hand.heal()
    try:
        with deadline(60):
            cell(shell, line, WORLD)
        if ns["ws"] != 2:
            problems.append(f"with host-a's engine started again, the next cell ran on {ns['ws']} rank(s) of 2")
    except (UsageError, WorkerError, KeyboardInterrupt) as exc:
        problems.append(f"with host-a's engine started again, the next cell failed: {type(exc).__name__}: {exc}")
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


def test_a_collective_timeout_names_the_rank_that_never_came(shell, setup, hand, line):
    # as on the local pool: rank 0's barrier times out; rank 1, still sleeping, is the one to look at
    ns = setup
    before = snapshot(ns)
    started = time.monotonic()
    with capture_output(), pytest.raises(WorkerError) as err:
        shell.run_cell_magic("dataparallel", f"{line} --timeout 3",
                             "import time, torch.distributed as dist\nout = model(X)\n"
                             "if dist.get_rank() == 1:\n    time.sleep(60)\ndist.barrier()\n")
    assert err.value.rank == 0 and err.value.still_running == [1], (err.value, err.value.still_running)
    assert err.value._render_traceback_()[-1].startswith("rank 1 had not finished the cell (stopped now)")
    assert time.monotonic() - started < 40
    assert_untouched(ns, before)


def test_an_engine_killed_mid_cell_is_a_clear_error(shell, setup, hand, line):
    ns = setup
    cell(shell, line, "a = model(X).shape[0]\n")
    pid_b = hand.engine_pid("host-b")
    engine_b = engine_of("host-b")
    before = snapshot(ns)
    t0 = time.monotonic()
    with capture_output(), pytest.raises(WorkerError) as err:
        shell.run_cell_magic("dataparallel", line, "import os, signal, torch.distributed as dist\nout = model(X)\n"
                                                   "if dist.get_rank() == 1:\n"
                                                   "    os.kill(os.getpid(), signal.SIGKILL)\n"
                                                   "dist.barrier()\n")
    took = time.monotonic() - t0
    e = err.value
    assert_untouched(ns, before)
    assert took < 15.0
    assert e.rank == 1 and "host-b" in e.message and "died" in e.message, e
    assert wait_gone([pid_b], timeout=5) == []
    problems = []
    if not (isinstance(e, WorkerDied) and e.exc_type == "WorkerDied"):
        problems.append(f"an engine that died is reported as {type(e).__name__} ({e.exc_type}), not WorkerDied: {e}")
    hand.wait_registered(1, timeout=30)
    _, rows = status_rows(shell)
    assert {r["host"]: r["alive"] for r in rows}["host-b"] == "no"
    problems.append(next_cell_problem(shell, line, "host-b", engine_b))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


def test_engines_shut_down_between_cells_are_said_gone(shell, setup, hand, line):
    """Every engine shut down by the user (``rc.shutdown()``) after a cell: the next cell is a UsageError saying
    they are gone (not ipyparallel's NoEnginesRegistered from inside gpumagic), and status does not say formed."""
    ns = setup
    cell(shell, line, WORLD)
    pids = [hand.engine_pid(h) for h in HOSTS]
    client = hand.client()
    try:
        client.shutdown(targets="all", hub=False, block=True)
    finally:
        client.close()
    assert wait_gone(pids, timeout=15) == []
    hand.wait_registered(0, timeout=30)
    text, rows = status_rows(shell)
    assert "; formed" not in text and [r["alive"] for r in rows] == ["no", "no"], text
    before = snapshot(ns)
    for extra in ("", " --nprocs 1"):
        with pytest.raises(UsageError) as err:
            shell.run_cell_magic("dataparallel", line + extra, WORLD)
        message = str(err.value)
        assert "no engines" in message and "0 left" not in message, message
    assert_untouched(ns, before)


def test_a_lost_controller_ends_the_cell_in_bounded_time(shell, setup, tmp_path):
    """The controller (and its schedulers) killed mid-cell: the cell ends with an error saying so, soon,
    the model as it was; the next cell says so at once."""
    ns = setup
    lost = HandCluster(tmp_path / "lost", HOSTS).start()
    problems = []
    try:
        line = f"--cluster {lost.client_file}"
        cell(shell, line, "a = model(X).shape[0]\n")
        before = snapshot(ns)
        marker = tmp_path / "running"
        killed = []

        def kill_when_running():
            end = time.monotonic() + 60
            while not marker.exists() and time.monotonic() < end:
                time.sleep(0.02)
            lost.kill_controller()
            killed.append(time.monotonic())
        threading.Thread(target=kill_when_running, daemon=True).start()
        body = ("import time, torch.distributed as dist\nout = model(X)\n"
                f"if dist.get_rank() == 0:\n    open({str(marker)!r}, 'w').close()\n"
                "for i in range(300):\n    time.sleep(0.1)\n")
        error = None
        try:
            with deadline(25), capture_output():
                shell.run_cell_magic("dataparallel", line, body)
        except KeyboardInterrupt:
            problems.append("the cell hung after the controller was lost (interrupted 25 s after it began)")
        except Exception as exc:  # noqa: BLE001 - judged below
            error = exc
        ended = time.monotonic()
        assert killed, "the controller was never killed"
        if error is None and not problems:
            problems.append("the cell ended without an error although the controller was lost")
        if error is not None:
            if not (isinstance(error, WorkerError) and "controller" in str(error).lower()):
                problems.append(f"the error does not say the controller is gone: {type(error).__name__}: {error}")
            if ended - killed[0] > 15.0:
                problems.append(f"the error came {ended - killed[0]:.0f} s after the controller was lost")
        assert_untouched(ns, before)

        t0 = time.monotonic()
        try:
            with deadline(20), capture_output():
                shell.run_cell_magic("dataparallel", line, "b = model(X).shape[0]\n")
            problems.append("the next cell ran although the controller is gone")
        except KeyboardInterrupt:
            problems.append("the next cell hung (interrupted after 20 s) instead of saying the controller is gone")
        except (UsageError, WorkerError) as exc:
            if "controller" not in str(exc).lower():
                problems.append(f"the next cell's error does not say the controller is gone: {exc}")
            if time.monotonic() - t0 > 15.0:
                problems.append(f"the next cell took {time.monotonic() - t0:.0f} s to say so")
        assert_untouched(ns, before)
    finally:
        try:
            with deadline(20):
                clustermod.stop_cluster()
        except KeyboardInterrupt:
            problems.append("forgetting the cluster whose controller was lost hung (interrupted after 20 s)")
        left = lost.stop()
    assert left == [], f"left behind: {describe(left)}"
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- %dataparallel cluster start / stop

@pytest.mark.parametrize("line, says", [
    ("cluster start -n 0", "-n 0"),
    ("cluster start -n -2", "-n -2"),
    ("cluster start --engines nonsense -n 2", "--engines nonsense"),
    # as many local engines as the local pool would start processes: 4 per core, the memory each takes
    # (one more than that: the count that would have started, had it not been refused)
    (f"cluster start --engines local -n {process_limit() + 1}", f"-n {process_limit() + 1}: this machine has room for"),
    (f"cluster start -n {process_limit() + 1}", "--oversubscribe"),
    ("cluster start --engines slurm -n 2 --oversubscribe", "--oversubscribe is about this machine's cores"),
])
def test_cluster_start_refuses_bad_input_before_starting_anything(shell, line, says):
    before, was = _children(), clustermod.current_cluster()
    t0 = time.monotonic()
    with pytest.raises(UsageError) as err:
        shell.run_line_magic("dataparallel", line)
    assert says in str(err.value) and "valid choices" in str(err.value), str(err.value)
    assert time.monotonic() - t0 < 5
    assert wait_gone(_children() - before, timeout=10) == [] and clustermod.current_cluster() is was


def test_cluster_status_is_status(shell):
    with capture_output() as cap:
        shell.run_line_magic("dataparallel", "cluster status")
    with capture_output() as plain:
        shell.run_line_magic("dataparallel", "status")
    assert cap.stdout == plain.stdout and cap.stdout.strip()


def test_a_started_cluster_trains_restarts_its_engines_and_stops(shell, setup, _isolated):
    """``%dataparallel cluster start --engines local -n 2`` (with a profile of the temporary IPYTHONDIR: without
    one ipyparallel uses the shell's own profile), cells on it with ``--cluster``, then ``cluster stop``."""
    ns = setup
    before = _children()
    clustermod.stop_cluster()
    problems = []
    engines: set = set()
    try:
        with capture_output() as cap:
            shell.run_line_magic("dataparallel", "cluster start --engines local -n 2 --profile gpumagic-tests")
        assert "run cells with %%dataparallel --cluster" in cap.stderr
        started = clustermod.current_cluster()
        assert started is not None and started.owned
        assert str(started.cluster.profile_dir).startswith(str(_isolated))
        # a misspelt start refuses before it stops the running cluster
        with pytest.raises(UsageError, match="--engines nonsense"):
            shell.run_line_magic("dataparallel", "cluster start --engines nonsense -n 2")
        assert clustermod.current_cluster() is started and started.cluster.controller.poll() is None

        ref_model, ref_opt = reference(ns)
        cell(shell, "--cluster", TRAIN + WHERE)
        assert_trained_like(ns, ref_model, ref_opt)
        here = socket.gethostname()
        pids = last_result().pids
        # two engines on one host: LOCAL_RANK 0 and 1 of 2, one group
        assert [w[:5] for w in ns["everywhere"]] == [(here, "0", "0", "2", "1"), (here, "0", "1", "2", "1")]
        assert [w[5] for w in ns["everywhere"]] == pids
        text, rows = status_rows(shell)
        assert "the cluster started here (local, 2 engines); formed, 2 rank(s), backend gloo" in text
        assert [(r["rank"], r["LOCAL_RANK"], r["alive"]) for r in rows] == [("0", "0", "yes"), ("1", "1", "yes")]

        # a rank error leaves rank 0 in a barrier: it is stopped, and started again for the next cell
        before_model = snapshot(ns)
        with capture_output() as cap, pytest.raises(WorkerError) as err:
            shell.run_cell_magic("dataparallel", "--cluster", "import torch.distributed as dist\nout = model(X)\n"
                                 "if dist.get_rank() == 1:\n    raise ValueError('rank one fails')\n"
                                 "dist.barrier()\n")
        assert (err.value.rank, err.value.exc_type) == (1, "ValueError")
        assert_untouched(ns, before_model)
        if "did not end" in cap.stderr:
            assert "started again for the next cell" in cap.stderr, cap.stderr
        cell(shell, "--cluster", WORLD)
        assert ns["ws"] == 2
        pids = last_result().pids

        # an engine that dies: the next cell has both ranks again (engines of a cluster started here)
        with capture_output(), pytest.raises(WorkerError) as err:
            shell.run_cell_magic("dataparallel", "--cluster", "import os, signal, torch.distributed as dist\n"
                                 "out = model(X)\nif dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                                 "dist.barrier()\n")
        assert err.value.rank == 1 and "died" in err.value.message
        assert wait_gone([pids[1]], timeout=5) == []
        end = time.monotonic() + 15
        while len(started.client.ids) != 1 and time.monotonic() < end:   # the controller saw it go
            time.sleep(0.1)
        ns["ws"] = None
        try:
            with deadline(90):
                cell(shell, "--cluster", WORLD)
        except (UsageError, WorkerError, KeyboardInterrupt) as exc:
            problems.append(f"after an engine of the started cluster died, the next cell failed: "
                            f"{type(exc).__name__}: {exc}")
        if ns["ws"] not in (None, 2):
            problems.append(f"after an engine of the started cluster died, the next cell ran on {ns['ws']} rank(s) "
                            "of 2 (its engines were not started again)")
    finally:
        engines = _children() - before
        with capture_output() as cap:
            shell.run_line_magic("dataparallel", "cluster stop")
    assert "the cluster was stopped" in cap.stderr
    assert clustermod.current_cluster() is None
    left = wait_gone(engines, timeout=15)
    assert left == [], f"'cluster stop' left {describe(left)}"
    with pytest.raises(UsageError, match="none is running"):
        shell.run_cell_magic("dataparallel", "--cluster", "c = model(X).shape[0]\n")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------- a start that fails or is interrupted; a lost controller

def _cluster_processes(ipython_dir) -> list[int]:
    """Every process ipyparallel launched for a profile under ``ipython_dir`` (its IPP_PROFILE_DIR), whoever
    its parent is now: a child of this process, or an orphan."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("IPP_PROFILE_DIR", "").startswith(str(ipython_dir)) and proc.pid != os.getpid():
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return living(found)


def _assert_nothing_started(shell, ipython_dir, before: set) -> None:
    left = wait_gone(_children() - before, timeout=15) + wait_gone(_cluster_processes(ipython_dir), timeout=5)
    assert left == [], f"left running: {describe(left)}"
    assert clustermod.current_cluster() is None
    with capture_output() as cap:
        shell.run_line_magic("dataparallel", "cluster stop")
    assert "no cluster in use" in cap.stderr


def test_a_start_whose_launcher_fails_stops_what_it_started(shell, _isolated):
    # --engines mpi without mpiexec: the controller had started; it and its schedulers are stopped, and the
    # error says what failed, as a UsageError naming the launchers
    import shutil
    if shutil.which("mpiexec"):
        pytest.skip("mpiexec is installed here")
    clustermod.stop_cluster()
    before = _children()
    with pytest.raises(UsageError) as err:
        shell.run_line_magic("dataparallel", "cluster start --engines mpi -n 2 --profile gpumagic-failing")
    message = str(err.value)
    assert "--engines mpi" in message and "mpiexec" in message and "--engines local" in message, message
    assert "every process it had started was stopped" in message, message
    _assert_nothing_started(shell, _isolated, before)


def test_an_interrupted_start_stops_what_it_started(shell, _isolated):
    from gpumagic.errors import CellInterrupted
    clustermod.stop_cluster()
    before = _children()
    seen: list[int] = []

    def interrupt_once_engines_start():
        end = time.monotonic() + 60
        while time.monotonic() < end:
            engines = [pid for pid in living(c.pid for c in psutil.Process().children())
                       if "ipyparallel.engine" in describe([pid])]
            if engines:
                seen.extend(engines)
                os.kill(os.getpid(), signal.SIGINT)   # a real SIGINT, as the kernel's interrupt sends
                return
            time.sleep(0.01)
    watcher = threading.Thread(target=interrupt_once_engines_start, daemon=True)
    watcher.start()
    with pytest.raises(KeyboardInterrupt) as err:
        shell.run_line_magic("dataparallel", "cluster start --engines local -n 2 --profile gpumagic-interrupted")
    watcher.join()
    assert seen, "the engines never started"
    assert isinstance(err.value, CellInterrupted) and "every process it had started was stopped" in str(err.value)
    _assert_nothing_started(shell, _isolated, before)


def test_stop_after_the_controller_died_stops_its_schedulers_too(shell, _isolated):
    clustermod.stop_cluster()
    before = _children()
    with capture_output():
        shell.run_line_magic("dataparallel", "cluster start --engines local -n 1 --profile gpumagic-lost")
    started = clustermod.current_cluster()
    controller = psutil.Process(started.cluster.controller.pid)
    schedulers = [c.pid for c in controller.children(recursive=True)]
    assert schedulers, "the controller runs no schedulers"
    controller.kill()                          # as an OOM kill would
    controller.wait(10)
    assert living(schedulers) == schedulers    # orphaned, still running
    with capture_output() as cap:
        shell.run_line_magic("dataparallel", "cluster stop")
    assert "the cluster was stopped" in cap.stderr
    _assert_nothing_started(shell, _isolated, before)
