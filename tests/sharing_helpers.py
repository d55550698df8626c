"""Real processes for ``%gpumem --who`` and ``--reclaim``: a Jupyter server with kernels, orphans, another
user's process. Shared by the CPU tests (with the fake NVML), the GPU test and ``benchmarks/who.py``.

Every process started here is recorded in a :class:`Started` and ended by pid (SIGKILL) by its
``end_all``; nothing is ever ended by name.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534


class Started:
    """The pids a test started, to end by pid afterwards (even those that became orphans)."""

    def __init__(self):
        self.pids: list[int] = []
        self.popens: list[subprocess.Popen] = []

    def add(self, pid: int) -> int:
        self.pids.append(pid)
        return pid

    def popen(self, argv, **kwargs) -> subprocess.Popen:
        env = kwargs.pop("env", None) or dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, **kwargs)
        self.popens.append(proc)
        self.add(proc.pid)
        return proc

    def end_all(self) -> None:
        for pid in reversed(self.pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass   # gone already
        for proc in self.popens:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass   # (a process in uninterruptible sleep: nothing more to do from here)


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for its (new) parent to reap it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(condition, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s")


# --- orphans: a "kernel" starts a process, then dies; the process lives on, taken over by init

_ORPHAN_KERNEL = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), *sys.argv[2:]])
ready = sys.argv[2]
while not os.path.exists(ready):
    time.sleep(0.02)
print(child.pid, flush=True)
os._exit(0)   # the kernel dies; its child is left behind
"""

_MARKED_WORKER = """
import os, signal, sys, time
from gpumagic.procs.marks import mark_worker
kernel, ready, rank, hold = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
if sys.argv[5] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
held = None
if hold != "0":
    import torch
    held = torch.empty(int(hold), dtype=torch.uint8, device="cuda")   # GPU memory, as a rank's model
    torch.cuda.synchronize()
mark_worker(rank, 2, kernel)
open(ready, "w").close()
time.sleep(600)
"""


def orphan_worker(started: Started, tmp: Path, rank: int = 0, hold_bytes: int = 0,
                  ignore_term: bool = False) -> tuple[int, int]:
    """A gpumagic-marked worker (rank ``rank``) whose kernel died; returns ``(worker pid, dead kernel pid)``.

    ``hold_bytes``: GPU memory it allocates first (a GPU machine only).
    """
    ready = tmp / f"orphan-{time.monotonic_ns()}.ready"
    kernel = started.popen([sys.executable, "-c", _ORPHAN_KERNEL, _MARKED_WORKER, str(ready), str(rank),
                            str(hold_bytes), "ignore-term" if ignore_term else "-"], stdout=subprocess.PIPE, text=True)
    pid = started.add(_first_line_pid(kernel))
    wait_until(lambda: _parent(pid) != kernel.pid, what=f"worker {pid} taken over by init")
    return pid, kernel.pid


def live_worker(started: Started, tmp: Path, rank: int, kernel_pid: int | None = None,
                record_signals: Path | None = None) -> int:
    """A marked worker of this process (rank ``rank``) that writes every SIGTERM it gets to ``record_signals``."""
    ready = tmp / f"worker-{rank}-{time.monotonic_ns()}.ready"
    code = f"""
import os, signal, sys, time
from gpumagic.procs.marks import mark_worker
record = {str(record_signals) if record_signals else None!r}
if record:
    signal.signal(signal.SIGTERM, lambda *a: open(record, "a").write("SIGTERM\\n"))
mark_worker({rank}, 2, {kernel_pid or os.getpid()})
open({str(ready)!r}, "w").close()
while True:
    time.sleep(1)
"""
    proc = started.popen([sys.executable, "-c", code])
    wait_until(ready.exists, what=f"worker rank {rank} ready")
    return proc.pid


_SPAWNING_KERNEL = """
import multiprocessing, os, sys, time
if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    child.start()
    print(child.pid, flush=True)
    os._exit(0)   # dies without joining: the spawned child is left behind
"""


def multiprocessing_orphan(started: Started, tmp: Path) -> int:
    """A multiprocessing (spawn) child whose parent died."""
    script = tmp / "spawning_kernel.py"
    script.write_text(_SPAWNING_KERNEL)
    parent = started.popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pid = started.add(_first_line_pid(parent))
    wait_until(lambda: _parent(pid) not in (parent.pid, None), what=f"spawned child {pid} taken over by init")
    return pid


