"""Compiling a magic's cell (gpumagic.cell.compile): what a magic cannot run is refused clearly."""
from __future__ import annotations

import ast
import types

import IPython
import pytest
from IPython.core.error import UsageError

from gpumagic.cell.compile import cell_label, compile_plain, is_cell, refuse_top_level_await, register_source
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


def test_cells_are_labelled_as_the_running_shell_numbered_them(shell):
    result, _, _ = run_cell(shell, "def f():\n    return 1")
    name = shell.user_ns["f"].__code__.co_filename
    assert cell_label(name) == f"Cell In[{result.execution_count}]" and is_cell(name)
    assert cell_label(__file__) is None and not is_cell(__file__)


def test_a_kernels_cell_names_come_from_its_compiler(monkeypatch):
    from ipykernel.compiler import XCachingCompiler
    compiler = XCachingCompiler()
    name = compiler.cache("x = 1\n", number=42)          # /tmp/ipykernel_<pid>/<hash>.py
    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(compile=compiler))
    assert "ipykernel_" in name and cell_label(name) == "Cell In[42]" and is_cell(name)
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)   # a worker: no shell, so no number
    assert cell_label(name) is None and not is_cell(name)
    register_source(name, "x = 1\n")                      # ... but the cell it was sent is a cell
    assert is_cell(name) and cell_label("<ipython-input-7-0abc>") == "Cell In[7]"
    assert is_cell(compile_plain("y = 2\n").filename)


def test_a_cell_that_starts_with_blank_lines_keeps_its_line_numbers(shell):
    import traceback

    from gpumagic.cell.compile import compile_cell, run_compiled
    cell = "\n\nx = 1\nraise ValueError(x)\n"
    compiled = compile_cell(shell, cell, header="%%ondevice cpu")
    with pytest.raises(ValueError) as err:
        run_compiled(compiled, {})
    frame = traceback.extract_tb(err.value.__traceback__)[-1]
    # The notebook's numbering: the magic's line is 1, two blank lines, x = 1 is 4, the raise 5.
    assert frame.lineno == 5 and frame.line == "raise ValueError(x)"
