"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2-style without bias) over a paged KV cache.

Parameter names match Hugging Face's ``LlamaForCausalLM`` so a checkpoint's
safetensors load directly. Tokens of all sequences in a step are packed into
one ``[T]`` batch (varlen); only attention looks at sequence boundaries,
through ``kernels.attention.AttentionMetadata``. The math follows
``transformers``' modeling_llama (fp32 RMSNorm, rotate-half RoPE) so greedy
outputs match it token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels.attention import AttentionMetadata, paged_attention, store_kvcache
from deepinfer.models.config import ModelConfig


class Linear(nn.Linear):
    """``nn.Linear`` computed as ``(W @ x^T)^T`` for several rows.

    NOTE: on CPU MKL this orientation is 1.5-2x faster for the skinny
    activations of decode (M = 2-64 rows against weights read from DRAM);
    for one row, and for prefill-sized M, plain ``linear`` is faster.
    """

    SKINNY_MAX_ROWS = 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not 1 < x.shape[0] <= self.SKINNY_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = (self.weight @ x.t()).t()
        return (y + self.bias if self.bias is not None else y).contiguous()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig, device="cpu") -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 (types: default, linear, llama3).

    Raises NotImplementedError for other ``rope_type`` s.
    """
    p = cfg.rope_parameters
    d = cfg.head_dim
    inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    kind = p.get("rope_type", "default")
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / p["factor"]
    if kind == "llama3":  # piecewise scaling of long wavelengths (Llama 3.1)
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(is_mid, mid, scaled)
    raise NotImplementedError(f"rope_type {kind!r} not supported")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, self.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=cfg.attention_bias)
        # Set by the model runner: this layer's views into the KV cache.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T] int64, positions [T] int64, meta, logits_index [B] int64) -> logits [B, V] float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_rope()

    def init_rope(self, device: torch.device | str = "cpu") -> None:
        """(Re)build the cos/sin tables [max_position_embeddings, head_dim] float32 on ``device``."""
        pos = torch.arange(self.config.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, rope_inv_freq(self.config, device))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata, logits_index):
        x = self.model.embed_tokens(input_ids)
        cos = self.cos_cache[positions].to(x.dtype)[:, None, :]
        sin = self.sin_cache[positions].to(x.dtype)[:, None, :]
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta)
        x = self.model.norm(x[logits_index])
        return self.lm_head(x).float()
