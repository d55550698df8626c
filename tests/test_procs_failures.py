"""Worker failures (gpumagic.procs.failures): the user's lines in tracebacks, and which error is shown."""
from __future__ import annotations

import linecache
import signal

from gpumagic.errors import WorkerDied, WorkerError
from gpumagic.procs.failures import death_info, exception_info, primary_error, same_failure


def _raise_from_cell():
    source = "x = 1\ny = x / 0\n"
    name = "<ipython-input-7-0123abcd>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    try:
        exec(compile(source, name, "exec"), {})
    except ZeroDivisionError as exc:
        return exc
    raise AssertionError("no error")


def test_tracebacks_start_at_the_cell_and_name_it_as_ipython_does():
    info = exception_info(1, _raise_from_cell())
    assert info["rank"] == 1 and info["exc_type"] == "ZeroDivisionError" and info["message"] == "division by zero"
    tb = info["traceback"]
    assert 'Cell In[7], line 2' in tb and "y = x / 0" in tb
    assert "_raise_from_cell" not in tb and "test_procs_failures" not in tb   # frames before the cell's go


def test_deaths_say_how():
    killed = death_info(0, 10, -signal.SIGKILL)["message"]
    assert killed == "the worker was killed by signal 9 (SIGKILL: out of memory?)"
    assert death_info(0, 10, -signal.SIGTERM)["message"] == "the worker was killed by signal 15 (SIGTERM)"
    assert death_info(0, 10, 2)["message"] == "the worker exited with code 2"
    assert death_info(0, None, None, remote=True)["message"] == "the connection to the worker was lost"


def _info(rank, exc_type="RuntimeError", message="boom", line="Cell In[3], line 4", **extra):
    return {"rank": rank, "pid": 100 + rank, "exc_type": exc_type, "message": message,
            "traceback": f"Traceback (most recent call last):\n  {line}\n{exc_type}: {message}\n", **extra}


def test_the_shown_error_is_the_cause_not_its_consequences():
    errors = {0: _info(0, "DistBackendError", "Connection closed by peer"), 1: _info(1, "ValueError", "bad")}
    err = primary_error(errors)
    assert type(err) is WorkerError and err.rank == 1 and err.exc_type == "ValueError" and err.all_errors is errors
    died = {0: death_info(0, 100, -9), 1: _info(1)}
    assert primary_error(died).rank == 1                       # a real exception before a death
    only_death = primary_error({2: death_info(2, 102, 3)})
    assert isinstance(only_death, WorkerDied) and only_death.rank == 2
    assert only_death._render_traceback_()[0] == "WorkerError: rank 2 (pid 102) raised WorkerDied"


def test_same_failure_means_every_rank_stopped_at_the_same_line():
    assert same_failure({0: _info(0), 1: _info(1)}, world=2)
    assert not same_failure({0: _info(0)}, world=2)                                  # rank 1 still running
    assert not same_failure({0: _info(0), 1: _info(1, line="Cell In[3], line 5")}, world=2)
    assert not same_failure({0: _info(0, "OutOfMemoryError"), 1: _info(1, "OutOfMemoryError")}, world=2)
    assert not same_failure({0: death_info(0, 1, -9), 1: death_info(1, 2, -9)}, world=2)
