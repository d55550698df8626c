"""Getting memory back without a restart, through a real InteractiveShell: the last error let go
wherever IPython keeps it, the output history, and what still holds memory. Bytes are measured."""
from __future__ import annotations

import gc
import sys
import types
import weakref

import psutil
import pytest
import torch

from gpumagic.memory import last_error
from gpumagic.memory.holders import unnamed_tensors, who_holds
from tests.conftest import run_cell

pytestmark = pytest.mark.usefixtures("no_last_error")

MIB = 1 << 20
BIG = 256 * MIB


def rss() -> int:
    return psutil.Process().memory_info().rss


def storage_key(t) -> tuple | None:
    """``("cpu", data_ptr)`` of a CPU tensor's storage; None for one without (a fake tensor of a compile)."""
    try:
        return ("cpu", t.untyped_storage().data_ptr()) if t.device.type == "cpu" else None
    except RuntimeError:
        return None


def local_of(error, name: str):
    """The local ``name`` of the innermost frame of ``error``'s traceback that has one."""
    return next(f.f_locals[name] for f in reversed(last_error.error_frames([error])) if name in f.f_locals)


FAILING = ("import torch\n"
           "def forward(n):\n"
           "    act = torch.ones(n // 4)\n"
           "    hidden = [torch.ones(n // 16) for _ in range(2)]\n"
           "    raise RuntimeError('out of memory')\n"
           f"forward({BIG})")


