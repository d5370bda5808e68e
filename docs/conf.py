"""Sphinx configuration for torchpipe's documentation (``make docs`` builds it with warnings as errors)."""
import importlib.util
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from torchpipe.__version__ import __version__  # noqa: E402

project = "torchpipe"
author = "the torchpipe authors"
copyright = "the torchpipe authors"
version = release = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Offline by default (CI has no internet); set TORCHPIPE_DOCS_INTERSPHINX=1 to link to PyTorch's docs.
intersphinx_mapping = (
    {"python": ("https://docs.python.org/3", None), "torch": ("https://pytorch.org/docs/stable", None)}
    if os.environ.get("TORCHPIPE_DOCS_INTERSPHINX")
    else {}
)
# Type hints name PyTorch and typing classes that have no page in this site.
nitpicky = False

html_theme = "furo" if importlib.util.find_spec("furo") else "alabaster"
html_title = f"torchpipe {version}"
