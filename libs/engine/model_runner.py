"""The only place that builds tensors: KV cache, step inputs, forward, block copy in/out.

KV cache layout (all layers in one tensor)::

    kv_cache: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]

A block exported to (or imported from) the storage tier is
``kv_cache[:, :, block_id]``: [num_layers, 2, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.sequence import Sequence
from deepinfer.kernels.attention import AttentionMetadata, build_metadata


@dataclass
class StepInputs:
    """One step's model inputs. input_ids, positions: [T] int64 (packed tokens of
    all sequences); logits_index: [B] int64, packed index of each sequence's last
    fed token; placeholders: (index in input_ids, sequence, position) of tokens
    still being sampled by an in-flight step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor
    placeholders: list


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

    def prepare(self, seqs: list[Sequence]) -> StepInputs:
        """Build the step's tensors: each sequence feeds its ``num_scheduled_tokens``
        tokens after its ``num_computed_tokens`` computed ones.

        A fed position not in ``token_ids`` yet (the token an in-flight step is
        sampling) gets a placeholder, listed in ``StepInputs.placeholders`` and
        filled by ``fill`` once that step is back.
        """
        input_ids, positions, query_lens, context_lens, placeholders = [], [], [], [], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            known = seq.token_ids[start:end]
            for p in range(start + len(known), end):
                placeholders.append((len(input_ids) + p - start, seq, p))
            input_ids.extend(known)
            input_ids.extend([0] * (end - start - len(known)))
            positions.extend(range(start, end))
            query_lens.append(end - start)
            context_lens.append(end)
        meta = build_metadata(query_lens, context_lens, [s.block_table for s in seqs], self.block_size,
                              per_sequence=self.batch_invariant)
        return StepInputs(torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                          meta, torch.tensor(query_lens).cumsum(0) - 1, placeholders)

    @staticmethod
    def fill(inputs: StepInputs) -> None:
        """Write the now-known tokens into the placeholders (0 for an aborted sequence's)."""
        for j, seq, p in inputs.placeholders:
            inputs.input_ids[j] = seq.token_ids[p] if p < len(seq.token_ids) else 0
        inputs.placeholders = []

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Forward pass; the logits after each sequence's last fed token: [B, V] float32."""
        assert not inputs.placeholders, "fill() the placeholders first"
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_index)

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """``prepare`` + ``execute`` for sequences without in-flight tokens: [B, V] float32."""
        return self.execute(self.prepare(seqs))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy blocks out: [n, num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return self.kv_cache[:, :, block_ids].permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Copy blocks in (the layout ``read_blocks`` returns)."""
        self.kv_cache[:, :, block_ids] = blocks.permute(1, 2, 0, 3, 4, 5).to(self.kv_cache.dtype)
