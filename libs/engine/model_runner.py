"""The only place that builds tensors: KV cache, step inputs, forward, block copy in/out.

KV cache layout (all layers in one tensor)::

    kv_cache: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]

A block exported to (or imported from) the storage tier is
``kv_cache[:, :, block_id]``: [num_layers, 2, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch

from deepinfer.engine.sequence import Sequence
from deepinfer.kernels.attention import build_metadata


class ModelRunner:
    def __init__(self, model, block_size: int, num_blocks: int, dtype: torch.dtype, batch_invariant: bool = False):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.batch_invariant = batch_invariant
        self.kv_cache = torch.zeros(
            cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype
        )
        for i, attn in enumerate(model.attention_layers):
            attn.k_cache = self.kv_cache[i, 0]
            attn.v_cache = self.kv_cache[i, 1]

    @staticmethod
    def block_bytes(cfg, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one KV block (all layers, K and V)."""
        return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's ``num_scheduled_tokens`` tokens after its computed ones;
        return the logits after each sequence's last fed token: [B, V] float32."""
        input_ids, positions, query_lens, context_lens = [], [], [], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(end - start)
            context_lens.append(end)
        meta = build_metadata(query_lens, context_lens, [s.block_table for s in seqs], self.block_size,
                              per_sequence=self.batch_invariant)
        logits_index = torch.tensor(query_lens).cumsum(0) - 1
        return self.model(
            torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta, logits_index
        )

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy blocks out: [n, num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return self.kv_cache[:, :, block_ids].permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Copy blocks in (the layout ``read_blocks`` returns)."""
        self.kv_cache[:, :, block_ids] = blocks.permute(1, 2, 0, 3, 4, 5).to(self.kv_cache.dtype)
