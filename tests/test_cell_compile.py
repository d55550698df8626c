"""Compiling a magic's cell (gpumagic.cell.compile): what a magic cannot run is refused clearly."""
from __future__ import annotations

import ast

import pytest
from IPython.core.error import UsageError

from gpumagic.cell.compile import compile_plain, refuse_top_level_await
from tests.conftest import run_cell


@pytest.mark.parametrize("source, line", [
    ("x = 1\nawait asyncio.sleep(0)\n", 2),
    ("async for item in stream:\n    pass\n", 1),
    ("async with lock:\n    pass\n", 1),
    ("if True:\n    y = [x async for x in stream]\n", 2),
])
def test_top_level_await_is_refused_with_its_line(source, line):
    with pytest.raises(UsageError, match=f"line {line}: top-level await is not supported under %%ondevice"):
        refuse_top_level_await(ast.parse(source), "%%ondevice cpu")


def test_await_inside_functions_is_fine():
    refuse_top_level_await(ast.parse("async def f():\n    await g()\nh = lambda: 1\n"))
    compiled = compile_plain("async def f():\n    return 3\nimport asyncio\nasyncio.run(f())\n")
    ns: dict = {}
    exec(compiled.body, ns)
    assert eval(compiled.last_expr, ns) == 3


@pytest.mark.parametrize("magic", ["%%ondevice cpu", "%%dataparallel --devices cpu --nprocs 2",
                                   "%%dataparallel --strategy dp", "%%sharedtrain --nprocs 2"])
def test_every_magic_refuses_top_level_await_before_running_anything(shell, magic):
    run_cell(shell, "import asyncio, torch\nmodel = torch.nn.Linear(2, 1)\nran = False")
    result, out, _ = run_cell(shell, f"{magic}\nran = True\nawait asyncio.sleep(0)\nmodel(torch.ones(1, 2))\n")
    assert isinstance(result.error_in_exec, UsageError), out
    assert f"line 3: top-level await is not supported under {magic.split()[0]}" in str(result.error_in_exec)
    assert shell.user_ns["ran"] is False
