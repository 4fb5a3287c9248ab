"""Sphinx configuration of the stage-runtime documentation (MyST Markdown, furo, autodoc)."""

from __future__ import annotations

import sys
from importlib.metadata import version as _version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "stage-runtime"
author = "stage-runtime developers"
copyright = "2026, stage-runtime developers"
release = _version("stage-runtime")

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "benchmark_tables",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "conftest.py"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "stage-runtime"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
smartquotes = False  # command-line flags such as --workers stay as typed
