"""The out-of-memory report under the traceback and the rescue it names, through a real InteractiveShell
on the CPU: a real allocator failure, and a cell raising torch.OutOfMemoryError itself. Each piece of
advice the report prints is followed here and its bytes are measured."""
from __future__ import annotations

import psutil
import pytest
import torch

from gpumagic.memory import oom
from tests.conftest import run_cell

pytestmark = pytest.mark.usefixtures("no_last_error")

MIB = 1 << 20


def rss() -> int:
    return psutil.Process().memory_info().rss


STEP = ("def step(n):\n"                                    # line 1
        "    acts = [torch.ones(n // 4) for _ in range(3)]\n"
        "    h = model(torch.randn(8, 256))\n"
        "    huge = torch.empty(2**45, dtype=torch.uint8)\n"   # line 4: the CPU allocator refuses
        f"step({64 * MIB})")


def test_errors_told_apart_with_device_and_size():
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                       "memory: you tried to allocate 35184372088832 bytes. Error code 12")
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 1 has a total capacity "
                                  "of 79.19 GiB of which 3.06 MiB is free.")
    numpy_style = MemoryError("Unable to allocate 8.00 GiB for an array with shape (1073741824,)")
    for error, device, size in ((cpu, "cpu", 35184372088832), (cuda, "cuda:1", 20 << 30),
                                (numpy_style, "cpu", 8 << 30)):
        assert oom.is_out_of_memory(error) and oom.oom_device(error) == device
        assert oom.requested_bytes(error) == size
    try:
        try:
            raise cuda
        except torch.OutOfMemoryError as inner:
            raise ValueError("the trainer failed") from inner
    except ValueError as wrapped:
        assert oom.is_out_of_memory(wrapped) and oom.oom_device(wrapped) == "cuda:1"
    assert not oom.is_out_of_memory(RuntimeError("shape mismatch")) and not oom.is_out_of_memory(ValueError())


def test_the_report_under_a_real_cpu_allocator_failure(shell, no_cuda_init):
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(256, 256)\nkeep = torch.ones(32 * 1024 * 1024 // 4)")
    cell_number = shell.execution_count
    result, out, cap = run_cell(shell, STEP)
    assert not result.success and "DefaultCPUAllocator" in str(result.error_in_exec)
    report = out.split("Out of memory on cpu", 1)
    assert len(report) == 2, out
    text = report[1]
    assert text.startswith(": asked for 32.0 TiB")
    assert f"Cell In[{cell_number}], line 4, in step: acts 192.0 MiB" in text
    assert "only the error holds 192." in text
    assert "notebook variables on cpu: keep 32.0 MiB, model 257.0 KiB" in text
    assert "`%gpumem --rescue --drop` (or `%gpumem --free`) lets go of the 192." in text
    assert "no freeing makes room for it" in text           # 32 TiB is more than the machine has
    assert out.count("Out of memory on") == 1


def test_the_advice_frees_what_it_says(shell, no_cuda_init):
    run_cell(shell, "import torch\nmodel = torch.nn.Linear(256, 256)")
    base = rss()
    assert not run_cell(shell, STEP)[0].success
    report = oom.oom_report(shell.last_execution_result.error_in_exec, shell.user_ns,
                            hidden=shell.user_ns_hidden, holders=(shell,), shell=shell)
    assert report.device == "cpu" and 192 * MIB <= report.error_alone < 200 * MIB
    held = rss() - base
    _, out, _ = run_cell(shell, "%gpumem --rescue")        # on the CPU: nothing to move, and it says so
    assert "the error also holds 192." in out and "which a rescue leaves there" in out
    assert rss() - base > held - 8 * MIB
    drop = shell.run_line_magic("gpumem", "--rescue --drop --json")
    freed = held - (rss() - base)
    assert abs(freed - report.error_alone) < 16 * MIB, (freed, report.error_alone)
    assert drop["dropped"] and drop["before"]["cpu"] - drop["after"]["cpu"] > 180 * MIB
    assert type(shell.user_ns["model"]) is torch.nn.Linear


def test_a_cell_raising_torch_out_of_memory_itself_and_del_advice(shell, no_cuda_init):
    # (sizes over 32 MiB: glibc returns smaller blocks to the system only at its discretion)
    run_cell(shell, "import torch\nbuffers = [torch.ones(96 * 1024 * 1024 // 4)]\nshared = torch.ones(1024)\n"
                    "also = shared")
    code = ("def grow():\n    extra = torch.ones(64 * 1024 * 1024 // 4)\n"
            "    raise torch.OutOfMemoryError('out of memory')\ngrow()")
    result, out, _ = run_cell(shell, code)
    assert type(result.error_in_exec) is torch.OutOfMemoryError
    assert "Out of memory on cpu" in out and "extra 64.0 MiB" in out
    assert "`del buffers` then `%gpumem --free` gives back 96.0 MiB" in out
    base = rss()
    run_cell(shell, "del buffers")                             # what the report says
    shell.run_line_magic("gpumem", "--free")
    assert base - rss() > 150 * MIB                             # buffers' 96 MiB and the error's 64 MiB


def test_no_report_for_other_errors_nor_after_unload(shell):
    _, out, _ = run_cell(shell, "raise RuntimeError('shape mismatch')")
    assert "Out of memory" not in out
    shell.run_line_magic("unload_ext", "gpumagic")
    try:
        _, out, _ = run_cell(shell, "import torch\nraise torch.OutOfMemoryError('out of memory')")
        assert "Out of memory on" not in out
    finally:
        shell.run_line_magic("load_ext", "gpumagic")
    _, out, _ = run_cell(shell, "raise torch.OutOfMemoryError('out of memory')")
    assert out.count("Out of memory on cpu") == 1
