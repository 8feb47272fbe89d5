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

ROOT = Path(__file__).resolve().parents[2]


def test_no_repo_root_package_has_the_name_of_an_installed_top_level_package():
    root_packages = {d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file()}
    installed = set(importlib.metadata.packages_distributions())
    assert not root_packages & installed, (
        f"repo-root packages {sorted(root_packages & installed)} shadow installed ones")


def test_no_test_folder_has_the_name_of_an_installed_top_level_package():
    """tests/ is on sys.path while the suite runs (tests/conftest.py), so a folder of it would be found as a
    namespace package by a library probing for an optional package of that name (``find_spec``)."""
    folders = {d.name for d in (ROOT / "tests").iterdir() if d.is_dir() and d.name[0] not in "._"}
    installed = set(importlib.metadata.packages_distributions())
    assert folders and not folders & installed, f"test folders {sorted(folders & installed)} shadow installed ones"


def test_transformers_and_the_kernels_import_from_the_repo_root():
    out = subprocess.run(
        [sys.executable, "-c",
         "import transformers.activations, deepinfer.kernels.attention, deepinfer.kernels.select"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def _imports(path: Path) -> set[str]:
    """Every module a Python file imports by name (absolute ``import`` and ``from`` statements)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


SERVICES = ("gateway", "tokenizer", "prefill", "decode", "vision", "kvindex", "balancer")


def test_engine_workers_move_kv_only_through_their_engines_connector():
    """services/prefill and services/decode name no engine backend and hold no tensor code: KV goes to and
    from the storage tier through ``engine.kv_connector`` whatever the engine."""
    for name in ("prefill", "decode"):
        for path in (ROOT / "services" / name).glob("*.py"):
            text = path.read_text()
            assert "engine_kind" not in text and '"vllm"' not in text, f"{path} branches on the engine"
            assert not {m for m in _imports(path) if m == "torch" or m.startswith("torch.")}, f"{path} imports torch"


def test_libs_never_import_the_services():
    """Data flows one way: the libraries (libs/, the ``deepinfer`` package's own modules) never import
    a service package (services/<name>, installed as ``deepinfer.<name>``)."""
    banned = {f"deepinfer.{s}" for s in SERVICES}
    for path in (ROOT / "libs").rglob("*.py"):
        bad = {m for m in _imports(path) if m in banned or any(m.startswith(b + ".") for b in banned)}
        assert not bad, f"{path} imports {sorted(bad)}"
