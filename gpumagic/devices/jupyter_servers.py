"""Which notebook a Jupyter kernel runs: its server's sessions, asked over loopback.

A kernel process names its connection file on its command line
(``-f .../kernel-<id>.json``); the Jupyter servers of this user each leave a
``jpserver-<pid>.json`` (``nbserver-<pid>.json`` for the classic notebook) in
their runtime directory with their port and token. :func:`look_up` reads those
files, asks each live server for ``/api/sessions`` and ``/api/kernels`` on
127.0.0.1 (never another host), every server at once and under one deadline,
and maps kernel ids to notebook paths. A server that does not answer in time
is noted and left out; the kernels it runs are then named by id alone.

Answers are cached for ``max_age`` seconds (the memory gauges ask every few
seconds), servers that did not answer too, so that a hung server costs one
timeout per ``max_age``, not one per refresh. Nothing here needs IPython.

In a notebook::

    from gpumagic.devices import jupyter_servers
    view = jupyter_servers.look_up(["5e1f..."])
    view.sessions["5e1f..."].path        # 'analysis/train.ipynb'
"""
from __future__ import annotations

import glob
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from ..procs.kernel_files import connection_file

logger = logging.getLogger(__name__)

__all__ = ["JupyterServer", "KernelSession", "ServerView", "runtime_dirs", "find_servers", "look_up", "forget",
           "TIMEOUT"]

TIMEOUT = 1.0   # seconds for every server together: a local server answers in milliseconds
_INFO_FILES = ("jpserver-*.json", "nbserver-*.json")


@dataclass(frozen=True)
class JupyterServer:
    """One running Jupyter server of this user, as its runtime file describes it (token kept out of repr)."""
    pid: int
    port: int
    base_url: str
    secure: bool
    root_dir: str | None
    info_file: str
    token: str = field(default="", repr=False)

    @property
    def url(self) -> str:
        """Its address on loopback (whatever interface it names, only 127.0.0.1 is asked)."""
        return f"{'https' if self.secure else 'http'}://127.0.0.1:{self.port}{self.base_url}"


@dataclass(frozen=True)
class KernelSession:
    """A kernel a server runs, with the notebook (or console, file) its session is for."""
    kernel_id: str
    path: str | None
    kind: str | None        # "notebook", "console", "file"...
    server_url: str
    root_dir: str | None


@dataclass
class ServerView:
    """What the servers said: their sessions by kernel id, which answered, and which did not.

    ``kernel_pids`` maps each connection file to the pid of the process a live
    server started with it (its own child): a process that names the same file
    but is not that one (nor its child) is no kernel of that server.
    """
    servers: list[JupyterServer] = field(default_factory=list)
    sessions: dict[str, KernelSession] = field(default_factory=dict)
    running: dict[int, set[str]] = field(default_factory=dict)   # server pid -> kernel ids, for servers that answered
    kernel_pids: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def answered(self, server: JupyterServer) -> bool:
        return server.pid in self.running

    def servers_in(self, directory: str) -> list[JupyterServer]:
        return [s for s in self.servers if os.path.dirname(s.info_file) == directory]

    def server_pids(self) -> set[int]:
        return {s.pid for s in self.servers}


def runtime_dirs(extra=()) -> list[str]:
    """Where this user's servers leave their files: Jupyter's runtime directory, then ``extra``
    (the folders of the kernels' connection files), each once."""
    dirs = []
    try:
        from jupyter_core.paths import jupyter_runtime_dir
        dirs.append(jupyter_runtime_dir())
    except Exception:  # jupyter_core missing: its default place, or the environment's
        logger.debug("jupyter_core is unavailable; guessing the runtime directory", exc_info=True)
        dirs.append(os.environ.get("JUPYTER_RUNTIME_DIR")
                    or os.path.join(os.path.expanduser("~"), ".local", "share", "jupyter", "runtime"))
    dirs += [d for d in extra if d]
    return list(dict.fromkeys(os.path.abspath(d) for d in dirs))


def find_servers(dirs) -> list[JupyterServer]:
    """The live servers whose runtime files are in ``dirs`` and belong to this user."""
    import psutil
    found: dict[int, JupyterServer] = {}
    for directory in dirs:
        for pattern in _INFO_FILES:
            for path in sorted(glob.glob(os.path.join(directory, pattern))):
                server = _read_info(path)
                if server is None or server.pid in found:
                    continue
                if not psutil.pid_exists(server.pid):   # a file a crashed server left behind
                    continue
                found[server.pid] = server
    return list(found.values())


def _read_info(path: str) -> JupyterServer | None:
    try:
        if os.stat(path).st_uid != os.getuid():   # another user's server: not ours to ask
            return None
        with open(path) as f:
            info = json.load(f)
        return JupyterServer(pid=int(info["pid"]), port=int(info["port"]), base_url=_slashed(info.get("base_url")),
                             secure=bool(info.get("secure")), root_dir=info.get("root_dir") or info.get("notebook_dir"),
                             info_file=os.path.abspath(path), token=str(info.get("token") or ""))
    except (OSError, ValueError, KeyError, TypeError):
        logger.debug("could not read the Jupyter server file %s", path, exc_info=True)
        return None


