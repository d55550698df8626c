"""An ipyparallel cluster started by hand for the ``%%dataparallel --cluster`` tests.

:class:`HandCluster` runs one ``ipcontroller`` on loopback and one ``ipengine``
per host name, each engine with ``GPUMAGIC_HOST`` set so that engines on this
machine stand for distinct hosts. Everything lives in one directory (the
profile, ``IPYTHONDIR``, the logs): nothing touches ``~/.ipython``. Each
process is started in a session of its own so that it and whatever it starts
(the controller's schedulers, an engine's nanny) can be ended together.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ipyparallel's programs through this Python (its console scripts may live in another environment's
# bin, where the package comes from system site-packages)
CONTROLLER = [sys.executable, "-m", "ipyparallel.controller"]
ENGINE = [sys.executable, "-m", "ipyparallel.engine"]
HOST_VARIABLE = "GPUMAGIC_HOST"


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it, those there now."""
    try:
        proc = psutil.Process(pid)
        return {pid} | {c.pid for c in proc.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def living(pids) -> list[int]:
    """Those of ``pids`` still running (a zombie counts as ended)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, timeout: float = 15.0) -> list[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to end; those still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not living(pids):
            return []
        time.sleep(0.1)
    return living(pids)


def describe(pids) -> str:
    """``pid: command line`` of each of ``pids`` (for failure messages)."""
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:160]}")
        except psutil.NoSuchProcess:
            out.append(f"{pid}: (gone)")
    return "; ".join(out)


class HandCluster:
    """``ipcontroller`` and one ``ipengine`` per entry of ``hosts``, all under ``workdir``.

    ``pythonpath`` goes first on the processes' ``PYTHONPATH`` (this checkout by default, so that the
    engines import its gpumagic).
    """

    def __init__(self, workdir, hosts=("host-a", "host-b"), pythonpath: list[str] | None = None):
        self.dir = Path(workdir)
        self.profile = self.dir / "profile"
        self.ipython_dir = self.dir / "ipython"
        self.hosts = list(hosts)
        self.pythonpath = list(pythonpath) if pythonpath is not None else [ROOT]
        self.controller: subprocess.Popen | None = None
        self.engines: dict[str, subprocess.Popen] = {}
        self.started: set[int] = set()      # every process started here, or seen below one
        self.restarts = 0
        self._logs: list = []

    # ---------------------------------------------------------------- files and environment
    @property
    def client_file(self) -> Path:
        return self.profile / "security" / "ipcontroller-client.json"

    @property
    def engine_file(self) -> Path:
        return self.profile / "security" / "ipcontroller-engine.json"

    def env(self, host: str | None = None) -> dict:
        env = dict(os.environ)
        env["IPYTHONDIR"] = str(self.ipython_dir)
        env["PYTHONPATH"] = os.pathsep.join(self.pythonpath + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["OMP_NUM_THREADS"] = "1"
        env.pop(HOST_VARIABLE, None)
        if host is not None:
            env[HOST_VARIABLE] = host
        return env

    def _popen(self, args: list[str], env: dict, log: str) -> subprocess.Popen:
        out = open(self.dir / log, "ab")   # closed in stop()
        self._logs.append(out)
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(self.dir), start_new_session=True)
        self.started.add(proc.pid)
        return proc

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    # ---------------------------------------------------------------- starting
    def start(self, timeout: float = 90.0) -> HandCluster:
        """Start the controller and the engines; return once every engine is registered."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ipython_dir.mkdir(exist_ok=True)
        deadline = time.monotonic() + timeout
        self.controller = self._popen(
            [*CONTROLLER, f"--profile-dir={self.profile}", "--ip=127.0.0.1", "--ping=500",
             "--log-level=ERROR"], self.env(), "controller.log")
        while not (self.client_file.exists() and self.engine_file.exists()):
            if self.controller.poll() is not None:
                raise RuntimeError(f"ipcontroller ended ({self.controller.returncode}): {self.log('controller')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ipcontroller wrote no connection files: {self.log('controller')}")
            time.sleep(0.05)
        time.sleep(0.2)   # both files written whole
        for host in self.hosts:
            self._start_engine(host)
        self.wait_registered(len(self.hosts), timeout=deadline - time.monotonic())
        self.note_processes()
        return self

    def _start_engine(self, host: str) -> subprocess.Popen:
        proc = self._popen([*ENGINE, f"--file={self.engine_file}", "--timeout=30",
                            "--log-level=ERROR"], self.env(host), f"engine-{host}.log")
        self.engines[host] = proc
        return proc

    def client(self, timeout: float = 10.0):
        import ipyparallel as ipp
        return ipp.Client(str(self.client_file), timeout=timeout)

    def registered(self) -> list[int]:
        """The engine ids the controller has now."""
        c = self.client()
        try:
            return sorted(c.ids)
        finally:
            c.close()

    def wait_registered(self, n: int, timeout: float = 60.0) -> list[int]:
        """Wait until exactly ``n`` engines are registered (the ended ones unregistered); their ids."""
        c = self.client()
        try:
            deadline = time.monotonic() + max(timeout, 1.0)
            while len(c.ids) != n:
                if time.monotonic() > deadline:
                    logs = "\n".join(f"{h}: {self.log('engine-' + h)}" for h in self.hosts)
                    raise TimeoutError(f"{len(c.ids)} engine(s) registered, not {n}:\n{logs}")
                time.sleep(0.1)
            return sorted(c.ids)
        finally:
            c.close()

    def engine_pid(self, host: str) -> int:
        """The pid of ``host``'s engine (the ``ipengine`` process is the engine's kernel)."""
        return self.engines[host].pid

    def heal(self, timeout: float = 60.0) -> bool:
        """Start the engines that ended again (killed by a test or by gpumagic), and wait until every host
        has exactly its one engine registered. Returns whether any was started."""
        self.note_processes()
        ended = [h for h, p in self.engines.items() if p.poll() is not None]
        for host in ended:
            self.engines[host].wait()
            self._start_engine(host)
        if ended:
            self.restarts += len(ended)
        self.wait_registered(len(self.hosts), timeout=timeout)
        self.note_processes()
        return bool(ended)

    def note_processes(self) -> None:
        """Remember every process now below the ones started here (for the end-of-run check)."""
        for proc in [self.controller, *self.engines.values()]:
            if proc is not None:
                self.started |= descendants(proc.pid)

    # ---------------------------------------------------------------- ending
    def kill_controller(self) -> None:
        """The controller and its schedulers, at once (a controller host that went away)."""
        assert self.controller is not None
        self.note_processes()
        _kill_group(self.controller.pid, signal.SIGKILL)
        for pid in living(descendants(self.controller.pid)):
            _kill(pid, signal.SIGKILL)

    def stop(self) -> list[int]:
        """End every process started here; those that did not end (should be none)."""
        self.note_processes()
        procs = [p for p in [*self.engines.values(), self.controller] if p is not None]
        for proc in procs:
            _kill_group(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for proc in procs:
            _kill_group(proc.pid, signal.SIGKILL)   # what is left of each session (a nanny, schedulers)
        for pid in living(self.started):
            _kill(pid, signal.SIGKILL)
        for f in self._logs:
            f.close()
        self._logs = []
        return wait_gone(self.started, timeout=10)


def _kill_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def fake_package(where: Path, name: str) -> Path:
    """A directory holding a package ``name`` whose import fails as a missing one's does; put it first on
    a ``PYTHONPATH`` to make ``name`` unimportable there."""
    pkg = where / name
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(f"raise ModuleNotFoundError({f'No module named {name!r}'!r}, name={name!r})\n")
    return where


class Deadline:
    """What :func:`deadline` yields: whether it fired."""
    fired = False


@contextmanager
def deadline(seconds: float):
    """Interrupt the main thread (a real SIGINT, which also ends a blocked lock wait) if the block runs
    longer than ``seconds``: a hang becomes a ``KeyboardInterrupt`` and the test can say so."""
    state = Deadline()
    done = threading.Event()
    lock = threading.Lock()

    def watch():
        if not done.wait(seconds):
            with lock:
                if not done.is_set():
                    state.fired = True
                    os.kill(os.getpid(), signal.SIGINT)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield state
    finally:
        with lock:
            done.set()
        if state.fired:
            try:
                time.sleep(0.2)   # a SIGINT still on its way lands here
            except KeyboardInterrupt:
                pass
        watcher.join()
