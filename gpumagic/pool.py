"""A persistent pool of worker processes, one per device, joined in a process group.

The first ``%%dataparallel`` cell starts the pool; later cells reuse it, so
only the first pays for starting Python, importing torch, creating CUDA
contexts and connecting NCCL. Workers are started with ``spawn`` (a fresh
interpreter: safe even after the kernel has used CUDA, unlike ``fork``), die
with the kernel (``PR_SET_PDEATHSIG``), ignore Ctrl-C (the kernel stops them)
and lead their own process group, so that killing one also kills the
DataLoader workers it started.

The rendezvous is a ``TCPStore`` served by the kernel on a socket bound to
127.0.0.1 (torch's own would listen on every interface); gloo and NCCL are
told to use the loopback interface too. Control messages travel through one
pipe per worker; bulk bytes through anonymous shared memory (``memfd``, see
:mod:`gpumagic.bulk`) whose descriptor is passed over that pipe. Nothing has
a name in ``/dev/shm`` and there are no semaphores: nothing can leak.

A task is a function ``task(ctx, meta, data)`` named ``"module:function"``,
run on every rank by :meth:`WorkerPool.run`; ``ctx`` is the rank's
:class:`WorkerContext`. In a notebook::

    pool = WorkerPool(["cuda:0", "cuda:1"], backend="nccl").start()
    results = pool.run("mypackage.tasks:train", meta)
    pool.stop()
"""
from __future__ import annotations

import atexit
import gc
import importlib
import io
import multiprocessing
import multiprocessing.connection as mpc
import os
import signal
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

from . import fresh, session, workers
from .errors import WorkerError

__all__ = ["WorkerPool", "WorkerContext", "PoolDied", "get_pool", "stop_pool", "current_pool", "pools"]

LOOPBACK = "127.0.0.1"


class PoolDied(WorkerError):
    """A worker died or was killed; the pool is gone and the next cell starts a fresh one."""


@dataclass
class RankInfo:
    rank: int
    device: str
    pid: int | None = None
    process: object = None
    conn: object = None
    info: dict = field(default_factory=dict)
    remote: bool = False        # joined from another machine (no process handle here)

    @property
    def alive(self) -> bool:
        if self.remote:
            return self.conn is not None and not self.conn.closed
        return self.process is not None and self.process.is_alive()


# ============================================================== kernel side

