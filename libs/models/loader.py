"""Build a model from a Hugging Face-format directory (config.json + *.safetensors).

Each family's modules carry Hugging Face's parameter names, so the tensors
``save_pretrained`` writes load by name: Llama/Qwen3/Gemma 3 as
``model.layers.N.{self_attn,mlp}.*``; the MoE families with one tensor per
expert (``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``, the
on-disk format transformers 5.x still writes although it fuses experts in
memory); GPT-OSS with its fused expert tensors (``mlp.experts.gate_up_proj``
[E, hidden, 2I] etc., its on-disk format). With ``tie_word_embeddings`` the checkpoint's ``lm_head.weight``
(often absent) is ignored and the head shares the embedding matrix.
A family whose checkpoints name tensors otherwise (LLaVA: ``language_model.model.*``,
``vision_tower.vision_model.*``...) defines ``checkpoint_name(key) -> our key``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from deepinfer.models.config import ModelConfig
from deepinfer.models.gemma3 import Gemma3ForCausalLM
from deepinfer.models.gpt_oss import GptOssForCausalLM
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.llava import LlavaForConditionalGeneration
from deepinfer.models.qwen3 import Qwen3ForCausalLM
from deepinfer.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

# model_type -> class. Llama-compatible families share one implementation.
MODEL_REGISTRY = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "llava": LlavaForConditionalGeneration,
}

# dtype name -> the dtype the model computes in and its KV cache holds. "bfloat16-weights": every
# parameter rounded to bf16 once at load (the values a bf16 checkpoint has), computed in fp32; the
# engine reads decode-sized steps' linear weights from bf16 copies (``Linear.keep_bf16_weight``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "bfloat16-weights": torch.float32}
ROUNDED_TO = {"bfloat16-weights": torch.bfloat16}


class UnsupportedModel(ValueError):
    """The checkpoint's model_type has no implementation here."""


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """Load ``(model, config)`` from ``model_dir``; weights cast to ``dtype`` (a ``DTYPES`` name or a
    torch dtype; "bfloat16-weights": rounded to bf16, held in fp32).

    Raises UnsupportedModel for unknown ``model_type``, FileNotFoundError when
    no safetensors file is present, KeyError when a weight is missing.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    cls = MODEL_REGISTRY.get(cfg.model_type)
    if cls is None:
        raise UnsupportedModel(f"model_type {cfg.model_type!r} not supported (have: {sorted(MODEL_REGISTRY)})")
    rounded = ROUNDED_TO.get(dtype) if isinstance(dtype, str) else None
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state = {}
    for f in files:
        state.update(load_file(f, device=device))
    if hasattr(cls, "checkpoint_name"):
        state = {cls.checkpoint_name(k): v for k, v in state.items()}
    with torch.device("meta"):
        model = cls(cfg)
    expected = {k for k in model.state_dict()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = expected - state.keys()
    if missing:
        raise KeyError(f"weights missing from {model_dir}: {sorted(missing)[:5]}")
    if rounded is not None:
        state = {k: v.to(rounded) if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict({k: v.to(dtype) for k, v in state.items() if k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_buffers(device)
    return model.eval().requires_grad_(False), cfg
