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
RUN = Path(__file__).with_name("vllm_run.py")
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


def run_engine(model: Path, prompts: list[list[int]], max_tokens: int, kv_root: Path | None, tmp: Path) -> dict:
    """Run ``vllm_run.py`` (a fresh vLLM engine) in its own process on token-id prompts, greedy.

    Returns its JSON line: ``outputs`` (``token_ids``, ``num_cached_tokens`` per prompt) and the
    connector's ``connector`` counters ({} without ``kv_root``). Raises AssertionError with the
    process's stderr tail when it fails.
    """
    path = tmp / f"prompts-{os.getpid()}-{len(list(tmp.iterdir()))}.json"
    path.write_text(json.dumps(prompts))
    cmd = [sys.executable, str(RUN), "--model", str(model), "--prompts", str(path), "--max-tokens", str(max_tokens)]
    if kv_root is not None:
        cmd += ["--kv-root", str(kv_root)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    assert p.returncode == 0, f"vllm_run.py failed ({p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])