class WorkerPool:
    """One worker process per entry of ``devices`` (``"cuda:1"``, ``"cpu"``...).

    ``backend`` ("nccl", "gloo" or None for no process group) and ``timeout``
    (seconds a collective may wait) go to ``torch.distributed``. ``env`` is
    added to every worker's environment. ``master_addr`` is where the
    rendezvous listens (loopback unless the pool spans machines).
    """

    def __init__(self, devices, backend: str | None = "gloo", *, timeout: float = 1800.0,
                 name: str = "pool", env: dict | None = None, master_addr: str = LOOPBACK,
                 master_port: int = 0, start_timeout: float = 180.0, remote: int = 0):
        self.devices = [str(d) for d in devices] + ["remote"] * int(remote)
        self.local = len(self.devices) - int(remote)
        self.remote = int(remote)
        if not self.devices:
            raise ValueError("a pool needs at least one device")
        self.backend = backend
        self.timeout = float(timeout)
        self.name = name
        self.env = dict(env or {})
        self.master_addr = master_addr
        self.master_port = master_port
        self.start_timeout = start_timeout
        self.ranks = [RankInfo(r, d, remote=r >= self.local) for r, d in enumerate(self.devices)]
        self.started_at: float | None = None
        self.start_seconds: float | None = None
        self.tasks_run = 0
        self.held: set = set()          # tensor keys every worker holds (see parallel.ship)
        self.state = "new"              # new | running | stopped | dead
        self._store = None
        self._listen_sock = None
        self._lock = threading.Lock()
        self._busy = False

    # ---- lifecycle
    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def key(self) -> tuple:
        return (tuple(self.devices[: self.local]), self.backend, self.master_addr, self.remote)

    @property
    def pids(self) -> list:
        return [r.pid for r in self.ranks]

    @property
    def alive(self) -> bool:
        return self.state == "running" and all(r.alive for r in self.ranks)

    def start(self) -> "WorkerPool":
        """Start every worker and wait until all have joined the process group."""
        if self.state != "new":
            raise RuntimeError(f"pool already {self.state}")
        t0 = time.monotonic()
        ctx = multiprocessing.get_context("spawn")
        port = None
        if self.backend:
            port = self._serve_rendezvous()
        _live_pools.add(self)
        self.state = "running"
        try:
            with fresh.starting("spawn"):
                self._spawn(ctx, port)
            if self.remote:
                self._accept_remote(port, t0 + max(self.start_timeout, 600.0))
            self._wait_ready(t0 + self.start_timeout + (600.0 if self.remote else 0.0))
        except BaseException:
            self.kill()
            raise
        self.started_at = time.time()
        self.start_seconds = time.monotonic() - t0
        return self

    def _config(self, rank: int, device: str, port) -> dict:
        return {
            "rank": rank, "world_size": self.world_size, "device": device,
            "backend": self.backend, "addr": self.master_addr, "port": port,
            "timeout": self.timeout, "env": self._worker_env(), "parent_pid": os.getpid(),
            "threads": self._cpu_threads(),
        }

    def _accept_remote(self, port, deadline: float) -> None:
        """Take ``remote`` workers that connect to the session listener (``python -m gpumagic.pool join``)."""
        listener = session_listener(self.master_addr)
        from .display import note
        note(f"%%dataparallel: waiting for {self.remote} rank(s) from other machines; on each, run:\n  "
             + listener.command(self.remote))
        for r in self.ranks[self.local:]:
            conn, hello = listener.accept(deadline)
            r.conn, r.pid = conn, hello.get("pid")
            r.device = self.devices[r.rank] = f"{hello.get('host', '?')}:{hello.get('device', '?')}"
            config = self._config(r.rank, hello.get("device", "cpu"), port)
            config["env"] = dict(self.env)   # their own interfaces, not our loopback
            config["threads"] = None
            conn.send(("config", config))

    def _spawn(self, ctx, port) -> None:
        for r in self.ranks[: self.local]:
            parent, child = ctx.Pipe(duplex=True)
            config = self._config(r.rank, r.device, port)
            p = ctx.Process(target=_worker_main, args=(child, config), daemon=False,
                            name=f"gpumagic-{self.name}-rank{r.rank}")
            p.start()
            child.close()
            r.process, r.conn, r.pid = p, parent, p.pid

    def _serve_rendezvous(self) -> int:
        import datetime

        import torch.distributed as dist
        # Bind the socket ourselves: TCPStore would listen on every interface.
        family = socket.AF_INET6 if ":" in self.master_addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.master_addr, self.master_port))
        sock.listen(128)
        port = sock.getsockname()[1]
        self._listen_sock = sock
        self._store = dist.TCPStore(self.master_addr, port, self.world_size + 1, True,
                                    timeout=datetime.timedelta(seconds=self.start_timeout),
                                    wait_for_workers=False, master_listen_fd=sock.fileno())
        return port

    def _worker_env(self) -> dict:
        env = {}
        if self.master_addr in (LOOPBACK, "localhost", "::1"):
            # gloo and NCCL would otherwise pick the host's first interface and listen on it.
            env["GLOO_SOCKET_IFNAME"] = "lo"
            env["NCCL_SOCKET_IFNAME"] = "lo"
        env.update(self.env)
        return env

    def _cpu_threads(self) -> int:
        cpu_ranks = sum(1 for d in self.devices if d == "cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // max(1, cpu_ranks))

    def _waitables(self, ranks) -> dict:
        """What to wait on for ``ranks``: each one's pipe, and its process's sentinel where this pool
        started it (it then ends too when the process dies without a word)."""
        waitables = {}
        for rank in ranks:
            r = self.ranks[rank]
            waitables[r.conn] = rank
            if r.process is not None:
                waitables[r.process.sentinel] = rank
        return waitables

    def _wait_ready(self, deadline: float) -> None:
        pending = {r.rank for r in self.ranks}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: ranks {sorted(pending)} did not start within "
                                   f"{self.start_timeout:.0f} s")
            waitables = self._waitables(pending)
            for ready in mpc.wait(list(waitables), timeout=min(left, 0.5)):
                rank = waitables[ready]
                r = self.ranks[rank]
                if r.process is not None and ready is r.process.sentinel and not r.conn.poll():
                    raise PoolDied(rank, r.pid, "WorkerDied",
                                   f"exited with code {r.process.exitcode} while starting")
                try:
                    msg = r.conn.recv()
                except (EOFError, OSError):
                    raise PoolDied(rank, r.pid, "WorkerDied", "exited while starting") from None
                if msg[0] == "ready":
                    r.info = msg[1]
                    pending.discard(rank)
                elif msg[0] == "error":
                    info = msg[1]
                    raise WorkerError(rank, r.pid, info["exc_type"],
                                      f"while starting: {info['message']}", info.get("traceback", ""))

    def stop(self, timeout: float = 3.0) -> None:
        """Ask every worker to leave, then reap (SIGKILL after ``timeout``)."""
        if self.state in ("stopped", "dead", "new") and not any(r.process for r in self.ranks):
            return
        for r in self.ranks:
            try:
                if r.conn is not None and r.alive:
                    r.conn.send(("stop",))
            except Exception:
                pass
        deadline = time.monotonic() + timeout
        for r in self.ranks:
            if r.process is not None:
                r.process.join(max(0.0, deadline - time.monotonic()))
        self._reap("stopped")

    def kill(self) -> None:
        """Kill every worker (and its children) at once: for interrupts and failures."""
        self._reap("dead", force=True)

    def _reap(self, state: str, force: bool = False) -> None:
        procs = [r.process for r in self.ranks if r.process is not None]
        for r in self.ranks:
            if r.remote and force and r.conn is not None:
                try:
                    r.conn.send(("kill",))   # their watchdog ends them, even inside a collective
                except Exception:
                    pass
            p = r.process
            # exitcode set means already reaped: its pid may belong to someone else by now
            if p is None or p.exitcode is not None:
                continue
            _kill_group(p, r.info.get("pgid"))
        workers.reap(procs, timeout=1.0)
        for r in self.ranks:
            if r.conn is not None:
                try:
                    r.conn.close()
                except Exception:
                    pass
            r.conn = None
            r.process = None
        self._store = None
        if self._listen_sock is not None:
            try:
                self._listen_sock.close()
            except Exception:
                pass
            self._listen_sock = None
        self.held = set()
        for buf in [self.__dict__.pop("_outgoing", None)] + list(self.__dict__.pop("_incoming", {}).values()):
            if buf is not None:
                buf.close()
        self.state = state
        _live_pools.discard(self)

    # ---- running tasks
    def run(self, task: str, meta=None, data=None, *, on_output=None, on_message=None,
            on_tick=None, grace: float = 0.5) -> list:
        """Run ``task`` on every rank; returns each rank's ``(result, buffer)``.

        ``data`` is a byte-like object sent to every rank after ``meta``
        (one copy each, in parallel). ``on_output(rank, stream, text)`` gets
        the ranks' prints as they happen, ``on_message(rank, obj)`` what a
        task sends with ``ctx.send``; ``on_tick()`` runs about every 0.1 s.

        An exception on any rank raises :class:`WorkerError` for it. When
        every rank raised the same exception at the same line, the ranks made
        the same collective calls and the pool is kept; otherwise it is
        killed (ranks may be stuck in a collective) and the next call needs a
        new pool. KeyboardInterrupt kills the pool and propagates.
        """
        if not self.alive:
            raise PoolDied(-1, None, "PoolDied", f"the {self.name} pool is not running")
        with self._lock:
            if self._busy:
                raise RuntimeError(f"the {self.name} pool is already running a task")
            self._busy = True
        try:
            return self._run(task, meta, data, on_output, on_message, on_tick, grace)
        except BaseException:
            if self.state == "running" and not self._last_run_clean:
                self.kill()
            raise
        finally:
            self._busy = False
            self.tasks_run += 1

    _last_run_clean = True

    @property
    def outgoing(self):
        """The kernel's bulk buffer (shared memory): fill ``outgoing.get(n)`` and pass it to :meth:`run`."""
        out = self.__dict__.get("_outgoing")
        if out is None:
            from .bulk import Outgoing
            out = self._outgoing = Outgoing(shared=True)
        return out

    def _incoming_for(self, rank: int):
        from .bulk import Incoming
        return self.__dict__.setdefault("_incoming", {}).setdefault(rank, Incoming())

    def _run(self, task, meta, data, on_output, on_message, on_tick, grace):
        self._last_run_clean = False
        senders = []
        out = self.outgoing
        for r in self.ranks:
            ref, new = out.reference(data, peer=(r.rank, r.pid), can_share=not r.remote)
            r.conn.send(("run", task, meta, ref))
            if ref is not None and ref[0] == "bytes":
                # Socket writes release the GIL: such ranks receive at once.
                t = threading.Thread(target=_send_quietly, args=(out, r, ref, data), daemon=True)
                t.start()
                senders.append(t)
            else:
                out.send(r.conn, ref, new, data, (r.rank, r.pid), r.pid)
        results: list = [None] * self.world_size
        errors: dict[int, dict] = {}
        first_error_at = None
        pending = set(range(self.world_size))
        last_tick = 0.0
        while pending:
            waitables = self._waitables(pending)
            for ready in mpc.wait(list(waitables), timeout=0.1):
                rank = waitables[ready]
                r = self.ranks[rank]
                if r.process is not None and ready is r.process.sentinel and r.conn.poll():
                    continue  # read what it said before dying first (its pipe is readable too)
                try:
                    if r.process is not None and ready is r.process.sentinel:
                        raise EOFError
                    msg = r.conn.recv()
                except (EOFError, OSError):
                    errors.setdefault(rank, self._death(r))
                    pending.discard(rank)
                    first_error_at = first_error_at or time.monotonic()
                    continue
                kind = msg[0]
                if kind == "out":
                    if on_output is not None:
                        on_output(rank, msg[1], msg[2])
                elif kind == "msg":
                    if on_message is not None:
                        on_message(rank, msg[1])
                elif kind == "done":
                    results[rank] = (msg[1], self._incoming_for(rank).receive(r.conn, msg[2]))
                    pending.discard(rank)
                elif kind == "error":
                    errors[rank] = msg[1]
                    pending.discard(rank)
                    first_error_at = first_error_at or time.monotonic()
            now = time.monotonic()
            if on_tick is not None and now - last_tick >= 0.1:
                last_tick = now
                on_tick()
            if errors and pending and now - first_error_at > grace:
                break
        for t in senders:
            t.join(timeout=5.0)
        if errors:
            keep = not pending and _same_failure(errors, self.world_size)
            self._last_run_clean = keep
            if not keep:
                self.kill()
            raise _primary(errors)
        self._last_run_clean = True
        return results

    def _death(self, r: RankInfo) -> dict:
        """What to say about a rank that went away without a word."""
        if r.process is None:
            how = "the connection to the worker was lost"
        else:
            r.process.join(1.0)
            code = r.process.exitcode
            if code is None:
                how = "the worker closed its pipe"
            elif code < 0:
                how = f"the worker was killed by signal {-code}" + (" (out of memory?)" if -code == 9 else "")
            else:
                how = f"the worker exited with code {code}"
        return {"rank": r.rank, "pid": r.pid, "exc_type": "WorkerDied", "message": how, "traceback": "",
                "died": True}

    # ---- status
    def status(self) -> dict:
        """Pool and per-rank facts: state, backend, rendezvous, pids, devices, memory."""
        try:
            import psutil
        except Exception:  # pragma: no cover
            psutil = None
        ranks = []
        for r in self.ranks:
            alive = r.alive
            rss = None
            if alive and psutil is not None and not r.remote:
                try:
                    rss = psutil.Process(r.pid).memory_info().rss
                except Exception:
                    rss = None
            ranks.append({"rank": r.rank, "device": r.device, "pid": r.pid, "alive": alive, "rss": rss,
                          "device_name": r.info.get("device_name"), "host": r.info.get("host")})
        return {"name": self.name, "state": self.state if self.state != "running" or self.alive else "broken",
                "backend": self.backend, "world_size": self.world_size,
                "rendezvous": f"{self.master_addr}:{self._store.port}" if self._store is not None else None,
                "started_at": self.started_at, "start_seconds": self.start_seconds,
                "tasks_run": self.tasks_run, "ranks": ranks}


