"""Sphinx configuration for jaxcomm's documentation (built with -W in CI)."""

project = "jaxcomm"
author = "the jaxcomm developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"
html_theme = "alabaster"
myst_heading_anchors = 3
