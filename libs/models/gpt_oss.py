"""GPT-OSS (``GptOssForCausalLM``, model_type ``gpt_oss``).

Source: ``transformers`` modeling_gpt_oss; OpenAI, "gpt-oss-120b & gpt-oss-20b
Model Card" (2025). Differences from Llama:

* attention: q/k/v/o biases, a learned sink logit per head
  (``self_attn.sinks``), ``layer_types`` alternating sliding-window (128) and
  full layers; YaRN RoPE (``layers.rope_frequencies``);
* MLP: every layer is an MoE. Router ``router.{weight,bias}``: top-k of the
  logits, then softmax over those k. Experts stored fused (the on-disk names):
  ``experts.gate_up_proj`` [E, hidden, 2I] with gate/up interleaved in the
  last dim, ``experts.down_proj`` [E, I, hidden], both with biases; a clamped
  SwiGLU ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``.

Only dense checkpoints load: OpenAI's MXFP4 expert blocks (``*_blocks``,
``*_scales``) must be dequantized first (transformers does so with
``Mxfp4Config(dequantize=True)`` before ``save_pretrained``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.config import ModelConfig
from deepinfer.models.decoder import CausalLM
from deepinfer.models.layers import Attention, DecoderLayer, layer_window
from deepinfer.models.moe import MoECounters, MoEBlock


FUSED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")  # per-expert tensors, [E, ...]


class GptOssExperts(nn.Module):
    """The experts' fused weights under HF's names (a container; ``GptOssMLP.expert`` computes)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))


class GptOssMLP(MoEBlock):
    """forward(x [T, hidden]) -> [T, hidden]."""

    def __init__(self, cfg: ModelConfig):
        raw = cfg.raw
        super().__init__(raw["num_local_experts"], raw["num_experts_per_tok"])
        self.router = nn.Linear(cfg.hidden_size, self.num_experts, bias=True)
        self.experts = GptOssExperts(self.num_experts, cfg.hidden_size, cfg.intermediate_size)
        self.alpha, self.limit = raw.get("swiglu_alpha", 1.702), raw.get("swiglu_limit", 7.0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k router logits, softmax over the k."""
        top, experts = torch.topk(self.router(x), self.top_k, dim=-1)
        return F.softmax(top, dim=1, dtype=top.dtype), experts

    def expert(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        w = self.experts
        gate_up = x @ w.gate_up_proj[slot] + w.gate_up_proj_bias[slot]
        return self.expert_activation(gate_up) @ w.down_proj[slot] + w.down_proj_bias[slot]

    def expert_weights(self):
        """The fused tensors as stored: gate_up [R, hidden, 2I], down [R, I, hidden], with biases."""
        w = self.experts
        return w.gate_up_proj, w.gate_up_proj_bias, w.down_proj, w.down_proj_bias

    def expert_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Clamped SwiGLU of the interleaved gate/up columns: [n, 2I] -> [n, I]."""
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    # --- slot storage: row N of the fused tensors is slot N ---
    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return [getattr(self.experts, name)[slot] for name in FUSED]

    def resize_slots(self, num_slots: int) -> None:
        """Keep the first ``num_slots`` rows of each fused tensor; new rows are uninitialised."""
        for name in FUSED:
            old = getattr(self.experts, name)
            new = old.new_empty((num_slots, *old.shape[1:]))
            k = min(num_slots, old.shape[0])
            new[:k] = old[:k]
            setattr(self.experts, name, nn.Parameter(new, requires_grad=False))


class GptOssForCausalLM(MoECounters, CausalLM):
    def make_layer(self, cfg: ModelConfig, i: int) -> DecoderLayer:
        attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                         sliding_window=layer_window(cfg.raw, i), sinks=True)
        return DecoderLayer(attn, GptOssMLP(cfg), cfg.hidden_size, cfg.rms_norm_eps)