def test_free_gives_back_what_only_the_last_error_held(shell, no_cuda_init):
    run_cell(shell, "import torch\nkeep = torch.ones(16 * 1024 * 1024 // 4)")   # the notebook's own: stays
    base = rss()
    assert not run_cell(shell, FAILING)[0].success
    held = rss() - base
    assert held > BIG * 1.4, held
    act = weakref.ref(local_of(sys.last_value, "act"))
    freed = shell.run_line_magic("gpumem", "--free --json")
    assert act() is None
    assert rss() - base < 32 * MIB, "the kernel holds more than its variables after --free"
    assert freed["devices"]["cpu"]["freed"] > BIG * 1.4
    assert {"sys.last_value", "sys.last_traceback", "InteractiveTB.tb"} <= set(freed["last_error"]["let_go"])
    # forward's frame and IPython's run_code; the cell's own frame is the notebook's namespace
    assert freed["last_error"]["frames_cleared"] == 2
    assert [(h["name"], h["bytes"]) for h in freed["held"]] == [("keep", 16 * MIB)]
    assert torch.equal(shell.user_ns["keep"], torch.ones(16 * 1024 * 1024 // 4))
    assert sys.last_value is None and shell.InteractiveTB.tb is None


def test_free_right_after_the_error_lets_go_of_the_cells_result_too(shell):
    # The failed cell's ExecutionResult keeps its error until the next cell ends: --free in the very next
    # cell must drop it there too, keeping the result's type and message.
    assert not run_cell(shell, FAILING)[0].success
    result = shell.last_execution_result
    act = weakref.ref(local_of(result.error_in_exec, "act"))
    freed = shell.run_line_magic("gpumem", "--free --json")
    assert act() is None
    assert "last_execution_result.error_in_exec" in freed["last_error"]["let_go"]
    assert type(result.error_in_exec) is RuntimeError and str(result.error_in_exec) == "out of memory"
    assert result.error_in_exec.__traceback__ is None and not result.success


def test_an_error_a_variable_holds_is_named_and_kept(shell):
    assert run_cell(shell, "import torch\ndef forward():\n    act = torch.ones(1 << 20)\n    raise ValueError('x')\n"
                           "try:\n    forward()\nexcept ValueError as caught:\n    err = caught\n"
                           "raise err")[0].success is False
    act = weakref.ref(local_of(shell.user_ns["err"], "act"))
    freed = shell.run_line_magic("gpumem", "--free --json")
    assert act() is not None, "a notebook variable's error was cleared"
    assert freed["last_error"]["held_by"] == ["err"] and freed["last_error"]["let_go"] == []
    _, out, _ = run_cell(shell, "%gpumem --free")
    assert "is held by notebook variable err: `del err` lets it go" in out
    run_cell(shell, "del err, caught")          # what the report says
    shell.run_line_magic("gpumem", "--free")
    assert act() is None


def test_free_history_drops_out_entries_that_hold_tensors(shell, no_cuda_init):
    run_cell(shell, "import torch")
    base = rss()
    run_cell(shell, f"torch.ones({BIG // 4})")        # Out[n] and _n hold it
    n = shell.execution_count - 1
    run_cell(shell, "'a plain value'")                 # stays in the history
    assert rss() - base > BIG * 0.9
    _, out, _ = run_cell(shell, "%gpumem --free")
    assert "`%gpumem --free --history` lets them go" in out and rss() - base > BIG * 0.9
    freed = shell.run_line_magic("gpumem", "--free --history --json")
    assert rss() - base < 32 * MIB
    assert f"Out[{n}]" in freed["history"] and f"_{n}" in freed["history"]
    assert n not in shell.user_ns["Out"] and f"_{n}" not in shell.user_ns
    assert "a plain value" in shell.user_ns["Out"].values()


def test_history_needs_free_and_drop_needs_rescue(shell):
    from IPython.core.error import UsageError
    with pytest.raises(UsageError, match=r"--history only applies to --free; valid choices: --free --history"):
        shell.run_line_magic("gpumem", "--history")
    with pytest.raises(UsageError, match=r"--drop only applies to --rescue; valid choices: --rescue --drop"):
        shell.run_line_magic("gpumem", "--drop")
    with pytest.raises(UsageError, match="--free and --rescue cannot be combined"):
        shell.run_line_magic("gpumem", "--free --rescue")
    with pytest.raises(UsageError, match="--rescue moves tensors off a GPU; cpu is where they go"):
        shell.run_line_magic("gpumem", "cpu --rescue")


def test_debugger_and_chained_errors_are_let_go(shell):
    # A retry that failed twice keeps both errors (the second's __context__ is the first), and a
    # debugger that ran keeps a frame: every one of them goes.
    code = ("import torch\ndef attempt(n):\n    act = torch.ones(n)\n    raise RuntimeError('oom')\n"
            "try:\n    attempt(1 << 20)\nexcept RuntimeError:\n    attempt(1 << 19)")
    assert not run_cell(shell, code)[0].success
    frames = last_error.error_frames([sys.last_value])
    acts = [weakref.ref(f.f_locals["act"]) for f in frames if "act" in f.f_locals]
    assert len(acts) == 2
    shell.InteractiveTB.pdb = types.SimpleNamespace(botframe=frames[-1])   # what %debug leaves behind
    del frames
    freed = shell.run_line_magic("gpumem", "--free --json")
    assert [a() for a in acts] == [None, None]
    assert "InteractiveTB.pdb" in freed["last_error"]["let_go"] and shell.InteractiveTB.pdb is None


def test_clear_frames_leaves_a_cells_own_frame_and_empties_read_locals():
    namespace: dict = {}
    exec("import sys\ndef f():\n    big = [1] * 10\n    raise KeyError\ntry:\n    f()\n"
         "except KeyError as e:\n    err = e", namespace)
    frames = last_error.error_frames([namespace["err"]])
    module_frame, f_frame = frames
    snapshot = f_frame.f_locals            # a debugger's read leaves this copy on the frame (Python < 3.13)
    assert "big" in snapshot
    cleared, refused = last_error.clear_frames(frames)
    assert (cleared, refused) == (1, [])
    assert "err" in module_frame.f_globals and "big" not in f_frame.f_locals
    if sys.version_info < (3, 13):
        assert snapshot == {}


def test_who_holds_names_a_module_cache_and_a_running_frame():
    mod = types.ModuleType("gpumagic_test_cache")
    sys.modules[mod.__name__] = mod
    try:
        class Holder:
            pass
        mod.cache = Holder()
        mod.cache.items = {"w": [torch.zeros(10)]}
        assert who_holds(mod.cache.items["w"][0]) == "gpumagic_test_cache.cache.items.w[0]"
        ours = mod.cache.items["w"][0]
        known = {key for t in gc.get_objects() if isinstance(t, torch.Tensor) and t is not ours
                 for key in [storage_key(t)] if key is not None}   # every other storage
        found = unnamed_tensors(torch, "cpu", known)
        assert [(u.holder, u.nbytes) for u in found] == [("gpumagic_test_cache.cache.items.w[0]", 40)]
    finally:
        del sys.modules[mod.__name__]


def test_free_gives_back_what_the_c_heap_kept_after_del(shell, no_cuda_init):
    # Tensors of a few hundred KiB come from glibc's heap: `del` returns them to the heap, not to the
    # system, and the kernel's resident memory stays up until --free trims the heap.
    run_cell(shell, "import torch")
    base = rss()
    run_cell(shell, "blocks = [torch.ones(1024 * 1024 // 4 + i) for i in range(160)]\n"
                    "small = [torch.ones(300 * 1024 // 4) for _ in range(100)]")
    run_cell(shell, "del blocks, small")
    kept = rss() - base
    freed = shell.run_line_magic("gpumem", "--free --json")
    assert kept > 16 * MIB, "glibc gave the memory back by itself: nothing left to show here"
    assert freed["devices"]["cpu"]["freed"] > kept - 8 * MIB
    assert rss() - base < 8 * MIB
