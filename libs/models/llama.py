"""Llama family (Llama 2/3, SmolLM2, Mistral) over the paged KV cache.

Parameter names match Hugging Face's ``LlamaForCausalLM`` so a checkpoint's
safetensors load directly. The math follows ``transformers``' modeling_llama
(fp32 RMSNorm, rotate-half RoPE) so greedy outputs match it token for token.
Shared layers live in ``layers.py``; the skeleton in ``decoder.py``.
"""

from __future__ import annotations

from deepinfer.models.config import ModelConfig
from deepinfer.models.decoder import CausalLM
from deepinfer.models.layers import Attention, DecoderLayer, GatedMLP, layer_window


class LlamaForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, i: int) -> DecoderLayer:
        attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                         sliding_window=layer_window(cfg.raw, i))
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.raw.get("hidden_act", "silu"), cfg.mlp_bias)
        return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps)