def _send_quietly(out, r, ref, data) -> None:
    try:
        out.send(r.conn, ref, False, data, (r.rank, r.pid), r.pid)
    except Exception:
        pass  # the worker died; the waiting loop hears of it


def _same_failure(errors: dict, world: int) -> bool:
    """Every rank raised the same exception type at the same place (so no one waits in a collective)."""
    if len(errors) != world:
        return False
    sigs = {(e.get("exc_type"), _last_line(e.get("traceback", ""))) for e in errors.values()}
    infos = list(errors.values())
    if any(e.get("died") for e in infos):
        return False
    if any(e.get("exc_type") in ("DistBackendError", "DistNetworkError", "DistStoreError", "AcceleratorError",
                                 "OutOfMemoryError") or "CUDA error" in e.get("message", "") for e in infos):
        return False  # the process group or the CUDA context is not to be trusted afterwards
    return len(sigs) == 1


def _last_line(tb: str) -> str:
    lines = [l for l in tb.splitlines() if l.strip().startswith("File ") or l.strip().startswith("Cell In")]
    return lines[-1].strip() if lines else ""


def _primary(errors: dict) -> WorkerError:
    """The error to show: a real exception, else a death, else what others suffered from it; lowest rank first."""
    infos = sorted(errors.values(), key=lambda e: (_collateral(e), bool(e.get("died")), e["rank"]))
    e = infos[0]
    cls = PoolDied if e.get("died") else WorkerError
    err = cls(e["rank"], e.get("pid"), e["exc_type"], e["message"], e.get("traceback", ""))
    err.all_errors = errors
    return err


