"""Fresh worker interpreters: the notebook's __main__ stays hidden, and bytecode is kept where
Python is told to write none (a spawned worker would otherwise compile torch anew each time)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpumagic.procs import bytecode, forkserver, start
from tests.conftest import ROOT, run_cell


@pytest.fixture
def bytecode_off(monkeypatch, tmp_path):
    """As in a container that sets PYTHONDONTWRITEBYTECODE and installed torch without bytecode.

    A fresh interpreter looks for bytecode under PYTHONPYCACHEPREFIX, here an
    empty folder: as far as workers can tell, torch has none. The cache is tmp_path/pycache.
    """
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "empty"))
    monkeypatch.setenv(bytecode.SETTING, str(tmp_path / "pycache"))
    return tmp_path / "pycache"


def _pycs(root) -> dict:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*.pyc")}


def test_no_cache_where_python_writes_bytecode_itself(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env[bytecode.SETTING] = str(tmp_path / "c")
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "empty")  # no bytecode for torch there
    probe = "from gpumagic.procs import bytecode; print(bytecode.worker_pycache())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == ["None"], out.stderr
    assert not (tmp_path / "c").exists()
    out = subprocess.run([sys.executable, "-B", "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == [str(tmp_path / "c")], out.stderr


def test_no_cache_where_torch_came_with_bytecode(monkeypatch, tmp_path):
    package = tmp_path / "site" / "torch"
    (package / "__pycache__").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.setattr(bytecode, "_torch_source", lambda: str(package / "__init__.py"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setenv(bytecode.SETTING, str(tmp_path / "c"))
    pyc = package / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"
    assert bytecode.bytecode_path(str(package / "__init__.py")) == str(pyc)
    assert bytecode.worker_pycache() == str(tmp_path / "c")      # none written at install: workers keep their own
    pyc.write_bytes(b"")
    assert bytecode.worker_pycache() is None                     # written at install: they read that
    # Under a prefix the workers inherit, that is where they look.
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "prefix"))
    assert bytecode.bytecode_path(str(package / "__init__.py")) == str(
        tmp_path / "prefix" / str(package).lstrip(os.sep) / pyc.name)
    assert bytecode.worker_pycache() == str(tmp_path / "c")


def test_cache_place_setting_and_off(monkeypatch, tmp_path, bytecode_off):
    assert bytecode.worker_pycache() == str(bytecode_off) and bytecode_off.is_dir()
    for off in ("off", "OFF", "0", "no"):
        monkeypatch.setenv(bytecode.SETTING, off)
        assert bytecode.worker_pycache() is None
    monkeypatch.delenv(bytecode.SETTING)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bytecode.worker_pycache() == str(tmp_path / "xdg" / "gpumagic" / "pycache")
    # A place that cannot be made (under a file): workers compile as Python would anyway.
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(bytecode.SETTING, str(tmp_path / "file" / "pycache"))
    assert bytecode.worker_pycache() is None


def test_starting_hides_main_and_restores_it_and_the_environment(bytecode_off):
    main = sys.modules["__main__"]
    with pytest.raises(RuntimeError):
        with start.starting("spawn"):
            assert sys.modules["__main__"] is not main and sys.modules["__main__"].__spec__ is None
            assert os.environ[bytecode.WORKER_ENV] == str(bytecode_off)
            raise RuntimeError("start failed")
    assert sys.modules["__main__"] is main and bytecode.WORKER_ENV not in os.environ
    with start.starting("fork"):
        assert sys.modules["__main__"] is main and bytecode.WORKER_ENV not in os.environ


REPORT_BYTECODE = """%%sharedtrain --nprocs 2 --start-method {method} --model model
import importlib.util, os, sys, torch
report(prefix=sys.pycache_prefix, off=sys.dont_write_bytecode, env=os.environ.get("GPUMAGIC_WORKER_PYCACHE"),
       torch_pyc=os.path.exists(importlib.util.cache_from_source(torch.__file__)))
