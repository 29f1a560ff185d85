"""Sphinx configuration of the hvd_plugins documentation.

Build the HTML with ``sphinx-build docs docs/_build/html`` (the test suite builds it with ``-W``, so a
warning fails it). The API pages import the package: build in an environment where ``hvd_plugins`` and
Lightning import.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hvd_plugins  # noqa: E402  (after the path above, so the checkout is documented)

project = "hvd_plugins"
author = "hvd_plugins contributors"
copyright = "2026, hvd_plugins contributors"
version = release = hvd_plugins.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build"]
templates_path: list[str] = []

# Google-style docstrings ("Args:"); the package has no NumPy-style ones.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"exclude-members": "__init__, __new__"}

html_theme = "furo"
html_title = f"hvd_plugins {release}"
html_static_path = ["_static"]
html_css_files = ["reports.css"]
pygments_style = "sphinx"
