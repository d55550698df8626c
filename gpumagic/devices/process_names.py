"""What a process is, seen from this kernel: this kernel, another kernel, a worker, an orphan...

:func:`name_processes` names pids (those NVML lists on the GPUs) from what
``/proc`` says of them (through psutil), gpumagic's worker marks
(:mod:`gpumagic.procs.marks`) and the Jupyter servers' sessions
(:mod:`.jupyter_servers`). Another user's process is named by its user alone:
nothing else of it is read.

The rules, in order (first match):

* this process: **this kernel**;
* another user's: **other user**;
* a gpumagic worker (it left a mark): **worker**, rank N of its kernel; an
  **orphan** once that kernel is gone;
* a process naming a kernel connection file (``-f kernel-<id>.json``) that no
  ancestor names too: a **kernel**, unless there is proof it is a child forked
  from a kernel that is gone (an **orphan**): the server that runs kernel
  ``<id>`` runs it as another process, or every server in the folder of its
  connection file answered and none runs ``<id>``, or its connection file is
  gone and its parent too;
* a descendant of this kernel, of a worker or of a kernel: **child** (a
  DataLoader worker, a multiprocessing child), an **orphan** where that one is;
* a ``multiprocessing`` child (spawn, fork server) whose parent is gone: **orphan**;
* any other process of this user: **process**, named by its command line.

Only this user's orphans may be ended (``%gpumem --reclaim``): every orphan
rule needs proof that what started the process is gone.
"""
from __future__ import annotations

import enum
import logging
import os
from dataclasses import asdict, dataclass

from ..procs.kernel_files import connection_file, kernel_id
from ..procs.marks import WorkerMark, read_marks
from ..procs.marks import started as started_at
from .jupyter_servers import ServerView, look_up

logger = logging.getLogger(__name__)

__all__ = ["Kind", "ProcessFacts", "Who", "read_facts", "name_processes"]

_MAX_DEPTH = 64   # ancestors followed (a pid chain is never this long; a loop in a reused-pid race would be)
_MULTIPROCESSING = ("--multiprocessing-fork", "multiprocessing.spawn", "multiprocessing.forkserver")


class Kind(str, enum.Enum):
    THIS_KERNEL = "this kernel"
    KERNEL = "kernel"
    WORKER = "worker"
    CHILD = "child"
    ORPHAN = "orphan"
    OTHER_USER = "other user"
    PROCESS = "process"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ProcessFacts:
    """What ``/proc`` says of one process (for another user's: its uid and user name only)."""
    pid: int
    ppid: int
    uid: int
    user: str | None
    started: float
    name: str = ""
    cmdline: tuple[str, ...] = ()
    cwd: str | None = None

    @property
    def connection_file(self) -> str | None:
        path = connection_file(self.cmdline)
        return os.path.abspath(path) if path else None

    @property
    def python(self) -> bool:
        first = os.path.basename(self.cmdline[0]) if self.cmdline else ""
        return self.name.startswith("python") or first.startswith("python")

    @property
    def multiprocessing_child(self) -> bool:
        return any(marker in arg for arg in self.cmdline for marker in _MULTIPROCESSING)


@dataclass(frozen=True)
class Who:
    """What one process is. ``kernel_id``/``kernel_pid``: the kernel it is, or belongs (belonged) to."""
    kind: Kind
    label: str
    user: str | None = None
    kernel_id: str | None = None
    kernel_pid: int | None = None
    notebook: str | None = None
    cwd: str | None = None
    rank: int | None = None
    started: float | None = None    # its start time: what ends it checks the pid is still this process
    uid: int | None = None

    def as_dict(self) -> dict:
        out = asdict(self)
        out["kind"] = self.kind.value
        return out


def read_facts(pid: int) -> ProcessFacts | None:
    """The facts of ``pid``; None where it is gone or not visible here (another pid namespace)."""
    import psutil
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            uid, started = proc.uids().real, proc.create_time()
            user = _user(proc)
            if uid != os.getuid():   # another user's: nothing more is read of it
                return ProcessFacts(pid=pid, ppid=0, uid=uid, user=user, started=started)
            facts = ProcessFacts(pid=pid, ppid=proc.ppid(), uid=uid, user=user, started=started, name=proc.name(),
                                 cmdline=tuple(proc.cmdline()), cwd=_cwd(proc))
        return facts
    except psutil.Error:
        logger.debug("process %d is not readable here", pid, exc_info=True)
        return None


