"""Worker failures (gpumagic.procs.failures): the user's lines in tracebacks, and which error is shown."""
from __future__ import annotations

import linecache
import os
import signal
import types

import IPython

import gpumagic
from gpumagic.cell.compile import register_source
from gpumagic.errors import WorkerDied, WorkerError
from gpumagic.procs.failures import death_info, exception_info, primary_error, relabel, same_failure


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


def test_an_exception_whose_str_fails_is_still_described():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no str")
    try:
        raise Unprintable()
    except Unprintable as exc:
        info = exception_info(0, exc)
    assert info["exc_type"] == "Unprintable" and info["message"] == "<exception str() failed>"
    assert "raise Unprintable()" in info["traceback"]


def test_deaths_say_how():
    killed = death_info(0, 10, -signal.SIGKILL)["message"]
    assert killed == "the worker was killed by signal 9 (SIGKILL: out of memory?)"
    assert death_info(0, 10, -signal.SIGTERM)["message"] == "the worker was killed by signal 15 (SIGTERM)"
    assert death_info(0, 10, 2)["message"] == "the worker exited with code 2"
    assert death_info(0, None, None)["message"] == "the worker closed its pipe"


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


# ---------------------------------------------------------------- cells as a kernel names them

GPUMAGIC = os.path.dirname(os.path.abspath(gpumagic.__file__))


def _compiled(source: str, name: str, ns: dict) -> None:
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    exec(compile(source, name, "exec"), ns)


def _kernel_shell(monkeypatch, numbers: dict):
    """A stand-in for ipykernel's shell: its compiler knows each cell's number, not its name's pattern."""
    from ipykernel.compiler import XCachingCompiler
    compiler = XCachingCompiler()
    compiler._filename_map.update(numbers)
    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(compile=compiler))


def _raise_through_plumbing(cell: str, function: str):
    """Run ``cell`` the way a worker does: from a gpumagic frame, calling a notebook function."""
    ns: dict = {}
    _compiled("def run(code, ns):\n    exec(code, ns)\n", os.path.join(GPUMAGIC, "procs", "_plumbing.py"), ns)
    _compiled("def step(x):\n    y = x + 1\n    raise ValueError(f'step failed at {y}')\n", function, ns)
    register_source(cell, "%%dataparallel\nfor x in [1]:\n    step(x)\n")
    code = compile("\nfor x in [1]:\n    step(x)\n", cell, "exec")
    try:
        ns["run"](code, ns)
    except ValueError as exc:
        return exc
    raise AssertionError("no error")


def test_a_kernels_cells_are_named_as_its_shell_numbered_them(monkeypatch):
    cell, function = "/tmp/ipykernel_4242/1111.py", "/tmp/ipykernel_4242/2222.py"
    # In the worker: no shell; the cell is known by its registered source, the function by nothing yet.
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    info = exception_info(0, _raise_through_plumbing(cell, function))
    tb = info["traceback"]
    assert tb.startswith("Traceback (most recent call last):\n")
    assert f'File "{cell}", line 3, in <module>\n    step(x)' in tb
    assert f'File "{function}", line 3, in step\n    raise ValueError' in tb
    assert "gpumagic" not in tb and "_raise_through_plumbing" not in tb   # plumbing and callers go
    assert tb.endswith("ValueError: step failed at 2\n")
    # In the kernel: its compiler numbered both cells.
    _kernel_shell(monkeypatch, {cell: 12, function: 5})
    err = primary_error({0: info})
    assert "Cell In[12], line 3, in <module>\n    step(x)" in err.remote_traceback
    assert "Cell In[5], line 3, in step\n    raise ValueError(f'step failed at {y}')" in err.remote_traceback
    assert "ipykernel_" not in err.remote_traceback and err.message == "step failed at 2"


def test_frames_of_gpumagic_below_the_cell_go_too():
    # report() misused: the cell's line and gpumagic's message say it, not gpumagic's own frames.
    ns: dict = {}
    _compiled("def report(value):\n    raise TypeError('report() takes numbers')\n",
              os.path.join(GPUMAGIC, "sharedtrain", "_channel.py"), ns)
    try:
        _compiled("x = 1\nreport(object())\n", "<ipython-input-9-00ff>", ns)
    except TypeError as exc:
        tb = exception_info(0, exc)["traceback"]
    assert "Cell In[9], line 2, in <module>\n    report(object())" in tb
    assert "_channel" not in tb and tb.endswith("TypeError: report() takes numbers\n")


def test_chained_exceptions_are_kept_and_trimmed_alike():
    name = "<ipython-input-3-0abc>"
    source = "try:\n    {}['k']\nexcept KeyError as e:\n    raise RuntimeError('lookup failed') from e\n"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    try:
        exec(compile(source, name, "exec"), {})
    except RuntimeError as exc:
        tb = exception_info(0, exc)["traceback"]
    assert "Cell In[3], line 2, in <module>" in tb and "KeyError: 'k'" in tb
    assert "direct cause of the following exception" in tb
    assert "Cell In[3], line 4, in <module>" in tb and tb.endswith("RuntimeError: lookup failed\n")
    assert "test_procs_failures" not in tb


def test_without_a_cell_every_frame_stays():
    try:
        _raise_from_nowhere()
    except LookupError as exc:
        tb = exception_info(0, exc)["traceback"]
    assert "_raise_from_nowhere" in tb and "test_without_a_cell_every_frame_stays" in tb


def _raise_from_nowhere():
    raise LookupError("during start-up")


def test_tracebacks_inside_messages_name_cells_too(monkeypatch):
    # torch re-raises a DataLoader worker's exception with that worker's traceback as its message.
    _kernel_shell(monkeypatch, {"/tmp/ipykernel_1/77.py": 4})
    message = ("Caught KeyError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
               '  File "/tmp/ipykernel_1/77.py", line 5, in __getitem__\n    raise KeyError(i)\nKeyError: 0\n')
    err = primary_error({1: _info(1, "KeyError", message)})
    assert "  Cell In[4], line 5, in __getitem__\n" in err.message and "ipykernel_" not in str(err)
    assert relabel('File "/elsewhere/x.py", line 5') == 'File "/elsewhere/x.py", line 5'


def test_ranks_still_running_are_named_where_the_error_shown_is_a_consequence():
    # rank 0's collective timed out: rank 1, which never came, is where to look
    timed_out = primary_error({0: _info(0, "DistBackendError", "Timed out waiting 3000ms")}, still_running=[1])
    assert timed_out.still_running == [1] and "rank 1 had not finished" in timed_out._render_traceback_()[-1]
    # rank 1 raised while rank 0 waited for it in a barrier: rank 0 is no lead
    raised = primary_error({1: _info(1, "ValueError", "rank one fails")}, still_running=[0])
    assert raised.still_running == [] and "had not finished" not in "\n".join(raised._render_traceback_())
