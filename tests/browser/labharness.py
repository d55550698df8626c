"""A throw-away JupyterLab on loopback and a headless Debian Chromium driving it.

Nothing here touches the user's Jupyter or IPython settings: every Jupyter
folder (data, config, runtime, kernels, lab settings, workspaces) and the
IPython profile live in a temporary directory, and the only kernel, ``python3``,
is the Python running the tests with the repository on its path.

Nothing here waits a fixed time for JupyterLab: the server is ready when its
REST API answers, and a notebook's kernel is ready when it answers a
``kernel_info_request`` sent through the server's websocket (as JupyterLab's own
is) and the server reports it idle; every wait ends as soon as its condition
holds, under a generous limit for slow machines.

``GPUMAGIC_BROWSER_KERNEL_DELAY=SECONDS`` makes every kernel sleep that long
before it starts, to check the test against a slow kernel start.
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from importlib import metadata
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = "/usr/bin/chromium"
KERNEL_NAME = "python3"
KERNEL_DISPLAY_NAME = "Python 3 (ipykernel)"
KERNEL_DELAY_ENV = "GPUMAGIC_BROWSER_KERNEL_DELAY"
# Chromium on these machines runs as root without a display or network; these
# flags keep it from needing a sandbox, a GPU, or any outside service.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-quic",
    "--disable-dev-shm-usage",
]


WIDGET_MANAGER = "labextensions/@jupyter-widgets/jupyterlab-manager/package.json"


def missing_requirements() -> list[str]:
    """What the browser test lacks on this machine (empty when it can run)."""
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"Debian chromium ({CHROMIUM})")
    for module in ("jupyterlab", "playwright", "jupyterlab_widgets", "ipykernel"):
        if importlib.util.find_spec(module) is None:
            missing.append(f"python package {module}")
    if importlib.util.find_spec("jupyterlab_widgets") is not None and widget_data_dir() is None:
        missing.append("the ipywidgets lab extension (jupyterlab_widgets' " + WIDGET_MANAGER + ")")
    return missing


def widget_data_dir() -> Path | None:
    """The ``share/jupyter`` folder holding the installed ipywidgets lab extension.

    jupyterlab_widgets installs it as data files under its own prefix. In a
    virtual environment made with --system-site-packages whose jupyterlab_widgets
    comes from the base Python, that prefix is not one JupyterLab searches, and
    every widget then fails in the page with "Exception opening new comm".
    """
    try:
        dist = metadata.distribution("jupyterlab_widgets")
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if str(file).endswith(WIDGET_MANAGER):
            found = Path(dist.locate_file(file)).resolve()
            return found.parents[WIDGET_MANAGER.count("/")]
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def _kernel_argv() -> list[str]:
    """``python -m ipykernel_launcher``, after a sleep when KERNEL_DELAY_ENV asks for a slow start."""
    delay = os.environ.get(KERNEL_DELAY_ENV, "").strip()
    if not delay:
        return [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    seconds = float(delay)
    if not 0 <= seconds < 3600:
        raise ValueError(f"{KERNEL_DELAY_ENV}={delay!r}: give seconds, 0 to 3600")
    code = (f"import runpy, time; time.sleep({seconds!r}); "
            "runpy.run_module('ipykernel_launcher', run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code, "-f", "{connection_file}"]


def _kernel_info_request(session: str) -> dict:
    return {
        "header": {"msg_id": uuid.uuid4().hex, "msg_type": "kernel_info_request", "session": session,
                   "username": "browser-test", "version": "5.3", "date": ""},
        "parent_header": {}, "metadata": {}, "content": {}, "buffers": [], "channel": "shell",
    }


class LabServer:
    """``jupyter lab`` serving ``root`` on 127.0.0.1 with a random port and token."""

    def __init__(self, home: Path):
        self.home = home
        self.root = home / "notebooks"
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.port = None
        self.proc = None
        self.log_path = home / "jupyterlab.log"
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _environ(self) -> dict:
        home = self.home
        jupyter_path = home / "jupyter-path"
        # The kernel is this very interpreter, with the checkout importable, so
        # the notebook runs the gpumagic under test whether or not it is installed.
        _write_json(jupyter_path / "kernels" / KERNEL_NAME / "kernel.json", {
            "argv": _kernel_argv(),
            "display_name": KERNEL_DISPLAY_NAME,
            "language": "python",
            "metadata": {"debugger": False},
        })
        settings = home / "lab-settings"
        # Render every cell (no virtual scrolling) so the test sees each output,
        # and ask no outside server for news or updates.
        _write_json(settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings",
                    {"windowingMode": "none"})
        _write_json(settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings",
                    {"checkForUpdates": False, "fetchNews": "false"})
        env = dict(os.environ)
        pythonpath = [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        # The widget manager's lab extension wherever its package put it (see widget_data_dir).
        widgets = widget_data_dir()
        data_path = [str(jupyter_path)] + ([str(widgets)] if widgets else [])
        env.update({
            "PYTHONPATH": os.pathsep.join(pythonpath),
            "JUPYTER_PATH": os.pathsep.join(data_path),
            "JUPYTER_DATA_DIR": str(home / "jupyter-data"),
            "JUPYTER_CONFIG_DIR": str(home / "jupyter-config"),
            "JUPYTER_RUNTIME_DIR": str(home / "jupyter-runtime"),
            "IPYTHONDIR": str(home / "ipython"),
            "JUPYTER_PLATFORM_DIRS": "0",
        })
        env.pop("JUPYTER_TOKEN", None)
        return env

    def start(self, timeout: float = 120.0) -> LabServer:
        env = self._environ()
        self._log = open(self.log_path, "ab")
        for _attempt in range(3):  # a port found free can be taken before we bind it
            self.port = _free_port()
            cmd = [
                sys.executable, "-m", "jupyterlab",
                "--no-browser",
                "--ip=127.0.0.1",
                f"--port={self.port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root}",
                f"--LabApp.user_settings_dir={self.home / 'lab-settings'}",
                f"--LabApp.workspaces_dir={self.home / 'lab-workspaces'}",
                "--ServerApp.allow_remote_access=False",
                "--ServerApp.shutdown_no_activity_timeout=1800",
                "--MappingKernelManager.cull_idle_timeout=0",
            ]
            if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI machines run as root
                cmd.append("--ServerApp.allow_root=True")
            self.proc = subprocess.Popen(cmd, env=env, cwd=self.root, stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if self._wait_ready(timeout):
                return self
            self.stop()
        raise RuntimeError(f"JupyterLab did not start; log:\n{self.log_text()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                self.api("GET", "/api/status", timeout=2)
                return True
            except (OSError, urllib.error.URLError):
                time.sleep(0.3)
        return False

    def api(self, method: str, path: str, body=None, timeout: float = 10):
        headers = {"Authorization": f"token {self.token}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, method=method, data=data, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def start_kernel_for(self, path: str, timeout: float = 300.0) -> str:
        """Start the notebook ``path``'s session and kernel, and return once the kernel is idle.

        JupyterLab, opening the notebook afterwards, finds the session by its
        path and connects to the running kernel instead of starting one while
        the page loads, so the page never has a notebook whose kernel is
        still on its way (cells run then put up JupyterLab's "Select Kernel"
        dialog, as seen on a loaded machine). Returns the kernel id.
        """
        deadline = time.monotonic() + timeout
        session = self.api("POST", "/api/sessions", {
            "path": path, "name": Path(path).name, "type": "notebook", "kernel": {"name": KERNEL_NAME},
        }, timeout=timeout)
        kernel_id = session["kernel"]["id"]
        self.wait_kernel_idle(kernel_id, deadline)
        return kernel_id

    def wait_kernel_idle(self, kernel_id: str, deadline: float) -> None:
        """Until ``deadline`` (monotonic): the kernel answers kernel_info and the server says idle.

        A kernel nobody talks to stays "starting" in the server's eyes, so
        this asks it, through the server's websocket as JupyterLab does.
        """
        self._kernel_info(kernel_id, deadline)
        state = None
        while time.monotonic() < deadline:
            try:
                state = self.api("GET", f"/api/kernels/{kernel_id}")["execution_state"]
            except OSError:  # a busy server that did not answer in time: ask again
                time.sleep(0.2)
                continue
            if state == "idle":
                return
            if state == "dead":
                break
            time.sleep(0.2)
        raise RuntimeError(f"kernel {kernel_id} is {state}, not idle; log:\n{self.log_text()}")

    def _kernel_info(self, kernel_id: str, deadline: float) -> dict:
        """Ask for kernel_info (again every few seconds: one sent before the kernel listens can be lost)."""
        import websocket  # websocket-client: a requirement of jupyter_server

        session = uuid.uuid4().hex
        url = f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels?session_id={session}"
        while time.monotonic() < deadline:
            try:
                # The server answers the handshake once it has heard from the kernel, or
                # after its kernel_info_timeout: a slow kernel makes connecting slow too.
                ws = websocket.create_connection(url, header=[f"Authorization: token {self.token}"],
                                                 timeout=max(1.0, deadline - time.monotonic()))
            except (OSError, websocket.WebSocketException):
                time.sleep(0.5)
                continue
            try:
                asked = set()
                while time.monotonic() < deadline:
                    request = _kernel_info_request(session)
                    asked.add(request["header"]["msg_id"])
                    ws.send(json.dumps(request))
                    resend = min(deadline, time.monotonic() + 5)
                    while time.monotonic() < resend:
                        ws.settimeout(max(0.1, resend - time.monotonic()))
                        try:
                            message = json.loads(ws.recv() or "{}")
                        except websocket.WebSocketTimeoutException:
                            break
                        if (message.get("header", {}).get("msg_type") == "kernel_info_reply"
                                and message.get("parent_header", {}).get("msg_id") in asked):
                            return message["content"]
            except (OSError, websocket.WebSocketException):
                time.sleep(0.5)  # the server closed it (a kernel restarting, say): connect again
            finally:
                ws.close()
        raise RuntimeError(f"kernel {kernel_id} never answered kernel_info; log:\n{self.log_text()}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Shut kernels and server down politely, then make sure no process is left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:  # gone already: nothing to end by pid
            family = []
        if proc.poll() is None:
            try:
                for kernel in self.api("GET", "/api/kernels", timeout=5) or []:
                    self.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=30)
                self.api("POST", "/api/shutdown", timeout=10)
            except Exception:  # noqa: BLE001 - a server that does not answer is stopped by signal
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        # Kernels run in their own sessions: end any that outlived the server, by pid.
        for p in family:
            try:
                if p.is_running() and p.status() != "zombie":
                    p.kill()
            except psutil.Error:
                pass  # it ended meanwhile
        if self._log is not None:
            self._log.flush()


class Browser:
    """Headless Debian Chromium under Playwright, with a fresh profile."""

    def __init__(self, home: Path):
        self.home = home
        self._pw = None
        self.context = None
        self.console: list[str] = []

    def start(self):
        from playwright.sync_api import sync_playwright
        self._pw = sync_playwright().start()
        profile = self.home / "chromium-profile"
        shutil.rmtree(profile, ignore_errors=True)
        self.context = self._pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
            timeout=180_000,  # a limit, not a wait: a busy machine can take a while to start Chromium
        )
        # Playwright's waits end as soon as their condition holds: this is only their limit.
        self.context.set_default_timeout(120_000)
        page = self.context.pages[0] if self.context.pages else self.context.new_page()
        page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))
        return page

    def stop(self) -> None:
        try:
            if self.context is not None:
                self.context.close()
        finally:
            self.context = None
            if self._pw is not None:
                self._pw.stop()
                self._pw = None
