"""Fixtures of the vLLM backend's tests (run in .venv-vllm: ``bash scripts/setup_vllm.sh``, then
``.venv-vllm/bin/python -m pytest tests_vllm``). Kept apart from tests/ so the main suite never imports vllm."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 600  # one engine process: start (5-50 s here) + generation


def pytest_configure(config):
    if importlib.util.find_spec("vllm") is None:
        pytest.exit("vllm is not installed in this environment: build .venv-vllm with "
                    "`bash scripts/setup_vllm.sh` and run `.venv-vllm/bin/python -m pytest tests_vllm`", 2)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face directory (converted once from its GGUF)."""
    from deepinfer.models.convert import ensure_default_model

    return ensure_default_model(progress=False)


def run_json(script: str, args: list[str]) -> dict:
    """Run ``tests_vllm/<script>`` (a fresh vLLM engine) in its own process; returns its last stdout
    line as JSON. Raises AssertionError with the process's stderr tail when it fails."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, str(HERE / script), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=ENGINE_TIMEOUT_S)
    assert p.returncode == 0, f"{script} failed ({p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def write_json(tmp: Path, data) -> Path:
    """``data`` as JSON in a new file under ``tmp``."""
    path = tmp / f"in-{len(list(tmp.iterdir()))}.json"
    path.write_text(json.dumps(data))
    return path


def run_engine(model: Path, prompts: list[list[int]], max_tokens: int, kv_root: Path | None, tmp: Path) -> dict:
    """``vllm_run.py`` (vLLM's ``LLM.generate``) on token-id prompts, greedy, with the storage-tier
    connector on ``kv_root`` (None: without). Returns ``outputs`` (``token_ids``,
    ``num_cached_tokens`` per prompt) and the connector's ``connector`` counters ({} without)."""
    args = ["--model", str(model), "--prompts", str(write_json(tmp, prompts)), "--max-tokens", str(max_tokens)]
    return run_json("vllm_run.py", args + (["--kv-root", str(kv_root)] if kv_root is not None else []))
