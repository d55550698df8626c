"""Ending workers (gpumagic.procs.teardown): leave, SIGTERM, grace, SIGKILL, reap; and dying with the kernel."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import psutil

from gpumagic.procs.teardown import end_processes
from tests.conftest import ROOT


def _leave_now():
    pass


def _sleep():
    time.sleep(60)


def _ignore_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def test_processes_that_leave_keep_their_exit_code_and_others_are_terminated_then_killed():
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=t) for t in (_leave_now, _sleep, _ignore_sigterm)]
    for p in procs:
        p.start()
    time.sleep(0.5)   # the third has installed its handler
    t0 = time.monotonic()
    codes = end_processes(procs, wait=1.0, grace=0.5)
    assert codes == [0, -signal.SIGTERM, -signal.SIGKILL]
    assert time.monotonic() - t0 < 5
    for p in procs:   # reaped and closed
        try:
            p.is_alive()
        except ValueError:
            continue
        raise AssertionError("a process was not closed")


GRANDCHILD = """
import multiprocessing, os, sys, time
sys.path.insert(0, {root!r})
from gpumagic.procs.teardown import die_with_parent

def worker(parent):
    die_with_parent(parent)
    time.sleep(60)

if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=worker, args=(os.getpid(),))
    p.start()
    print(p.pid, flush=True)
    time.sleep(60)
"""


def test_a_worker_dies_with_its_kernel(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(GRANDCHILD.format(root=ROOT))
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(kernel.stdout.readline())
        time.sleep(0.5)
        assert psutil.pid_exists(worker)
    finally:
        kernel.kill()
        kernel.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if psutil.Process(worker).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        os.kill(worker, signal.SIGKILL)
        raise AssertionError("the worker outlived its kernel")