"""


def _worker_reports(shell, method):
    result, out, _ = run_cell(shell, REPORT_BYTECODE.format(method=method))
    assert result.error_in_exec is None, out
    return [h[-1] for h in shell.user_ns["sharedtrain"].history]


def test_spawned_workers_keep_bytecode_in_the_cache_and_read_it_later(shell, bytecode_off):
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(2, 1)")
    kernel = (sys.dont_write_bytecode, sys.pycache_prefix)
    first = _worker_reports(shell, "spawn")
    assert [(r["prefix"], r["off"], r["env"]) for r in first] == [(str(bytecode_off), False, None)] * 2
    assert all(r["torch_pyc"] for r in first)
    written = _pycs(bytecode_off)
    # torch's own modules are among what the workers compiled, under the cache, not beside the sources.
    torch_init = os.path.dirname(sys.modules["torch"].__file__).lstrip(os.sep)
    assert any(str(p).startswith(str(bytecode_off / torch_init)) for p in written), sorted(written)[:5]
    # The next cell's workers read that bytecode: nothing is compiled or written again.
    _worker_reports(shell, "spawn")
    assert _pycs(bytecode_off) == written
    # The kernel itself is as Python was told.
    assert (sys.dont_write_bytecode, sys.pycache_prefix) == kernel and bytecode.WORKER_ENV not in os.environ


def test_the_fork_server_keeps_bytecode_too(shell, bytecode_off):
    forkserver.stop()
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(2, 1)")
    try:
        reports = _worker_reports(shell, "forkserver")
    finally:
        forkserver.stop()
    assert [(r["prefix"], r["off"], r["env"]) for r in reports] == [(str(bytecode_off), False, None)] * 2
    assert _pycs(bytecode_off)


def test_turned_off_workers_write_no_bytecode(shell, bytecode_off, monkeypatch):
    monkeypatch.setenv(bytecode.SETTING, "off")
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(2, 1)")
    reports = _worker_reports(shell, "spawn")
    # The prefix is the one the environment gives them, and they write nothing.
    assert [(r["prefix"], r["off"]) for r in reports] == [(os.environ["PYTHONPYCACHEPREFIX"], True)] * 2
    assert not bytecode_off.exists() and not os.path.exists(os.environ["PYTHONPYCACHEPREFIX"])


def pool_task(ctx, meta, data):
    """Run on each rank of a WorkerPool (named ``tests.test_procs_bytecode:pool_task``)."""
    return {"prefix": sys.pycache_prefix, "off": sys.dont_write_bytecode}


def test_dataparallel_ranks_keep_bytecode_too(bytecode_off):
    from gpumagic.procs.pool import WorkerPool
    pool = WorkerPool(["cpu", "cpu"], None).start()
    try:
        results = pool.run("tests.test_procs_bytecode:pool_task")
    finally:
        pool.stop()
    assert [r for r, _ in results] == [{"prefix": str(bytecode_off), "off": False}] * 2


def test_loading_the_extension_fills_the_cache_in_the_background(shell, bytecode_off):
    from gpumagic import session
    torch_source = sys.modules["torch"].__file__
    try:
        shell.run_line_magic("unload_ext", "gpumagic")
        shell.run_line_magic("load_ext", "gpumagic")
        warming = bytecode._warming
        assert warming is not None and "pycache-warm" in session._closers
        assert warming.wait(120) == 0
        # What workers import is there before any worker ran: torch, DDP, torch._dynamo, gpumagic.
        for module in ("torch", "torch._dynamo", "torch.nn.parallel", "gpumagic.sharedtrain.worker"):
            source = sys.modules[module].__file__ if module in sys.modules else None
            if source is None:
                import importlib.util
                source = importlib.util.find_spec(module).origin
            assert os.path.exists(bytecode.bytecode_path(source, str(bytecode_off))), module
        # A fresh start reaps it; with the cache filled, loading again starts nothing.
        with start.starting("spawn"):
            pass
        assert bytecode._warming is None and "pycache-warm" not in session._closers
        assert bytecode.warm_cache() is None
        assert os.path.exists(bytecode.bytecode_path(torch_source, str(bytecode_off)))
    finally:
        bytecode.stop_warming()


def test_unloading_the_extension_stops_the_warming_process(shell, bytecode_off):
    try:
        shell.run_line_magic("unload_ext", "gpumagic")
        shell.run_line_magic("load_ext", "gpumagic")
        warming = bytecode._warming
        assert warming is not None and warming.poll() is None
    finally:
        shell.run_line_magic("unload_ext", "gpumagic")
        shell.run_line_magic("load_ext", "gpumagic")  # starts another: the cache is still not full
        bytecode.stop_warming()
    assert warming.poll() is not None and bytecode._warming is None