def _user(proc) -> str | None:
    import psutil
    try:
        return proc.username()
    except (psutil.Error, KeyError):   # a uid with no name
        logger.debug("no user name for process %d", proc.pid, exc_info=True)
        return None


def _cwd(proc) -> str | None:
    import psutil
    try:
        return proc.cwd()
    except psutil.Error:
        logger.debug("no working directory for process %d", proc.pid, exc_info=True)
        return None


def name_processes(pids, timeout: float | None = None, max_age: float = 0.0) -> tuple[dict[int, Who], list[str]]:
    """``({pid: Who}, notes)`` for ``pids``; the Jupyter servers are asked within ``timeout`` seconds
    (default :data:`.jupyter_servers.TIMEOUT`), their answers reused for ``max_age`` seconds.

    In a notebook::

        from gpumagic.devices.process_names import name_processes
        who, notes = name_processes([12345])
        who[12345].label           # 'kernel 5e1f2a3b (analysis/train.ipynb)'
    """
    namer = _Namer()
    pids = list(dict.fromkeys(pids))
    for pid in pids:
        namer.facts_of(pid)
        for ancestor in namer.ancestors(pid):
            namer.facts_of(ancestor.pid)
    files = {f.connection_file for f in namer.facts.values() if f is not None and f.connection_file}
    if namer.facts.get(namer.me) is None:
        namer.facts_of(namer.me)
    dirs = sorted({os.path.dirname(path) for path in files | {namer.own_file()} if path})
    kwargs = {} if timeout is None else {"timeout": timeout}
    namer.view = look_up(dirs, max_age=max_age, **kwargs)
    return {pid: namer.who(pid) for pid in pids}, list(namer.view.notes)