def _collateral(info: dict) -> bool:
    """Errors that are the consequence of another rank's failure (its socket closed...)."""
    text = (info.get("exc_type", "") + " " + info.get("message", "")).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "distbackenderror",
                                   "distnetworkerror", "timed out", "timeout"))


def _kill_group(process, pgid) -> None:
    pid = process.pid
    try:
        if pgid == pid:
            os.killpg(pid, signal.SIGKILL)  # the worker and the DataLoader workers it forked
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


# ---- pools by name (the magics keep one each), stopped on %unload_ext and at exit

_live_pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()
_pools: dict[str, WorkerPool] = {}


def current_pool(name: str) -> WorkerPool | None:
    return _pools.get(name)


def pools() -> dict:
    return dict(_pools)


def get_pool(name: str, devices, backend, **kwargs) -> tuple[WorkerPool, bool]:
    """The running pool ``name`` for these devices and backend, started if needed.

    Returns ``(pool, started)``; a pool with other devices, or a dead one,
    is stopped and replaced.
    """
    pool = _pools.get(name)
    wanted = (tuple(str(d) for d in devices), backend, kwargs.get("master_addr", LOOPBACK),
              int(kwargs.get("remote", 0)))
    if pool is not None and pool.alive and pool.key == wanted and pool.timeout == kwargs.get("timeout", pool.timeout):
        return pool, False
    if pool is not None:
        pool.stop()
        _pools.pop(name, None)
    pool = WorkerPool(devices, backend, name=name, **kwargs)
    _pools[name] = pool
    session.register_closer(f"pool:{name}", lambda: stop_pool(name))
    pool.start()
    return pool, True


