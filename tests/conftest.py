"""Shared fixtures: a real InteractiveShell with gpumagic loaded, and GPU skips."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _cuda_count() -> int:
    # Through NVML so that collecting tests never initialises CUDA in this process.
    try:
        from gpumagic.devices import visible_gpus
        return len(visible_gpus())
    except Exception:  # noqa: BLE001 - no NVML, no driver: no GPU tests
        return 0


def pytest_collection_modifyitems(config, items):
    count = _cuda_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    skip_gpu2 = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and count < 1:
            item.add_marker(skip_gpu)
        if "gpu2" in item.keywords and count < 2:
            item.add_marker(skip_gpu2)
    # GPU tests initialise CUDA in this process: run them after every test that checks that gpumagic
    # itself never does (the order is otherwise pytest's, file by file).
    items.sort(key=lambda item: any(item.get_closest_marker(m) for m in ("gpu", "cuda_if_present")))


@pytest.fixture(scope="session")
def _shell_instance():
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "gpumagic")
    yield shell


@pytest.fixture
def shell(_shell_instance):
    """The session's shell, gpumagic loaded, with a fresh namespace and the default device."""
    from gpumagic import session
    shell = _shell_instance
    shell.reset(new_session=False)
    if "gpumem" not in shell.magics_manager.magics["line"]:
        shell.run_line_magic("load_ext", "gpumagic")
    session.set_picked_device(None)
    yield shell
    session.set_picked_device(None)


def run_cell(shell, source: str):
    """Run ``source`` as a cell; returns (result, captured stdout+stderr text)."""
    from IPython.utils.capture import capture_output
    with capture_output(display=True) as cap:
        result = shell.run_cell(source, store_history=True)
    return result, cap.stdout + cap.stderr, cap


def wait_for(condition, timeout: float = 10.0) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (polled every 10 ms)."""
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def no_cuda_init(monkeypatch):
    """Fail the test if anything asks torch to initialise CUDA."""
    import torch
    calls: list = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda *a, **k: calls.append(a))
    yield calls
    assert calls == []
    assert not torch.cuda.is_initialized()


@pytest.fixture
def messages(monkeypatch):
    """Count the state messages each widget sends to the frontend (by model id)."""
    from ipywidgets import Widget
    sent: dict[str, int] = {}
    original = Widget.send_state

    def counting(self, key=None):
        sent[self.model_id] = sent.get(self.model_id, 0) + 1
        return original(self, key)
    monkeypatch.setattr(Widget, "send_state", counting)
    return sent


@pytest.fixture
def no_last_error():
    """No earlier failure (another test's cell, pytest's own record) kept by sys.last_* or by the shell
    (its traceback formatter, its last result): its frames' tensors would add a note of their own to
    %gpumem's report, and their bytes would go in the middle of a test that measures memory."""
    import gc

    from IPython.core.interactiveshell import InteractiveShell

    from gpumagic.memory import last_error
    from gpumagic.memory.free import trim_c_heap
    last_error.let_go(InteractiveShell.instance() if InteractiveShell.initialized() else None)
    sys.last_type = sys.last_value = sys.last_traceback = None
    if sys.version_info >= (3, 12):
        sys.last_exc = None
    gc.collect()
    # what glibc's heap kept of earlier tests' freed memory goes back first: a test that measures resident
    # memory must not see it fall when the code under test trims the heap (%gpumem --free, --rescue)
    trim_c_heap()


@pytest.fixture
def started(tmp_path, monkeypatch):
    """Processes the test starts (tests/sharing_helpers.Started), ended by pid afterwards; gpumagic's worker
    marks in a folder of the test's own, and no Jupyter server's answers kept from another test."""
    from gpumagic.devices import jupyter_servers
    from gpumagic.procs import marks
    from tests.sharing_helpers import Started
    monkeypatch.setenv(marks.DIR_ENV, str(tmp_path / "marks"))
    jupyter_servers.forget()
    procs = Started()
    yield procs
    procs.end_all()
