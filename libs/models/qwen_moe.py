"""Qwen2-MoE (``Qwen2MoeForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``).

Source: ``transformers`` modeling_qwen2_moe, modeling_qwen3_moe. Both are the
Llama block with the MLP replaced by ``moe.SparseMoeBlock`` on every
``decoder_sparse_step``-th layer not in ``mlp_only_layers`` (others keep a
dense SwiGLU MLP of ``intermediate_size``). Qwen2-MoE: q/k/v bias
(``qkv_bias``), a shared expert behind a sigmoid gate. Qwen3-MoE: Qwen3
attention (per-head q/k RMSNorm), no shared expert.
"""

from __future__ import annotations

from torch import nn

from deepinfer.models.config import ModelConfig
from deepinfer.models.decoder import CausalLM
from deepinfer.models.layers import Attention, DecoderLayer, GatedMLP, layer_window
from deepinfer.models.moe import MoECounters, SparseMoeBlock
from deepinfer.models.qwen3 import qwen3_attention


def moe_mlp(cfg: ModelConfig, i: int, shared: bool) -> nn.Module:
    """Layer ``i``'s MLP: a SparseMoeBlock or, on dense layers, a GatedMLP."""
    raw = cfg.raw
    num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    act = raw.get("hidden_act", "silu")
    sparse = (i not in raw.get("mlp_only_layers", []) and num_experts > 0
              and (i + 1) % raw.get("decoder_sparse_step", 1) == 0)
    if not sparse:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, act)
    return SparseMoeBlock(cfg.hidden_size, raw["moe_intermediate_size"], num_experts, raw["num_experts_per_tok"],
                          raw.get("norm_topk_prob", False), act,
                          shared_intermediate=raw.get("shared_expert_intermediate_size", 0) if shared else 0)


class Qwen2MoeForCausalLM(MoECounters, CausalLM):
    def make_layer(self, cfg: ModelConfig, i: int) -> DecoderLayer:
        attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         qkv_bias=cfg.raw.get("qkv_bias", True), sliding_window=layer_window(cfg.raw, i))
        return DecoderLayer(attn, moe_mlp(cfg, i, shared=True), cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(MoECounters, CausalLM):
    def make_layer(self, cfg: ModelConfig, i: int) -> DecoderLayer:
        return DecoderLayer(qwen3_attention(cfg, i), moe_mlp(cfg, i, shared=False), cfg.hidden_size, cfg.rms_norm_eps)
