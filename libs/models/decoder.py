"""The decoder-only skeleton every family fills in: embeddings, a stack of layers, final norm, LM head.

Module names follow Hugging Face's ``*ForCausalLM`` (``model.embed_tokens``,
``model.layers.N``, ``model.norm``, ``lm_head``) so checkpoints load by name.
A family subclasses ``CausalLM`` and overrides ``make_layer`` (and, where it
differs from Llama, ``rope_parameters``, ``embed`` or ``logits``)::

    input_ids [T] ──embed──> x [T, hidden] ──layers (RoPE table per layer.self_attn.rope)──>
        x[logits_index] [B, hidden] ──norm──> lm_head ──logits──> [B, vocab] float32

The engine's contract: ``config`` (a ``ModelConfig``), ``attention_layers``
(one ``Attention`` per KV-cache layer, in order), ``init_buffers(device)``
(the loader calls it after loading weights onto ``device``: non-persistent
buffers such as RoPE tables are not in checkpoints), and ``forward``.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.attention import AttentionMetadata
from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import Attention, Linear, RMSNorm, rope_frequencies, rope_tables


class DecoderModel(nn.Module):
    """Holds the parameters under HF's ``model.`` prefix."""

    def __init__(self, embed_tokens: nn.Module, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    """forward(input_ids [T] int64, positions [T] int64, meta, logits_index [B] int64) -> logits [B, V] float32.

    ``num_layers`` (default all) runs only the first layers, then the final norm and
    head: the self-draft of speculative decoding (``engine.spec_decode``, early exit as
    in LayerSkip / Draft & Verify).

    ``input_embeds_override`` (multimodal, e.g. LLaVA image features): ``(rows [K] int64,
    embeds [K, hidden])``; row ``rows[i]`` of the packed step (an index into ``input_ids``)
    takes ``embeds[i]`` instead of its token embedding, before layer 0.

    ``hidden_index`` [H] int64 (prompt logprobs): also return the final normed hidden states
    at those packed rows, ``(logits [B, V] float32, hidden [H, hidden])``; the caller turns them
    into logits with ``logits`` a slice at a time (H x V float32 at once could be gigabytes).
    """

    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(
            # (an empty weight: the checkpoint's replaces it; nn.Embedding's own random init would
            # import torch._dynamo, ~1.3 s of every engine's start-up)
            nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)),
            [self.make_layer(cfg, i) for i in range(cfg.num_hidden_layers)],
            self.norm_class(cfg.hidden_size, cfg.rms_norm_eps),
        )
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_buffers()

    # --- what a family decides -------------------------------------------------
    def make_layer(self, cfg: ModelConfig, i: int) -> nn.Module:
        """Decoder layer ``i``: forward(x, cos, sin, meta) -> x, with a ``self_attn: Attention``."""
        raise NotImplementedError

    def rope_parameters(self) -> dict[str, dict]:
        """RoPE table name -> HF ``rope_parameters`` dict; layers pick one by ``self_attn.rope``."""
        return {"default": self.config.rope_parameters}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, hidden] (already normed) -> logits [B, V] float32."""
        return self.lm_head(x).float()

    # --- shared -----------------------------------------------------------------
    def init_buffers(self, device: torch.device | str = "cpu") -> None:
        """(Re)build non-persistent buffers on ``device``: cos/sin tables
        [max_position_embeddings, head_dim] float32 per RoPE table, and those of
        submodules that define ``init_buffers`` (e.g. MoE counters)."""
        for name, params in self.rope_parameters().items():
            inv, attention_factor = rope_frequencies(params, self.config.head_dim, device)
            cos, sin = rope_tables(inv, self.config.max_position_embeddings, attention_factor)
            self.register_buffer(f"cos_{name}", cos, persistent=False)
            self.register_buffer(f"sin_{name}", sin, persistent=False)
        for m in self.modules():
            if m is not self and hasattr(m, "init_buffers"):
                m.init_buffers(device)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata, logits_index, num_layers: int | None = None,
                input_embeds_override: tuple[torch.Tensor, torch.Tensor] | None = None,
                hidden_index: torch.Tensor | None = None):
        x = self.embed(input_ids)
        if input_embeds_override is not None:
            rows, embeds = input_embeds_override
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        rope = {}
        for layer in self.model.layers[:num_layers]:
            name = layer.self_attn.rope
            if name not in rope:
                cos = getattr(self, f"cos_{name}")[positions].to(x.dtype)[:, None, :]
                sin = getattr(self, f"sin_{name}")[positions].to(x.dtype)[:, None, :]
                rope[name] = cos, sin
            x = layer(x, *rope[name], meta)
        logits = self.logits(self.model.norm(x[logits_index]))
        if hidden_index is None:
            return logits
        return logits, self.model.norm(x[hidden_index])
