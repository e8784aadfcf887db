"""Sphinx configuration of the pdwire site (``make docs``)."""

import sys
from pathlib import Path

import pdwire

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "pdwire"
release = version = pdwire.__version__
copyright = "the pdwire authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "sphinx.ext.graphviz",
    "pdwire_docs",
]
exclude_patterns = ["_build"]
source_suffix = {".md": "markdown"}
default_role = "literal"

myst_heading_anchors = 4
# spec/ is plain CommonMark: `{name}` before a code span is a placeholder there, never a role.
myst_disable_syntax = ["myst_role"]
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = f"pdwire {release}"
html_static_path = ["_static"]
html_css_files = ["pdwire.css"]
graphviz_output_format = "svg"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "exclude-members": "model_config",
}

doctest_global_setup = "import pdwire"
