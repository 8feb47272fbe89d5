"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

Source: ``transformers`` modeling_gemma3 / configuration_gemma3; Gemma Team,
"Gemma 3 Technical Report" (2025). Differences from Llama, all here:

* local/global attention: ``layer_types`` interleaves ``sliding_attention``
  layers (window ``sliding_window``) with ``full_attention`` ones (default
  pattern: every 6th layer global), each type with its own RoPE base
  (``rope_local_base_freq`` 10k local, ``rope_theta`` 1M global);
* ``(1 + weight)`` RMSNorm computed in fp32 (``GemmaRMSNorm``), also on q and k
  per head before RoPE; four norms per layer (pre/post attention, pre/post MLP);
* embeddings scaled by ``sqrt(hidden_size)``; GELU-tanh gated MLP;
* attention scale ``query_pre_attn_scalar ** -0.5``;
* optional final logit soft-capping ``cap * tanh(logits / cap)``.

Attention-logit soft-capping (Gemma 2) and bidirectional attention
(EmbeddingGemma) are refused with NotImplementedError.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.config import ModelConfig
from deepinfer.models.decoder import CausalLM
from deepinfer.models.layers import Attention, GatedMLP, GemmaRMSNorm, embed_scale


def gemma3_layer_types(raw: dict) -> list[str]:
    """Per-layer attention type; old configs give only ``sliding_window_pattern`` (default 6)."""
    if raw.get("layer_types"):
        return raw["layer_types"]
    pattern = raw.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(raw["num_hidden_layers"])]


def gemma3_rope_parameters(raw: dict) -> dict[str, dict]:
    """{"sliding_attention": {...}, "full_attention": {...}} from a 5.x or 4.x-style config."""
    rp = raw.get("rope_parameters") or {}
    if "full_attention" in rp:
        return {k: dict(v) for k, v in rp.items()}
    full = dict(raw.get("rope_scaling") or {})
    full.setdefault("rope_type", full.pop("type", "default"))
    full["rope_theta"] = raw.get("rope_theta", 1_000_000.0)
    return {"full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10_000.0)}}


class Gemma3DecoderLayer(nn.Module):
    """``x + post_attn_norm(attn(input_norm(x)))``, then ``x + post_ff_norm(mlp(pre_ff_norm(x)))``."""

    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        raw, h, eps = cfg.raw, cfg.hidden_size, cfg.rms_norm_eps
        window = raw.get("sliding_window") if layer_type == "sliding_attention" else None
        self.self_attn = Attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=GemmaRMSNorm,
                                   eps=eps, scale=raw.get("query_pre_attn_scalar", 256) ** -0.5,
                                   sliding_window=window, rope=layer_type)
        self.mlp = GatedMLP(h, cfg.intermediate_size, raw.get("hidden_activation", "gelu_pytorch_tanh"))
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, cos, sin, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(CausalLM):
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig):
        raw = cfg.raw
        if raw.get("attn_logit_softcapping") is not None:
            raise NotImplementedError("attention logit soft-capping")
        if raw.get("use_bidirectional_attention"):
            raise NotImplementedError("bidirectional attention")
        self.layer_types = gemma3_layer_types(raw)
        super().__init__(cfg)
        self.final_logit_softcapping = raw.get("final_logit_softcapping")

    def make_layer(self, cfg: ModelConfig, i: int) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(cfg, self.layer_types[i])

    def rope_parameters(self) -> dict[str, dict]:
        return gemma3_rope_parameters(self.config.raw)

    def init_buffers(self, device: torch.device | str = "cpu") -> None:
        """RoPE tables per layer type, and the embedding scale (a non-persistent buffer, like HF's)."""
        super().init_buffers(device)
        self.register_buffer("embed_scale", embed_scale(self.config.hidden_size, device), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight
        return self.model.embed_tokens(input_ids) * self.embed_scale.to(w.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x)
        if (cap := self.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
