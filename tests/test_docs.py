"""The documentation cannot drift from the code.

* every magic has a page whose options table is rendered from the magic's own
  parser (the ``{magic}`` directive, ``docs/_ext``), and that rendering lists
  every argument, argument groups included;
* no page, nor README, names an option that no magic has: a ``%magic --flag``
  anywhere, or a `` `--flag` `` in the text (a magic's own page: that magic's);
* Python code on a page is a ``{code-cell}`` (run when the site is built, on the
  CPU) or inside a ``{needs-gpu}`` block (shown as not run);
* README stays short, keeps its two commands and links every magic's page, and
  its quickstart runs as written, here on the CPU;
* the example notebooks tell a reader facts instead of asserting them, and
  nbval compares every such fact (a ``False`` would fail ``pytest examples``).

The site itself is built with warnings as errors by ``bash scripts/docs.sh``
(CI: ``scripts/test.sh --docs``); these tests need no Sphinx.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager
from IPython.core.magic_arguments import argument, argument_group, magic_arguments

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

from magic_options import flags, magic_names, parser_options  # noqa: E402

# Flags of other programs that the pages mention, and where each is checked to exist.
SCRIPT_FLAGS = {"--browser", "--lint", "--fresh", "--docs", "--clean"}   # scripts/*.sh
BENCHMARK_FLAGS = {"--quick": "benchmarks/frameworks.py"}
DOCKER_FLAGS = {"--shm-size", "--ipc"}                                   # docker run's
PYTHON_FENCES = {"", "python", "py", "ipython", "ipython3"}


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _names_flag(token: str) -> str | None:
    match = re.match(r"-{1,2}[A-Za-z][\w-]*", token)
    return match.group(0) if match else None


def _paragraph(text: str, at: int) -> str:
    start = text.rfind("\n\n", 0, at)
    end = text.find("\n\n", at)
    return text[start + 1:end if end >= 0 else len(text)]


def unknown_options(text: str, page_magic: str | None = None) -> list[str]:
    """What ``text`` (a page's Markdown) names that no magic takes; ``page_magic``: the magic the page is about."""
    names = magic_names()
    magic_flags = {name: flags(name) for name in names}
    every = set().union(*magic_flags.values())
    problems = []
    # `%gpumem --vars`, `%%dataparallel --strategy fsdp`, `%dataparallel cluster start --engines slurm -n 8`
    for match in re.finditer(r"%%?(" + "|".join(names) + r")(?![\w'])([^`\n]*)", text):
        magic, rest = match.group(1), match.group(2).split(" #")[0]
        for token in rest.split():
            flag = _names_flag(token) if token.startswith("-") else None
            if flag and flag not in magic_flags[magic]:
                problems.append(f"%{magic} has no {flag}: {match.group(0).strip()!r}")
    # `--flag ...` in the text
    for match in re.finditer(r"(?<!`)`(-{1,2}[A-Za-z][^`\n]*)`(?!`)", text):
        flag = _names_flag(match.group(1))
        if flag in SCRIPT_FLAGS or flag in BENCHMARK_FLAGS or flag in DOCKER_FLAGS:
            continue
        if flag not in every:
            problems.append(f"no magic has {flag}: `{match.group(1)}`")
        elif page_magic and flag not in magic_flags[page_magic]:
            # another magic's option, fine where the paragraph names that magic
            owners = [m for m in names if flag in magic_flags[m]]
            if not any(re.search(rf"%%?{m}\b", _paragraph(text, match.start())) for m in owners):
                problems.append(f"%{page_magic} has no {flag} (it is {', '.join(owners)}'s): `{match.group(1)}`")
    return problems


def unmarked_code(text: str) -> list[str]:
    """Python fences in ``text`` that are neither ``{code-cell}`` nor inside a ``{needs-gpu}`` block."""
    problems, stack = [], []
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*(`{3,}|~{3,})\s*(.*?)\s*$", line)
        if not fence:
            continue
        marks, info = fence.groups()
        if stack and not info and marks[0] == stack[-1][0][0] and len(marks) >= len(stack[-1][0]):
            stack.pop()
            continue
        stack.append((marks, info))
        language = info.split()[0] if info else ""
        if language in PYTHON_FENCES and not any(i.startswith("{needs-gpu}") for _m, i in stack[:-1]):
            problems.append(f"line {number}: ```{info} is neither a {{code-cell}} nor inside {{needs-gpu}}")
    return problems


# --------------------------------------------------------------------------- the options tables

def test_every_magic_has_a_page_whose_options_table_comes_from_its_parser():
    for name in magic_names():
        page = DOCS / "magics" / f"{name}.md"
        assert page.exists(), f"%{name} has no page ({page.relative_to(ROOT)})"
        assert re.search(rf"^```{{magic}} {name}$", page.read_text(), re.M), f"{page.name} lacks ```{{magic}} {name}"


def test_the_rendered_tables_hold_every_argument_of_each_parser():
    from magic_options import magic_function
    for name in magic_names():
        parser = magic_function(name)[1].parser
        expected = {s for a in parser._actions if a.dest != "help" for s in (a.option_strings or [a.dest])}
        rendered = {n for group in parser_options(parser) for option in group.options for n in option.names}
        assert rendered == expected, name
    assert {"--strategy", "--nprocs", "-n", "--cluster"} <= flags("dataparallel")


def test_argument_groups_get_a_table_each_with_their_title():
    @magic_arguments()
    @argument("--plain", help="a plain option, 100%% of it")
    @argument_group("fsdp", "for --strategy fsdp")
    @argument("--wrap", metavar="CLASS", help="the units")
    def fake(self, line):
        """A magic of the test."""

    groups = parser_options(fake.parser)
    assert [(g.title, [o.names for o in g.options]) for g in groups] == [
        ("options", [["--plain"]]), ("fsdp", [["--wrap"]])]
    assert groups[1].description == "for --strategy fsdp"
    assert groups[0].options[0].help == "a plain option, 100% of it"   # as %magic? prints it
    assert groups[1].options[0].shown == "--wrap CLASS"


# --------------------------------------------------------------------------- options named on the pages

@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_pages_name_only_options_that_exist(page):
    magic = page.stem if page.parent.name == "magics" else None
    assert unknown_options(page.read_text(), magic) == []


def test_readme_names_only_options_that_exist():
    assert unknown_options((ROOT / "README.md").read_text()) == []


def test_an_option_that_no_longer_exists_is_found():
    text = ("Use `%gpumem --vars` or `%gpumem --leaks`.\n\n`--watch`: gauges. `--nonesuch`: gone.\n\n"
            "%%dataparallel --strategy fsdp --shard-grads\n\n`--nprocs N` starts N workers.\n")
    assert unknown_options(text) == [
        "%gpumem has no --leaks: '%gpumem --leaks'",
        "%dataparallel has no --shard-grads: '%%dataparallel --strategy fsdp --shard-grads'",
        "no magic has --nonesuch: `--nonesuch`",
    ]
    # on %gpumem's own page, another magic's option needs that magic named beside it
    assert unknown_options(text, "gpumem")[-1] == (
        "%gpumem has no --nprocs (it is dataparallel, sharedtrain's): `--nprocs N`")
    assert unknown_options("`%%sharedtrain` takes `--nprocs N`.", "gpumem") == []


def test_other_programs_flags_the_pages_name_exist_there():
    scripts = "".join(p.read_text() for p in (ROOT / "scripts").glob("*.sh"))
    for flag in SCRIPT_FLAGS:
        assert f"{flag})" in scripts, f"no script takes {flag}"
    for flag, path in BENCHMARK_FLAGS.items():
        assert flag in (ROOT / path).read_text(), f"{path} takes no {flag}"


# --------------------------------------------------------------------------- code on the pages

@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_python_on_a_page_runs_when_the_site_is_built_or_is_marked_as_needing_a_gpu(page):
    text = page.read_text()
    assert unmarked_code(text) == []
    if "```{code-cell}" in text:   # run only in a page myst-nb reads as a notebook
        assert text.startswith("---\nfile_format: mystnb\n"), f"{page.name} runs no cell without mystnb front matter"


def test_unmarked_python_is_found():
    text = ("```python\nx = 1\n```\n\n````{needs-gpu}\n```python\ny = 2\n```\n````\n\n"
            "```{code-cell} ipython3\nz = 3\n```\n\n```\nbare\n```\n\n```bash\nls\n```\n")
    assert unmarked_code(text) == [
        "line 1: ```python is neither a {code-cell} nor inside {needs-gpu}",
        "line 15: ``` is neither a {code-cell} nor inside {needs-gpu}",
    ]


# --------------------------------------------------------------------------- README

README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_keeps_its_two_commands():
    assert len(README.splitlines()) <= 160
    assert "bash scripts/examples.sh     # the main job: every example notebook, headless; prints what ran\n" in README
    assert "bash scripts/test.sh         # the whole test suite\n" in README
    assert "bash scripts/docs.sh" in README
    assert "docs/_static/picker-and-gauges.png" in README


def test_readme_links_each_magic_to_its_page():
    for name in magic_names():
        link = f"docs/magics/{name}.md"
        assert f"]({link})" in README, f"README does not link %{name}'s page"
        assert (ROOT / link).exists()
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).exists(), link


def _quickstart() -> list[str]:
    section = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_quickstart_has_five_cells_and_runs_as_written():
    from notebook_helpers import run_notebook, stream_text
    cells = _quickstart()
    assert len(cells) == 5
    check = ("print('trained:', not torch.equal(model.weight, before), "
             "'| a is on the picked device:', a.device == gpumagic.current_device())\n%gpumem --stop")
    nb = run_notebook([cells[0] + "\nimport gpumagic", *cells[1:4],
                       "before = model.weight.detach().clone()", cells[4], check], timeout=240)
    errors = [o for c in nb.cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert stream_text(nb.cells[-1]).startswith("trained: True | a is on the picked device: True\n")


# --------------------------------------------------------------------------- the example notebooks

NOTEBOOKS = sorted((ROOT / "examples").glob("0*.ipynb"))
NOTEBOOKS = [p for p in NOTEBOOKS if not p.name.endswith(".executed.ipynb")]


def _python(source: str) -> ast.Module:
    return ast.parse(TransformerManager().transform_cell(source))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_example_notebooks_tell_facts_instead_of_asserting_them(path):
    notebook = json.loads(path.read_text())
    facts = 0
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        asserts = [n for n in ast.walk(_python(source)) if isinstance(n, ast.Assert)]
        assert not asserts, f"{path.name}: a reader need not see `assert` (line {asserts[0].lineno} of:\n{source})"
        text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o["output_type"] == "stream")
        said = re.findall(r":\s*(True|False)\b", text)
        if said and not source.lstrip().startswith("%"):   # (a magic's own output, a framework's log, is not a fact)
            facts += len(said)
            assert "False" not in said, f"{path.name}: a stored fact is False:\n{text}"
            tags = cell["metadata"].get("tags", [])
            assert "nbval-ignore-output" not in tags, f"{path.name}: nbval would not compare these facts:\n{text}"
    assert facts >= 2, f"{path.name} tells its reader what it showed in facts nbval compares"
