"""Sphinx configuration of the shmvec docs: MyST pages, autodoc, the furo theme.

Build (warnings are errors): ``sphinx-build -W -n --keep-going -b html docs docs/_build/html``.
shmvec is imported from this checkout, so build it first (``pip install -e ".[docs]"``).
torch, Ray, Stable-Baselines3 and verl are mocked when they are not installed.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "shmvec"
author = "the shmvec authors"
copyright = "the shmvec authors"
# The version is set in one place, shmvec/__init__.py; read it without importing shmvec.
release = version = re.search(
    r'^__version__ = "([^"]+)"', (ROOT / "shmvec" / "__init__.py").read_text(), re.M
).group(1)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "benchmarks/data"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_mock_imports = [
    name
    for name in ("torch", "ray", "stable_baselines3", "verl")
    if importlib.util.find_spec(name) is None
]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Types from other projects: no inventories are fetched (the build works offline), so
# references to them stay plain text instead of failing the nitpicky build.
nitpick_ignore_regex = [
    (r"py:.*", r"(gym|gymnasium|np|numpy|torch|ray|stable_baselines3|multiprocessing)(\..*)?"),
    (r"py:.*", r"(verl|asyncio|contextvars|contextlib)(\..*)?"),
    (r"py:.*", r"(collections\.abc|typing|types|pathlib)\..*"),
    (r"py:.*", r"(ArrayType|Seeds|Options|VecEnvIndices|VecEnvObs|VecEnvStepReturn|Env)"),
    (r"py:.*", r"(AutoresetMode|EnvSpec|Space|VectorEnv|VecEnv|ResultHandoff|SpanPacker)"),
    # The constructor's "Args:" entries read "name (type, default value)": napoleon hands
    # "default value" to the type field, where it is text, not a class.
    (r"py:class", r"default .*"),
]

html_theme = "furo"
html_title = f"shmvec {release}"
html_static_path: list[str] = []
pygments_style = "friendly"
pygments_dark_style = "monokai"