def stop_pool(name: str) -> bool:
    """Stop pool ``name``; returns whether one was running."""
    pool = _pools.pop(name, None)
    session.unregister_closer(f"pool:{name}")
    if pool is None:
        return False
    was = pool.alive
    pool.stop()
    return was


@atexit.register
def _kill_all_at_exit() -> None:
    # Registered after multiprocessing's own exit hook, so it runs first: that hook
    # would otherwise wait for our (non-daemonic) workers forever.
    for pool in list(_live_pools):
        try:
            pool.kill()
        except Exception:
            pass


# ---- ranks on other machines

class SessionListener:
    """Where workers on other machines connect to this kernel (one per kernel, kept between pools).

    Connections are authenticated with a random key (HMAC challenge, as in
    ``multiprocessing.connection``); the key is in the join command.
    """

    def __init__(self, addr: str, port: int = 0):
        import secrets
        self.addr = addr
        self.token = secrets.token_hex(16)
        self._listener = mpc.Listener((addr, port), authkey=None)
        self.port = self._listener.address[1]
        self._sock = getattr(getattr(self._listener, "_listener", None), "_socket", None)

    def command(self, nprocs: int) -> str:
        host = self.addr if self.addr not in ("0.0.0.0", "::") else socket.gethostname()
        return f"python -m gpumagic.pool join {host}:{self.port} --token {self.token} --nprocs {nprocs}"

    def accept(self, deadline: float):
        """The next authenticated worker: ``(connection, hello)``; TimeoutError past ``deadline``."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no worker joined from another machine in time; run the join command "
                                   "shown above on each machine")
            if self._sock is not None:
                self._sock.settimeout(min(left, 0.5))
            try:
                conn = self._listener.accept()
            except (socket.timeout, TimeoutError, BlockingIOError):
                continue
            try:
                mpc.deliver_challenge(conn, self.token.encode())
                mpc.answer_challenge(conn, self.token.encode())
                kind, hello = conn.recv()
                if kind == "hello":
                    return conn, hello
            except Exception:
                pass   # a stale or foreign connection: the next one
            try:
                conn.close()
            except Exception:
                pass

    def close(self) -> None:
        try:
            self._listener.close()
        except Exception:
            pass


_listener: SessionListener | None = None


def session_listener(addr: str | None = None) -> SessionListener:
    """The kernel's listener for workers on other machines, created on first use."""
    global _listener
    if _listener is None:
        _listener = SessionListener(addr or os.environ.get("GPUMAGIC_LISTEN_ADDR") or "0.0.0.0")
        session.register_closer("pool:listener", close_listener)
    return _listener


