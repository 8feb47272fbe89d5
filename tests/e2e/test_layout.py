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


SERVICES = ("gateway", "tokenizer", "prefill", "decode", "vision", "kvindex", "balancer", "engine_worker")


def test_engine_workers_move_kv_only_through_their_engines_connector():
    """No service names an engine backend, and the engine services hold no tensor code: KV goes to and
    from the storage tier through ``engine.kv_connector`` whatever the engine (``engine.interface``)."""
    for path in (ROOT / "services").rglob("*.py"):
        text = path.read_text()
        assert "engine_kind" not in text and '== "vllm"' not in text, f"{path} branches on the engine"
    for name in ("prefill", "decode", "engine_worker"):
        for path in (ROOT / "services" / name).glob("*.py"):
            assert not {m for m in _imports(path) if m == "torch" or m.startswith("torch.")}, f"{path} imports torch"


def test_libs_never_import_the_services():
    """Data flows one way: the libraries (libs/, the ``deepinfer`` package's own modules) never import
    a service package (services/<name>, installed as ``deepinfer.<name>``)."""
    banned = {f"deepinfer.{s}" for s in SERVICES}
    for path in (ROOT / "libs").rglob("*.py"):
        bad = {m for m in _imports(path) if m in banned or any(m.startswith(b + ".") for b in banned)}
        assert not bad, f"{path} imports {sorted(bad)}"


def _private_methods(path: Path, classes: set[str]) -> set[str]:
    """The ``_name`` methods the named classes of a module define."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    return {f.name for c in tree.body if isinstance(c, ast.ClassDef) and c.name in classes
            for f in c.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_") and not f.name.startswith("__")}


def test_only_the_kv_cache_manager_touches_block_manager_internals():
    """The block pools' private methods (``_take_free``, ``_release``, ...) are called only by the block
    managers themselves: the KV cache manager, the scheduler and the step loop use their public methods."""
    import ast

    engine = ROOT / "libs" / "engine"
    owners = {engine / "block_manager.py", engine / "hybrid_blocks.py"}
    private = (_private_methods(engine / "block_manager.py", {"BlockManager"})
               | _private_methods(engine / "hybrid_blocks.py", {"WindowBlockManager", "HybridBlockManager"}))
    assert {"_take_free", "_release"} <= private
    for path in [*(ROOT / "libs").rglob("*.py"), *(ROOT / "services").rglob("*.py")]:
        if path in owners:
            continue
        used = {n.attr for n in ast.walk(ast.parse(path.read_text(), str(path)))
                if isinstance(n, ast.Attribute) and n.attr in private}
        assert not used, f"{path} calls block-manager internals {sorted(used)}"


def test_the_step_loop_module_stays_small():
    """The engine's step loop (schedule -> execute -> update) is one short module; building an engine,
    sizing the KV cache and the start-up timings live beside it."""
    lines = (ROOT / "libs" / "engine" / "engine_core.py").read_text().count("\n")
    assert lines <= 280, f"engine_core.py has {lines} lines"
