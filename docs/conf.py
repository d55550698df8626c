"""Sphinx configuration: MyST pages and notebooks (myst-nb), the furo theme, gpumagic's own directives.

Built by ``bash scripts/docs.sh`` into ``docs/_build/html``, warnings as errors.
The how-to pages' ``{code-cell}`` blocks run at build time, on the CPU, in a
fresh kernel per page; the example notebooks (``examples/`` linked under
``docs/examples/``) are shown with the outputs stored in them, not run again.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))   # the checkout's gpumagic, for autodoc and the {magic} directive

project = "gpumagic"
author = "the gpumagic authors"
copyright = "gpumagic authors"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "magicdoc",
]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints", "examples/*.executed.ipynb"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4
smartquotes = False   # "--flag" stays two hyphens, 'cpu' straight quotes, as typed in a notebook

# The how-to pages run; the example notebooks keep the outputs they were saved with.
nb_execution_mode = "cache"
nb_execution_cache_path = str(HERE / "_build" / ".jupyter_cache")
nb_execution_excludepatterns = ["examples/*"]
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
napoleon_numpy_docstring = True
napoleon_google_docstring = False

html_theme = "furo"
html_title = "gpumagic"
html_static_path = ["_static"]
html_css_files = ["gpumagic.css"]
