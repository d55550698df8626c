"""Choosing how workers start (gpumagic.procs.start): fork only where it is safe; starting them cleanly."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from gpumagic.procs.start import choose_start_method


def _poll():
    """A thread target from outside the kernel's own packages."""


class _FakeThread:
    def __init__(self, name, target=None, cls_module="threading"):
        self.name, self._target = name, target
        self.__class__ = type("Thread", (_FakeThread,), {"__module__": cls_module})

    def is_alive(self):
        return True


def test_start_method_is_fork_only_where_safe():
    from IPython.core.history import HistorySavingThread
    safe = [_FakeThread("IPythonHistorySavingThread", cls_module=HistorySavingThread.__module__),
            _FakeThread("Heartbeat", cls_module="ipykernel.heartbeat")]
    assert choose_start_method(None, "cpu", False, safe, "linux")[0] == "fork"
    user = safe + [_FakeThread("Thread-9 (poll)", target=_poll)]
    # Where fork is unsafe on Linux, a fork server with torch imported starts the workers.
    method, why = choose_start_method(None, "cpu", False, user, "linux")
    assert method == "forkserver" and "'Thread-9 (poll)'" in why and "fork server" in why
    assert choose_start_method(None, "cpu", True, safe, "linux")[0] == "forkserver"
    method, why = choose_start_method(None, "cuda:0", False, safe, "linux")
    assert method == "forkserver" and "cuda:0" in why
    assert choose_start_method(None, "cpu", False, safe, "darwin")[0] == "spawn"
    assert choose_start_method(None, "cuda:0", False, safe, "darwin")[0] == "spawn"
    assert choose_start_method("forkserver", "cuda:0", True, user, "linux") == ("forkserver", "requested")
    # Of many, the newest three are named (what the notebook most likely just started), and the rest counted.
    many = user + [_FakeThread(f"Thread-{n} (poll)", target=_poll) for n in (10, 11, 12, 13)]
    why = choose_start_method(None, "cpu", False, many, "linux")[1]
    assert "thread(s) 'Thread-13 (poll)', 'Thread-12 (poll)', 'Thread-11 (poll)' (and 2 more) are running" in why
    with pytest.raises(UsageError, match="fork cannot be used with a model on cuda:1: CUDA does not survive fork; "
                                         "valid choices: spawn"):
        choose_start_method("fork", "cuda:1", True, safe, "linux")


def test_multiprocessing_descriptor_sharer_leaves_fork_safe():
    # torch's reducers start it when they send a shared tensor (as --strategy fsdp does); it takes no
    # lock while serving and resets itself in a child multiprocessing forks.
    from multiprocessing.resource_sharer import _ResourceSharer

    from gpumagic.procs.start import fork_unsafe_threads
    sharer = _FakeThread("Thread-5 (_serve)", target=_ResourceSharer()._serve)
    assert fork_unsafe_threads([sharer]) == []
    assert choose_start_method(None, "cpu", False, [sharer], "linux")[0] == "fork"
    assert fork_unsafe_threads([_FakeThread("Thread-9 (poll)", target=_poll)]) != []