def close_listener() -> None:
    global _listener
    if _listener is not None:
        _listener.close()
        _listener = None


def _remote_worker(address, token: str, device: str, agent_pid: int) -> None:
    workers.die_with_parent(agent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn = mpc.Client(address, authkey=token.encode())   # waits until the kernel takes us
    except (OSError, EOFError, mpc.AuthenticationError):
        os._exit(3)                                           # the kernel is gone: the agent stops
    conn.send(("hello", {"device": device, "host": socket.gethostname(), "pid": os.getpid()}))
    kind, config = conn.recv()
    config["parent_pid"] = agent_pid
    config["remote"] = True
    _worker_main(conn, config)


def join(address: tuple, token: str, devices: list[str]) -> None:
    """Serve ``devices`` of this machine to the kernel at ``address`` until it goes away.

    Each pool the kernel starts takes one worker per device; when a pool ends
    (stopped, interrupted, failed) fresh workers connect again and wait for the next.
    """
    ctx = multiprocessing.get_context("spawn")
    while True:
        procs = [ctx.Process(target=_remote_worker, args=(address, token, d, os.getpid()), daemon=False)
                 for d in devices]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if all(p.exitcode == 3 for p in procs):
            print(f"gpumagic: the kernel at {address[0]}:{address[1]} is gone; leaving", file=sys.stderr)
            return
        time.sleep(0.5)


def main(argv=None) -> None:
    """``python -m gpumagic.pool join HOST:PORT --token KEY [--nprocs N | --devices 0,1]``."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m gpumagic.pool",
                                     description="Lend this machine's devices to a %%dataparallel pool.")
    sub = parser.add_subparsers(dest="command", required=True)
    j = sub.add_parser("join", help="connect to the kernel that printed this command")
    j.add_argument("address", help="HOST:PORT of the kernel")
    j.add_argument("--token", required=True)
    j.add_argument("--nprocs", type=int, default=None, help="ranks on this machine (default: one per GPU)")
    j.add_argument("--devices", default=None, help="comma-separated devices, e.g. 0,1 or cpu")
    args = parser.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    from .devices import visible_gpus
    gpus = [g.device for g in visible_gpus()]
    if args.devices:
        devices = [d if d == "cpu" or d.startswith("cuda") else f"cuda:{d}" for d in args.devices.split(",")]
        if devices == ["cpu"] and args.nprocs:
            devices = ["cpu"] * args.nprocs
    elif gpus:
        devices = gpus[: args.nprocs] if args.nprocs else gpus
    else:
        devices = ["cpu"] * (args.nprocs or 1)
    join((host.strip("[]"), int(port)), args.token, devices)


# ============================================================== worker side

class WorkerContext:
    """What a task sees on its rank: rank, world size, device, and a way to talk to the kernel."""

    def __init__(self, conn, config: dict):
        self.conn = conn
        self.rank = config["rank"]
        self.world_size = config["world_size"]
        self.device = config["device"]
        self.backend = config["backend"]
        self.config = config
        self.state: dict = {}          # kept between tasks (the tensor store lives here)
        self.in_task = False
        self._send_lock = threading.Lock()

    @property
    def torch_device(self):
        import torch
        return torch.device(self.device)

    def send(self, obj) -> None:
        """Send ``obj`` to the kernel's ``on_message`` while the task runs."""
        self._send(("msg", obj))

    def _send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    @property
    def outgoing(self):
        """This rank's bulk buffer for results: fill ``outgoing.get(n)`` and return it from the task."""
        out = self.state.get("_outgoing")
        if out is None:
            from .bulk import Outgoing
            out = self.state["_outgoing"] = Outgoing(shared=not self.config.get("remote"))
        return out

    def _send_result(self, payload, buffer) -> None:
        out = self.outgoing
        ref, new = out.reference(buffer, peer="kernel", can_share=not self.config.get("remote"))
        with self._send_lock:
            self.conn.send(("done", payload, ref))
            out.send(self.conn, ref, new, buffer, "kernel", self.config["parent_pid"])


class _PipeWriter(io.TextIOBase):
    """sys.stdout/sys.stderr in a worker: text goes to the kernel (or nowhere)."""

    def __init__(self, ctx: WorkerContext, stream: str, forward: bool):
        self._ctx, self._stream, self.forward = ctx, stream, forward

    def writable(self):
        return True

    def write(self, text):
        if self.forward and text:
            try:
                self._ctx._send(("out", self._stream, str(text)))
            except Exception:
                pass
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False

    @property
    def encoding(self):
        return "utf-8"


def _worker_main(conn, config: dict) -> None:
    workers.die_with_parent(config["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel stops us; Ctrl-C in a terminal reaches us too
    try:
        os.setpgrp()
    except OSError:
        pass
    os.environ.update(config.get("env") or {})
    ctx = WorkerContext(conn, config)
    try:
        info = _init_rank(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel
        try:
            conn.send(("error", workers.exception_info(config["rank"], exc)))
        finally:
            os._exit(1)
    info["pgid"] = os.getpgrp()
    conn.send(("ready", info))
    if config.get("remote"):
        threading.Thread(target=_watchdog, args=(ctx,), daemon=True).start()
    real_out, real_err = sys.stdout, sys.stderr
    tasks: dict = {}
    incoming = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] in ("stop", "kill"):
            break
        if msg[0] != "run":
            continue
        _, task_name, meta, ref = msg
        if incoming is None:
            from .bulk import Incoming
            incoming = Incoming()
        data = incoming.receive(conn, ref)
        forward = ctx.rank == 0 or (isinstance(meta, dict) and bool(meta.get("all_output")))
        sys.stdout, sys.stderr = _PipeWriter(ctx, "stdout", forward), _PipeWriter(ctx, "stderr", forward)
        ctx.in_task = True
        try:
            fn = tasks.get(task_name) or _import_task(task_name)
            tasks[task_name] = fn
            result = fn(ctx, meta, data)
            payload, buffer = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
            ctx.in_task = False
            ctx._send_result(payload, buffer)
            del result, payload, buffer
            # The cell's namespace, its DDP wrappers and their buffers are cycles: free them now,
            # while the kernel loads the weights, rather than at some later step.
            gc.collect()
        except BaseException as exc:  # noqa: BLE001 - reported to the kernel
            ctx.in_task = False
            try:
                ctx._send(("error", workers.exception_info(ctx.rank, exc)))
            except Exception:
                break
            del exc
            gc.collect()
        finally:
            ctx.in_task = False
            sys.stdout, sys.stderr = real_out, real_err
    _shutdown_rank()
    os._exit(0)  # skip interpreter teardown: CUDA/NCCL destructors can hang at exit


def _watchdog(ctx: WorkerContext) -> None:
    """A rank on another machine cannot be killed from the kernel: while a task runs the kernel
    sends nothing, so anything arriving (a kill, or the connection closing) means stop now,
    even when the main thread is stuck in a collective."""
    while True:
        time.sleep(0.2)
        try:
            if ctx.in_task and ctx.conn.poll(0):
                os._exit(1)
        except (OSError, EOFError, ValueError):
            os._exit(1)


def _import_task(name: str):
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _init_rank(config: dict) -> dict:
    import datetime
    import socket as _socket

    import torch
    device = config["device"]
    info = {"pid": os.getpid(), "host": _socket.gethostname(), "device": device,
            "torch": torch.__version__}
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        _bind_to_gpu_cpus(index)
        torch.cuda.set_device(index)
        info["device_name"] = torch.cuda.get_device_name(index)
    else:
        if config.get("threads"):
            torch.set_num_threads(config["threads"])
        info["device_name"] = "cpu"
    if config["backend"]:
        import torch.distributed as dist
        timeout = datetime.timedelta(seconds=config["timeout"])
        store = dist.TCPStore(config["addr"], config["port"], config["world_size"] + 1, False,
                              timeout=datetime.timedelta(seconds=120))
        kwargs = {}
        if device.startswith("cuda") and config["backend"] == "nccl":
            kwargs["device_id"] = torch.device(device)
        try:
            dist.init_process_group(config["backend"], store=store, rank=config["rank"],
                                    world_size=config["world_size"], timeout=timeout, **kwargs)
        except TypeError:
            dist.init_process_group(config["backend"], store=store, rank=config["rank"],
                                    world_size=config["world_size"], timeout=timeout)
        # A first collective connects every pair now rather than in the user's first step.
        if device.startswith("cuda") and config["backend"] == "nccl":
            t = torch.ones(1, device=device)
            dist.all_reduce(t)
            torch.cuda.synchronize()
        else:
            dist.barrier()
        # What the first cell needs: DistributedDataParallel's constructor imports torch._dynamo
        # (over a second), better paid here than in the user's cell.
        import torch._dynamo  # noqa: F401
        from torch.nn.parallel import DistributedDataParallel  # noqa: F401
    # Everything imported so far lives as long as the worker: keep the garbage collector from
    # walking it again and again during training steps.
    gc.collect()
    gc.freeze()
    return info


def _bind_to_gpu_cpus(index: int) -> None:
    """Run on the CPU cores near the GPU (its NUMA node), as NVIDIA's launchers do."""
    try:
        from . import devices
        from .devices import nvml
        gpus = devices.visible_gpus()
        if index >= len(gpus) or gpus[index].handle is None:
            return
        nv = nvml.lib()
        words = (os.cpu_count() + 63) // 64
        mask = nv.nvmlDeviceGetCpuAffinity(gpus[index].handle, words)
        cpus = {w * 64 + b for w, bits in enumerate(mask) for b in range(64) if bits >> b & 1}
        allowed = os.sched_getaffinity(0)
        mine = cpus & allowed
        # Only a plausible NUMA share: a virtual machine may report a mask that means nothing.
        enough = max(4, len(allowed) // (2 * max(1, len(gpus))))
        if len(mine) >= enough and mine != allowed:
            os.sched_setaffinity(0, mine)
    except Exception:
        pass


def _shutdown_rank() -> None:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


if __name__ == "__main__":
    main()
