"""The repo's layout must not shadow installed packages when Python runs from the repo root.

`python -c ...` and `python -m pytest` put the working directory first on sys.path, so a
directory at the repo root with an ``__init__.py`` is imported instead of an installed package
of the same name. A top-level ``kernels/`` did exactly that to PyPI's ``kernels`` (which
transformers >= 5 imports at start-up), and every transformers import failed.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_repo_root_package_has_the_name_of_an_installed_top_level_package():
    root_packages = {d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file()}
    installed = set(importlib.metadata.packages_distributions())
    assert not root_packages & installed, (
        f"repo-root packages {sorted(root_packages & installed)} shadow installed ones")


def test_transformers_and_the_kernels_import_from_the_repo_root():
    out = subprocess.run(
        [sys.executable, "-c",
         "import transformers.activations, deepinfer.kernels.attention, deepinfer.kernels.select"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
