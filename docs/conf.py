"""Sphinx configuration of the tensorscope site (``make docs``: warnings are errors)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))   # this checkout's package, also when it is not installed

import tsgen  # noqa: E402

import tensorscope  # noqa: E402

# the generated pages exist before autosummary scans the sources for its directives
tsgen.generate()

project = "tensorscope"
author = "the tensorscope authors"
copyright = "the tensorscope authors"
release = version = tensorscope.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "tsgen",
]

# pages
root_doc = "index"
exclude_patterns = ["_build", "_generated", "jupyter_execute", "**.ipynb_checkpoints", "README.md"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
suppress_warnings = ["myst.header"]   # the developer notes start their sections at level 2 under a level-1 title

# MyST
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# MyST-NB: the walkthroughs execute on every build (outputs are the real summary); one that
# raises fails the build. TENSORSCOPE_DOCS_EXECUTE=off builds without running them (drafts only).
nb_execution_mode = os.environ.get("TENSORSCOPE_DOCS_EXECUTE", "force")
nb_execution_timeout = 240
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# API reference
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
add_module_names = False

napoleon_google_docstring = False
napoleon_numpy_docstring = True

# HTML
html_theme = "pydata_sphinx_theme"
html_title = f"tensorscope {release}"
html_static_path = ["_static"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_show_sourcelink = False
