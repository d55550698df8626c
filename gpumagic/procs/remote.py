"""Ranks on other machines: the kernel's listener, and the agent that lends a machine's devices.

On each other machine, ``python -m gpumagic.procs.remote join HOST:PORT
--token KEY`` (the command ``%dataparallel listen`` prints) starts one worker
per device; each connects to the kernel's listener, proves it knows the key
(HMAC challenge, as in ``multiprocessing.connection``), receives its
:class:`~.worker.WorkerConfig` and runs the :mod:`.worker` main loop. When a
pool ends, fresh workers connect again and wait for the next one.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection as mpc
import os
import signal
import socket
import sys
import time

from .. import session
from .teardown import die_with_parent
from .worker import worker_main

logger = logging.getLogger(__name__)

__all__ = ["SessionListener", "session_listener", "close_listener", "accept_ranks", "join", "main"]


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
        return f"python -m gpumagic.procs.remote join {host}:{self.port} --token {self.token} --nprocs {nprocs}"

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
            except (TimeoutError, BlockingIOError):
                continue
            try:
                mpc.deliver_challenge(conn, self.token.encode())
                mpc.answer_challenge(conn, self.token.encode())
                kind, hello = conn.recv()
                if kind == "hello":
                    return conn, hello
            except Exception:  # a stale or foreign connection: the next one
                logger.debug("refused a connection to the session listener", exc_info=True)
            conn.close()

    def close(self) -> None:
        self._listener.close()


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


def accept_ranks(pool, deadline: float) -> None:
    """Take ``pool``'s remote ranks from workers that connect to the session listener."""
    from ..display import note
    listener = session_listener(pool.master_addr)
    note(f"%%dataparallel: waiting for {pool.remote} rank(s) from other machines; on each, run:\n  "
         + listener.command(pool.remote))
    for r in pool.ranks[pool.local:]:
        conn, hello = listener.accept(deadline)
        r.conn, r.pid = conn, hello.get("pid")
        r.device = pool.devices[r.rank] = f"{hello.get('host', '?')}:{hello.get('device', '?')}"
        config = pool._config(r.rank, hello.get("device", "cpu"))
        config.env, config.threads, config.remote = dict(pool.env), None, True   # their own interfaces
        conn.send(("config", config))


# ============================================================== the agent on another machine

def _remote_worker(address, token: str, device: str, agent_pid: int) -> None:
    die_with_parent(agent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn = mpc.Client(address, authkey=token.encode())   # waits until the kernel takes us
    except (OSError, EOFError, mpc.AuthenticationError):  # type: ignore[attr-defined]
        os._exit(3)                                           # the kernel is gone: the agent stops
    conn.send(("hello", {"device": device, "host": socket.gethostname(), "pid": os.getpid()}))
    _, config = conn.recv()
    config.parent_pid = agent_pid
    worker_main(conn, config)


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
    """``python -m gpumagic.procs.remote join HOST:PORT --token KEY [--nprocs N | --devices 0,1]``."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m gpumagic.procs.remote",
                                     description="Lend this machine's devices to a %%dataparallel pool.")
    sub = parser.add_subparsers(dest="command", required=True)
    j = sub.add_parser("join", help="connect to the kernel that printed this command")
    j.add_argument("address", help="HOST:PORT of the kernel")
    j.add_argument("--token", required=True)
    j.add_argument("--nprocs", type=int, default=None, help="ranks on this machine (default: one per GPU)")
    j.add_argument("--devices", default=None, help="comma-separated devices, e.g. 0,1 or cpu")
    args = parser.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    from ..devices import visible_gpus
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


if __name__ == "__main__":
    main()
