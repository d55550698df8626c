"""Sphinx directives for gpumagic's pages.

``magic``: a magic's usage line, options table and docstring, read from the
same parser that ``%magic?`` prints (IPython's ``magic_arguments``), so a page
cannot list an option the code lacks or miss one it has::

    ```{magic} gpumem
    ```

``needs-gpu``: code that is not run when the site is built, in an admonition
that says so and why (it needs a GPU, or several machines)::

    ```{needs-gpu}
    ```python
    %%dataparallel --strategy fsdp
    ...
    ```
    ```

The parser is read by :mod:`magic_options`, which the tests use too.
"""
from __future__ import annotations

import inspect
import re

from docutils import nodes
from docutils.parsers.rst import Parser as RstParser
from docutils.parsers.rst import directives
from docutils.parsers.rst.directives.admonitions import BaseAdmonition
from docutils.utils import new_document
from magic_options import Group, docstring, magic_function, magic_options, usage
from sphinx.util.docutils import SphinxDirective


def _inline(text: str) -> list[nodes.Node]:
    """Help text with its `quoted` parts and the options it names (``--nprocs``) as code."""
    parts: list[nodes.Node] = []
    for i, piece in enumerate(re.split(r"`([^`]+)`|(?<![\w-])(--?[A-Za-z][\w-]*)", text)):
        if piece:
            parts.append(nodes.literal(piece, piece) if i % 3 else nodes.Text(piece))
    return parts


def _table(group: Group) -> nodes.table:
    table = nodes.table(classes=["magic-options"])
    tgroup = nodes.tgroup(cols=2)
    table += tgroup
    tgroup += nodes.colspec(colwidth=30)
    tgroup += nodes.colspec(colwidth=70)
    head = nodes.thead()
    head += nodes.row("", *[nodes.entry("", nodes.paragraph(text=t)) for t in ("option", "meaning")])
    tgroup += head
    body = nodes.tbody()
    for option in group.options:
        body += nodes.row(
            "",
            nodes.entry("", nodes.paragraph("", "", nodes.literal(option.shown, option.shown))),
            nodes.entry("", nodes.paragraph("", "", *_inline(option.help))),
        )
    tgroup += body
    return table


class MagicDirective(SphinxDirective):
    """``{magic} NAME``: usage line, options table(s) and docstring of gpumagic's magic NAME."""

    required_arguments = 1
    option_spec = {"no-docstring": directives.flag}

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0].lstrip("%")
        try:
            groups = magic_options(name)
        except ValueError as exc:
            raise self.error(str(exc)) from None
        self.env.note_dependency(inspect.getsourcefile(magic_function(name)[0]) or "")
        text = usage(name)
        out: list[nodes.Node] = [nodes.literal_block(text, text, language="text", classes=["magic-usage"])]
        for group in groups:
            if group.title != "options":
                out.append(nodes.rubric(text=group.title))
                if group.description:
                    out.append(nodes.paragraph("", "", *_inline(group.description)))
            out.append(_table(group))
        if "no-docstring" not in self.options:
            # The docstring is reStructuredText (numpydoc), whatever the page is written in.
            document = new_document(f"%{name} docstring", self.state.document.settings)
            document.reporter = self.state.document.reporter   # its warnings are Sphinx's (-W fails on them)
            RstParser().parse(docstring(name), document)
            container = nodes.container(classes=["magic-docstring"])
            container += document.children
            out.append(container)
        return out


class NeedsGpu(BaseAdmonition):
    """An admonition around code that the site's build does not run; the argument says what it needs."""

    node_class = nodes.admonition
    optional_arguments = 1
    final_argument_whitespace = True
    has_content = True

    def run(self):
        need = self.arguments[0] if self.arguments else "a GPU"
        self.arguments = [f"Needs {need}: not run when this site is built"]
        self.options.setdefault("class", ["needs-gpu"])
        return super().run()


def setup(app):
    app.add_directive("magic", MagicDirective)
    app.add_directive("needs-gpu", NeedsGpu)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