def _first_line_pid(proc: subprocess.Popen) -> int:
    """The pid the process prints first, once it has exited (its children keep its stdout open: no
    ``communicate``, which would wait for them)."""
    line = proc.stdout.readline()
    proc.wait(300)
    proc.stdout.close()
    return int(line.split()[0])


def _parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


def other_users_process(started: Started, argv=("sleep", "600"), ready=None) -> tuple[int, str]:
    """A process of another user: ``argv`` run as ``nobody`` where this runs as root, else init (pid 1).

    ``ready``: a condition on its pid to wait for (it holds its GPU memory, say).
    """
    if os.geteuid() != 0:
        return 1, psutil.Process(1).username()
    env = {**os.environ, "HOME": "/tmp"}   # (root's home is not nobody's to write caches in)
    proc = started.popen(list(argv), cwd="/", env=env, user=NOBODY, group=NOBODY, extra_groups=[])
    wait_until(lambda: psutil.Process(proc.pid).uids().real == NOBODY, what="the process to become nobody's")
    if ready is not None:
        wait_until(lambda: proc.poll() is None and ready(proc.pid), 300, "another user's process to be ready")
    return proc.pid, psutil.Process(proc.pid).username()


def detached(started: Started, argv) -> int:
    """``argv`` started through a parent that exits at once: taken over by init, child of no one here."""
    code = "import subprocess, sys; print(subprocess.Popen(sys.argv[1:]).pid, flush=True)"
    parent = started.popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, text=True)
    pid = started.add(_first_line_pid(parent))
    wait_until(lambda: _parent(pid) not in (parent.pid, None), what=f"{pid} taken over by init")
    return pid


# --- a real Jupyter server, on loopback, with its files in a temporary runtime directory