class _Namer:
    """The naming rules, with what they read cached for one naming pass."""

    def __init__(self):
        self.me = os.getpid()
        self.uid = os.getuid()
        self.facts: dict[int, ProcessFacts | None] = {}
        self.marks: dict[int, WorkerMark] = read_marks()
        self.view = ServerView()
        self._named: dict[int, Who] = {}

    def facts_of(self, pid: int) -> ProcessFacts | None:
        if pid not in self.facts:
            self.facts[pid] = read_facts(pid)
        return self.facts[pid]

    def ancestors(self, pid: int) -> list[ProcessFacts]:
        """``pid``'s parent, its parent... (this user's, up to the first that is gone or not ours)."""
        chain: list[ProcessFacts] = []
        facts = self.facts_of(pid)
        while facts is not None and facts.ppid > 1 and len(chain) < _MAX_DEPTH:
            facts = self.facts_of(facts.ppid)
            if facts is None or facts.uid != self.uid:
                break
            chain.append(facts)
        return chain

    def own_file(self) -> str | None:
        facts = self.facts_of(self.me)
        return facts.connection_file if facts is not None else None

    def who(self, pid: int) -> Who:
        if pid not in self._named:
            self._named[pid] = self._name(pid)
        return self._named[pid]

    def _name(self, pid: int) -> Who:
        facts = self.facts_of(pid)
        if pid == self.me:
            return self._this_kernel(facts)
        if facts is None:
            return Who(Kind.UNKNOWN, "not visible here (another pid namespace, or gone)")
        if facts.uid != self.uid:
            user = facts.user or f"uid {facts.uid}"
            return Who(Kind.OTHER_USER, f"another user's process ({user})", user=user, uid=facts.uid)
        if pid in self.marks:
            return self._worker(facts, self.marks[pid])
        ancestors = self.ancestors(pid)
        own = facts.connection_file
        if own and not any(a.connection_file == own for a in ancestors):
            return self._kernel(facts)   # (whoever started its server: a kernel is a kernel)
        for ancestor in ancestors:
            if ancestor.pid == self.me or ancestor.pid in self.marks or ancestor.connection_file:
                return self._child(facts, self.who(ancestor.pid))
        if facts.multiprocessing_child and self._parent_gone(facts):
            return self._own(facts, Kind.ORPHAN, "orphan: a multiprocessing child whose parent is gone")
        return self._own(facts, Kind.PROCESS, _command(facts))

    # --- one rule each

    def _own(self, facts: ProcessFacts, kind: Kind, label: str, **more) -> Who:
        return Who(kind, label, user=facts.user, cwd=facts.cwd, started=facts.started, uid=facts.uid, **more)

    def _this_kernel(self, facts: ProcessFacts | None) -> Who:
        kid = kernel_id(facts.connection_file) if facts is not None else None
        notebook = self._notebook(kid)
        return Who(Kind.THIS_KERNEL, "this kernel" + (f" ({notebook})" if notebook else ""),
                   user=facts.user if facts else None, kernel_id=kid, kernel_pid=self.me, notebook=notebook,
                   cwd=facts.cwd if facts else None, started=facts.started if facts else None, uid=self.uid)

    def _worker(self, facts: ProcessFacts, mark: WorkerMark) -> Who:
        kernel = self._kernel_named(mark.kernel_pid, mark.kernel_id)
        more = dict(kernel_id=mark.kernel_id, kernel_pid=mark.kernel_pid, rank=mark.rank,
                    notebook=self._notebook(mark.kernel_id))
        if _alive(mark.kernel_pid, mark.kernel_started):
            return self._own(facts, Kind.WORKER, f"rank {mark.rank} of {kernel}", **more)
        return self._own(facts, Kind.ORPHAN, f"orphan: rank {mark.rank} of {kernel}, which is gone", **more)

    def _child(self, facts: ProcessFacts, parent: Who) -> Who:
        more = dict(kernel_id=parent.kernel_id, kernel_pid=parent.kernel_pid, rank=parent.rank,
                    notebook=parent.notebook)
        of = parent.label.removeprefix("orphan: ")
        if parent.kind is Kind.ORPHAN:
            return self._own(facts, Kind.ORPHAN, f"orphan: child of {of}", **more)
        return self._own(facts, Kind.CHILD, f"child of {of}", **more)

    def _kernel(self, facts: ProcessFacts) -> Who:
        path = facts.connection_file or ""
        kid = kernel_id(path)
        notebook = self._notebook(kid)
        more = dict(kernel_id=kid, kernel_pid=facts.pid, notebook=notebook)
        why = self._gone_kernel(facts, path, kid)
        if why:
            return self._own(facts, Kind.ORPHAN, f"orphan: a child of kernel {_short(kid)}, {why}", **more)
        where = f"({notebook})" if notebook else f"in {facts.cwd or 'an unknown folder'}"
        return self._own(facts, Kind.KERNEL, f"kernel {_short(kid)} {where}", **more)

    def _gone_kernel(self, facts: ProcessFacts, path: str, kid: str | None) -> str | None:
        """Why a process naming kernel ``kid``'s connection file is no longer that kernel (None: it is)."""
        view = self.view
        if facts.ppid in view.server_pids():
            return None   # a server started it: the kernel itself
        other = view.kernel_pids.get(path)
        if other is not None and other != facts.pid:
            return f"whose server runs that kernel as pid {other}"
        servers = view.servers_in(os.path.dirname(path))
        if servers and all(view.answered(s) for s in servers) \
                and not any(kid in view.running[s.pid] for s in servers):
            return "which its server no longer runs"
        if not os.path.exists(path) and self._parent_gone(facts):
            return "whose connection file is gone"
        return None

    # --- helpers

    def _parent_gone(self, facts: ProcessFacts) -> bool:
        """Whether its parent took it over when the one that started it died: init (another user's
        pid 1), or a process of ours that is no Python (a Python child is started by a Python process)."""
        parent = self.facts_of(facts.ppid) if facts.ppid > 0 else None
        if parent is None:
            return True
        if parent.uid != self.uid:
            return parent.pid == 1
        return not parent.python

    def _notebook(self, kid: str | None) -> str | None:
        session = self.view.sessions.get(kid) if kid else None
        return session.path if session is not None else None

    def _kernel_named(self, pid: int | None, kid: str | None) -> str:
        if pid == self.me:
            return "this kernel"
        notebook = self._notebook(kid)
        if kid:
            return f"kernel {_short(kid)}" + (f" ({notebook})" if notebook else "") + (f", pid {pid}" if pid else "")
        return f"kernel pid {pid}" if pid else "an unknown kernel"


def _alive(pid: int | None, started: float | None) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``started`` (pids are reused)."""
    if pid is None:
        return False
    now = started_at(pid)
    return now is not None and (started is None or abs(now - started) <= 0.5)


def _short(kid: str | None) -> str:
    return (kid or "?")[:8]


def _command(facts: ProcessFacts, width: int = 60) -> str:
    args = list(facts.cmdline)
    if args:
        args[0] = os.path.basename(args[0])   # the program's name: its folder tells little and takes the room
    text = " ".join(args) or facts.name or f"pid {facts.pid}"
    return text if len(text) <= width else text[:width - 3] + "..."