def _slashed(base: str | None) -> str:
    base = base or "/"
    return ("/" + base.strip("/") + "/").replace("//", "/")


_cache_lock = threading.Lock()
_cache: dict[tuple[int, int], tuple[float, list | None, list | None]] = {}   # (pid, port) -> (when, sessions, kernels)


def forget() -> None:
    """Drop every cached answer."""
    with _cache_lock:
        _cache.clear()


def look_up(connection_dirs=(), timeout: float = TIMEOUT, max_age: float = 0.0) -> ServerView:
    """Ask every live server of this user for its sessions and kernels, at once, within ``timeout`` s.

    ``connection_dirs``: folders of kernels' connection files, searched for
    server files too. Answers younger than ``max_age`` seconds are reused.
    """
    view = ServerView(servers=find_servers(runtime_dirs(connection_dirs)))
    if not view.servers:
        return view
    now = time.monotonic()
    answers: dict[int, tuple[list | None, list | None]] = {}
    ask = []
    with _cache_lock:
        for server in view.servers:
            cached = _cache.get((server.pid, server.port))
            if cached is not None and now - cached[0] <= max_age:
                answers[server.pid] = cached[1:]
            else:
                ask.append(server)
    if ask:
        answers.update(_ask_all(ask, timeout))
    for server in view.servers:
        sessions, kernels = answers.get(server.pid, (None, None))
        _take_answer(view, server, sessions, kernels)
    view.kernel_pids = _kernel_processes(view.servers)
    return view


def _ask_all(servers: list[JupyterServer], timeout: float) -> dict[int, tuple[list | None, list | None]]:
    """Each server's ``(sessions, kernels)``; ``(None, None)`` for one that did not answer in time.

    One daemon thread per server (a thread of gpumagic's own: starting workers by fork stays safe
    while one runs), all waited for under the one deadline.
    """
    answers: dict[int, tuple[list | None, list | None]] = {}
    threads = [threading.Thread(target=_ask_into, args=(server, timeout, answers), daemon=True,
                                name=f"gpumagic-jupyter-{server.port}") for server in servers]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout + 0.1
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    done = dict(answers)   # (a late answer is not waited for)
    with _cache_lock:
        for server in servers:
            done.setdefault(server.pid, (None, None))
            _cache[(server.pid, server.port)] = (time.monotonic(), *done[server.pid])
    return done


def _ask_into(server: JupyterServer, timeout: float, answers: dict) -> None:
    answers[server.pid] = _ask(server, timeout)


def _ask(server: JupyterServer, timeout: float) -> tuple[list | None, list | None]:
    try:
        return _get(server, "api/sessions", timeout), _get(server, "api/kernels", timeout)
    except Exception as exc:  # refused, timed out, a password instead of a token, not JSON
        logger.debug("the Jupyter server at %s did not answer: %s", server.url, exc, exc_info=True)
        return None, None


def _get(server: JupyterServer, path: str, timeout: float):
    import ssl
    import urllib.request
    handlers: list = [urllib.request.ProxyHandler({})]   # loopback: never through a proxy
    if server.secure:   # its certificate names its host, not 127.0.0.1; loopback needs no check
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    request = urllib.request.Request(server.url + path, headers={"Authorization": f"token {server.token}"})
    with opener.open(request, timeout=timeout) as response:
        return json.loads(response.read())


def _take_answer(view: ServerView, server: JupyterServer, sessions, kernels) -> None:
    if sessions is None or kernels is None:
        view.notes.append(f"the Jupyter server on port {server.port} (pid {server.pid}) did not answer: its "
                          "kernels are named by id and folder")
        return
    view.running[server.pid] = {str(k.get("id")) for k in kernels if isinstance(k, dict)}
    for session in sessions:
        if not isinstance(session, dict) or not isinstance(session.get("kernel"), dict):
            continue
        kid = str(session["kernel"].get("id"))
        path = session.get("path") or (session.get("notebook") or {}).get("path")
        view.sessions[kid] = KernelSession(kernel_id=kid, path=path, kind=session.get("type"),
                                           server_url=server.url, root_dir=server.root_dir)


def _kernel_processes(servers: list[JupyterServer]) -> dict[str, int]:
    """Connection file -> pid of the kernel process each server started (its direct children)."""
    import psutil
    found: dict[str, int] = {}
    for server in servers:
        try:
            children = psutil.Process(server.pid).children()
        except psutil.Error:
            logger.debug("could not list the children of server %d", server.pid, exc_info=True)
            continue
        for child in children:
            try:
                path = connection_file(child.cmdline())
            except psutil.Error:
                continue   # ended meanwhile
            if path:
                found[os.path.abspath(path)] = child.pid
    return found