class JupyterServerProcess:
    """``python -m jupyter_server`` on 127.0.0.1, port chosen by the system, its files under ``home``.

    The kernels it starts are this Python (``python3``), with this checkout importable.
    """

    def __init__(self, started: Started, home: Path, kernel_env: dict | None = None):
        self.started = started
        self.home = home
        self.root = home / "notebooks"
        self.runtime = home / "runtime"
        self.kernel_env = kernel_env or {}
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def _environ(self) -> dict:
        spec = self.home / "jupyter-path" / "kernels" / "python3" / "kernel.json"
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(json.dumps({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                    "display_name": "Python 3", "language": "python",
                                    "env": {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [
                                        os.environ.get("PYTHONPATH")])]), **self.kernel_env}}))
        env = dict(os.environ)
        env.update({"JUPYTER_PATH": str(self.home / "jupyter-path"), "JUPYTER_RUNTIME_DIR": str(self.runtime),
                    "JUPYTER_CONFIG_DIR": str(self.home / "config"), "JUPYTER_DATA_DIR": str(self.home / "data"),
                    "IPYTHONDIR": str(self.home / "ipython"), "JUPYTER_PLATFORM_DIRS": "0"})
        env.pop("JUPYTER_TOKEN", None)
        return env

    def start(self, timeout: float = 120.0) -> JupyterServerProcess:
        self.root.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ip=127.0.0.1", "--port=0",
                f"--ServerApp.root_dir={self.root}", "--IdentityProvider.token=" + os.urandom(16).hex(),
                "--ServerApp.allow_remote_access=False", "--MappingKernelManager.cull_idle_timeout=0"]
        if os.geteuid() == 0:
            argv.append("--allow-root")
        log = open(self.home / "server.log", "ab")
        self.proc = self.started.popen(argv, env=self._environ(), cwd=self.root, stdout=log, stderr=subprocess.STDOUT)
        info_file = self.runtime / f"jpserver-{self.proc.pid}.json"

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter_server exited: {(self.home / 'server.log').read_text()[-3000:]}")
            if not info_file.exists():
                return False
            try:
                self.info = json.loads(info_file.read_text())
                return self.api("GET", "api/status", timeout=2) is not None
            except (OSError, ValueError):
                return False
        wait_until(ready, timeout, "the Jupyter server to answer")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.info['port']}{self.info.get('base_url', '/')}"

    def api(self, method: str, path: str, body=None, timeout: float = 30.0):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Authorization": f"token {self.info['token']}",
                                                  "Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=timeout) as response:
            text = response.read()
        return json.loads(text) if text else {}

    def start_kernel(self, notebook: str) -> tuple[str, int]:
        """A session (and its kernel) for ``notebook`` (created empty); returns ``(kernel id, kernel pid)``."""
        path = self.root / notebook
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
        session = self.api("POST", "api/sessions", {"path": notebook, "name": path.name, "type": "notebook",
                                                    "kernel": {"name": "python3"}})
        kid = session["kernel"]["id"]
        pid = wait_until(lambda: self.kernel_pid(kid), 60, f"kernel {kid}'s process")
        return kid, self.started.add(pid)

    def kernel_pid(self, kid: str) -> int | None:
        for child in psutil.Process(self.proc.pid).children():
            try:
                if any(arg.endswith(f"kernel-{kid}.json") for arg in child.cmdline()):
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        return None

    def connection_file(self, kid: str) -> Path:
        return self.runtime / f"kernel-{kid}.json"

    def execute(self, kid: str, code: str, timeout: float = 300.0) -> str:
        """Run ``code`` in kernel ``kid``; returns what it printed."""
        from jupyter_client import BlockingKernelClient
        client = BlockingKernelClient(connection_file=str(self.connection_file(kid)))
        client.load_connection_file()
        client.start_channels()
        out: list[str] = []
        try:
            client.wait_for_ready(timeout=timeout)
            reply = client.execute_interactive(code, timeout=timeout, output_hook=lambda msg: out.append(
                msg["content"].get("text", "") if msg["msg_type"] == "stream" else
                "".join(msg["content"].get("traceback", [])) if msg["msg_type"] == "error" else ""))
        finally:
            client.stop_channels()
        if reply["content"]["status"] != "ok":
            raise AssertionError(f"the kernel's cell failed: {''.join(out)}")
        return "".join(out)

    def shut_down_kernel(self, kid: str) -> None:
        self.api("DELETE", f"api/kernels/{kid}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            for kernel in self.api("GET", "api/kernels", timeout=5):
                self.api("DELETE", f"api/kernels/{kernel['id']}", timeout=30)
            self.api("POST", "api/shutdown", timeout=10)
            self.proc.wait(30)
        except Exception:  # noqa: BLE001 - a server that does not answer is ended by pid with the rest
            self.proc.kill()


# --- the floors of %gpumem --who and --reclaim: two notebooks' kernels, an orphaned worker, another user

@dataclass
class Floors:
    """What :func:`floors` started: ``kernels`` maps notebook paths to ``(kernel id, pid, GiB held)``."""
    server: JupyterServerProcess
    kernels: dict
    orphan: int
    dead_kernel: int
    other: int
    other_user: str


_HOLD = """
import sys, time, torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("holding", flush=True)
time.sleep(600)
"""


def floors(started: Started, home: Path, on_gpu: bool, kernels=(("team/a.ipynb", 10), ("b.ipynb", 20)),
           orphan_gib: int = 5, other_gib: int = 1) -> Floors:
    """Two kernels under a real Jupyter server (holding 10 and 20 GiB), an orphaned gpumagic worker
    (5 GiB), another user's process (1 GiB). ``on_gpu=False``: the same processes, holding nothing (a
    fake NVML says what they hold)."""
    server = JupyterServerProcess(started, home / "jupyter").start()
    held = {}
    for notebook, gib in kernels:
        kid, pid = server.start_kernel(notebook)
        if on_gpu:
            server.execute(kid, f"import torch\nx = torch.empty({gib} * 2**30, dtype=torch.uint8, device='cuda')\n"
                                "torch.cuda.synchronize()")
        held[notebook] = (kid, pid, gib)
    orphan, dead = orphan_worker(started, home, rank=0, hold_bytes=orphan_gib * 2**30 if on_gpu else 0)
    if on_gpu:
        other, user = other_users_process(started, (sys.executable, "-c", _HOLD, str(other_gib * 2**30)),
                                          ready=lambda pid: _on_gpu(pid, other_gib * 2**30))
    else:
        other, user = other_users_process(started)
    return Floors(server, held, orphan, dead, other, user)


def _on_gpu(pid: int, nbytes: int) -> bool:
    """Whether NVML lists ``pid`` holding ``nbytes`` or more on a GPU (read here, with no CUDA context): its
    context is made and its tensor allocated, so what it holds stays put while the tests read it."""
    from gpumagic.devices import visible_gpus
    from gpumagic.devices.memory import listed_processes
    return any(((listed_processes(g.handle) or {}).get(pid) or 0) >= nbytes for g in visible_gpus()
               if g.handle is not None)
