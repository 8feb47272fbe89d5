"""Qwen3 dense (``Qwen3ForCausalLM``): Llama plus a per-head RMSNorm on q and k before RoPE.

Source: ``transformers`` modeling_qwen3 (Qwen3Attention: ``q_norm`` / ``k_norm``
over head_dim, Llama-style RMSNorm; no q/k/v bias by default). Optional
sliding windows follow the config's ``layer_types``.
"""

from __future__ import annotations

from deepinfer.models.config import ModelConfig
from deepinfer.models.decoder import CausalLM
from deepinfer.models.layers import Attention, DecoderLayer, GatedMLP, RMSNorm, layer_window


def qwen3_attention(cfg: ModelConfig, i: int) -> Attention:
    """Qwen3 / Qwen3-MoE attention of layer ``i``."""
    return Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=RMSNorm,
                     eps=cfg.rms_norm_eps, sliding_window=layer_window(cfg.raw, i))


class Qwen3ForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, i: int) -> DecoderLayer:
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.raw.get("hidden_act", "silu"))
        return DecoderLayer(qwen3_attention(cfg, i), mlp, cfg.hidden_size, cfg.rms_norm_eps)
