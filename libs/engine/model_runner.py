"""The only place that builds tensors: KV cache, step inputs, forward, block copy in/out.

KV cache layout (one tensor per KV group)::

    kv_cache:        [num_full_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
    window_kv_cache: [num_window_layers, 2, num_window_blocks, block_size, num_kv_heads, head_dim]

Hybrid models (full and sliding-window layers, see ``engine.hybrid_blocks``)
have both groups, addressed by ``seq.block_table`` and
``seq.window_block_table``; other models put every layer in ``kv_cache``.
A block exported to (or imported from) another engine covers all layers in
model order: [num_layers, 2, block_size, num_kv_heads, head_dim] (window
layers' released blocks are zeros). A block of the storage tier's prefix files
covers the full layers only (``write_full_blocks``; all layers for models
without window layers), and the SWA state cache holds window layers' blocks
(``read_window_blocks`` / ``StepInputs.window_restores``).

Bounded replay (``engine.hybrid_blocks``): while a sequence
feeds positions below ``seq.replay_end`` again, its full layers' new K/V go to
a scratch block no block table names (their cached KV stays as the cold run
computed it; queries still attend to it), and its window layers see no keys
before ``seq.replay_start``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from deepinfer.engine.hybrid_blocks import NULL_BLOCK
from deepinfer.engine.sampler import prompt_token_logprobs
from deepinfer.engine.sequence import Sequence
from deepinfer.kernels.attention import AttentionMetadata, build_metadata


@dataclass
class StepInputs:
    """One step's model inputs. input_ids, positions: [T] int64 (packed tokens of
    all sequences); logits_index: [R] int64, packed index of each sequence's last
    fed token (R = B), and for a sequence with k draft tokens of the k tokens fed
    before it too (its anchor and drafts: k + 1 rows, in order); placeholders:
    (index in input_ids, sequence, position) of tokens still being sampled by an
    in-flight step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: list[AttentionMetadata]  # one per KV group (full, window)
    logits_index: torch.Tensor
    placeholders: list
    # window blocks to fill from the SWA state cache before the forward pass:
    # (block ids, [n, num_window_layers, 2, block_size, num_kv_heads, head_dim])
    window_restores: tuple[list[int], torch.Tensor] | None = None
    # image embeddings of the fed placeholder rows: (rows [K] int64, embeds [K, hidden]) or None
    embeds_override: tuple[torch.Tensor, torch.Tensor] | None = None
    # prompt logprobs (``Sequence.prompt_logprobs``): packed rows [H] int64 of the fed positions whose
    # next token is a prompt token, as (sequence, first position, count) per sequence, in order;
    # ``execute`` puts their ``SampleResult.prompt_logprobs`` entries in ``prompt_logprobs``
    prompt_index: torch.Tensor | None = None
    prompt_pieces: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)


PROMPT_LOGITS_ROWS = 256  # prompt positions turned into logits at a time (prompt logprobs)


class ModelRunner:
    """``num_window_blocks`` > 0 gives the sliding-window layers of a hybrid model
    their own pool (``window_kv_cache``, ``seq.window_block_table``)."""

    def __init__(self, model, block_size: int, num_blocks: int, dtype: torch.dtype, batch_invariant: bool = False,
                 num_window_blocks: int = 0):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.batch_invariant = batch_invariant
        layers = model.attention_layers
        self.hybrid = num_window_blocks > 0
        self.window_layers = [i for i, a in enumerate(layers) if self.hybrid and a.sliding_window is not None]
        self.full_layers = [i for i in range(len(layers)) if i not in self.window_layers]
        shape = (2, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # hybrid: one scratch block past the pool takes the full layers' K/V of replayed positions
        self.scratch_block = num_blocks if self.hybrid else None
        num_full_blocks = num_blocks + (1 if self.hybrid else 0)
        self.kv_cache = torch.zeros(len(self.full_layers), shape[0], num_full_blocks, *shape[1:], dtype=dtype)
        self.window_kv_cache = torch.zeros(len(self.window_layers), shape[0], num_window_blocks, *shape[1:],
                                           dtype=dtype)
        for group, (cache, idx) in enumerate(((self.kv_cache, self.full_layers),
                                              (self.window_kv_cache, self.window_layers))):
            for j, i in enumerate(idx):
                layers[i].kv_group = group
                layers[i].k_cache, layers[i].v_cache = cache[j, 0], cache[j, 1]

    @staticmethod
    def block_bytes(cfg, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
        """Bytes of one KV block (``num_layers`` layers, default all; K and V)."""
        layers = cfg.num_hidden_layers if num_layers is None else num_layers
        return layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize

    def prepare(self, seqs: list[Sequence]) -> StepInputs:
        """Build the step's tensors: each sequence feeds its ``num_scheduled_tokens``
        tokens after its ``num_computed_tokens`` computed ones.

        A fed position not in ``token_ids`` yet (the token an in-flight step is
        sampling) gets a placeholder, listed in ``StepInputs.placeholders`` and
        filled by ``fill`` once that step is back.
        """
        input_ids, positions, query_lens, context_lens, placeholders, rows = [], [], [], [], [], []
        image_rows, image_embeds, prompt_rows, prompt_pieces = [], [], [], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                n = min(end, seq.num_prompt_tokens - 1) - start  # positions that predict a prompt token
                prompt_rows.extend(range(len(input_ids), len(input_ids) + n))
                prompt_pieces.append((seq, start, n))
            if seq.images:  # the chunk's rows of each image it overlaps (a chunk may cut an image)
                self._image_rows(seq, start, end, len(input_ids), image_rows, image_embeds)
            tokens = seq.token_ids + seq.draft_token_ids if seq.draft_token_ids else seq.token_ids
            known = tokens[start:end]
            for p in range(start + len(known), end):
                placeholders.append((len(input_ids) + p - start, seq, p))
            input_ids.extend(known)
            input_ids.extend([0] * (end - start - len(known)))
            positions.extend(range(start, end))
            query_lens.append(end - start)
            context_lens.append(end)
            # logits after the last fed token; with draft tokens also after the anchor and each draft
            rows.extend(range(len(input_ids) - 1 - len(seq.draft_token_ids), len(input_ids)))
        meta = [build_metadata(query_lens, context_lens, [s.block_table for s in seqs], self.block_size,
                               per_sequence=self.batch_invariant)]
        if self.hybrid:
            self._discard_replayed_writes(meta[0], seqs, query_lens)
            tables = [s.window_block_table for s in seqs]
            first = [next((i for i, b in enumerate(t) if b != NULL_BLOCK), len(t)) for t in tables]
            meta.append(build_metadata(query_lens, context_lens, tables, self.block_size,
                                       per_sequence=self.batch_invariant, first_blocks=first,
                                       key_starts=[s.replay_start for s in seqs]))
        override = (torch.tensor(image_rows, dtype=torch.long), torch.cat(image_embeds)) if image_rows else None
        return StepInputs(torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                          meta, torch.tensor(rows, dtype=torch.long), placeholders, embeds_override=override,
                          prompt_index=torch.tensor(prompt_rows, dtype=torch.long) if prompt_rows else None,
                          prompt_pieces=prompt_pieces)

    @staticmethod
    def _image_rows(seq: Sequence, start: int, end: int, base: int, rows: list, embeds: list) -> None:
        """Append the packed rows (``base`` + position - start) and embeddings of the image
        placeholders among positions [start, end). Raises RuntimeError when the sequence has
        images but no embeddings here (an imported multimodal prompt cannot be recomputed)."""
        for k, (offset, length, _) in enumerate(seq.images):
            lo, hi = max(start, offset), min(end, offset + length)
            if lo >= hi:
                continue
            if seq.image_embeds is None:
                raise RuntimeError(f"request {seq.request_id}: recomputing a prompt with images needs their "
                                   "embeddings, which this worker does not have")
            rows.extend(range(base + lo - start, base + hi - start))
            embeds.append(seq.image_embeds[k][lo - offset : hi - offset])

    def _discard_replayed_writes(self, meta: AttentionMetadata, seqs: list[Sequence], query_lens: list[int]) -> None:
        """Point the full layers' cache writes of replayed positions (< ``seq.replay_end``)
        at the scratch block, so the cached KV there stays the cold run's."""
        offset = 0
        for seq, n in zip(seqs, query_lens):
            start = seq.num_computed_tokens
            m = min(n, seq.replay_end - start)
            if m > 0:
                pos = torch.arange(start, start + m)
                meta.slot_mapping[offset : offset + m] = self.scratch_block * self.block_size + pos % self.block_size
            offset += n

    @staticmethod
    def fill(inputs: StepInputs) -> None:
        """Write the now-known tokens into the placeholders (0 for an aborted sequence's)."""
        for j, seq, p in inputs.placeholders:
            inputs.input_ids[j] = seq.token_ids[p] if p < len(seq.token_ids) else 0
        inputs.placeholders = []

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Forward pass (after filling ``window_restores``); the logits at
        ``inputs.logits_index``: [R, V] float32 (one row per sequence without drafts). Prompt
        logprobs of ``inputs.prompt_pieces`` go to ``inputs.prompt_logprobs``."""
        assert not inputs.placeholders, "fill() the placeholders first"
        if inputs.window_restores is not None:
            self.write_window_blocks(*inputs.window_restores)
            inputs.window_restores = None
        kwargs = {}
        if inputs.embeds_override is not None:
            kwargs["input_embeds_override"] = inputs.embeds_override
        if not inputs.prompt_pieces:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_index, **kwargs)
        logits, hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_index,
                                    hidden_index=inputs.prompt_index, **kwargs)
        inputs.prompt_logprobs = self._prompt_logprobs(hidden, inputs.prompt_pieces)
        return logits

    def _prompt_logprobs(self, hidden: torch.Tensor, pieces: list) -> list:
        """``SampleResult.prompt_logprobs`` from the final hidden states [H, hidden] of the pieces'
        positions: logits ``PROMPT_LOGITS_ROWS`` rows at a time (a [H, V] float32 block at once
        is ~0.8 GB for a 4k-token chunk of a 49k vocabulary)."""
        targets = [t for seq, start, n in pieces for t in seq.token_ids[start + 1 : start + 1 + n]]
        k = max(seq.sampling.prompt_logprobs for seq, _, _ in pieces)
        entries = []
        for i in range(0, len(targets), PROMPT_LOGITS_ROWS):
            logits = self.model.logits(hidden[i : i + PROMPT_LOGITS_ROWS])
            entries += prompt_token_logprobs(logits, targets[i : i + PROMPT_LOGITS_ROWS], k)
        out, at = [], 0
        for seq, start, n in pieces:
            mine = seq.sampling.prompt_logprobs
            out.append((seq, start, [dataclasses.replace(e, top=e.top[:mine]) for e in entries[at : at + n]]))
            at += n
        return out

    @torch.inference_mode()
    def draft_forward(self, seqs: list[Sequence], token_ids: list[int], positions: list[int],
                      num_layers: int) -> torch.Tensor:
        """Self-draft step of speculative decoding: feed ``token_ids[i]`` at ``positions[i]``
        for ``seqs[i]`` through the first ``num_layers`` layers (writing their KV there;
        the verification step overwrites it) and return the early-exit logits [B, V] float32.
        The block tables must already cover each position."""
        meta = build_metadata([1] * len(seqs), [p + 1 for p in positions], [s.block_table for s in seqs],
                              self.block_size, per_sequence=self.batch_invariant)
        return self.model(torch.tensor(token_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                          [meta], torch.arange(len(seqs)), num_layers=num_layers)

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """``prepare`` + ``execute`` for sequences without in-flight tokens: [B, V] float32."""
        return self.execute(self.prepare(seqs))

    def read_blocks(self, seq: Sequence, n: int, start: int = 0) -> torch.Tensor:
        """Copy the sequence's blocks ``start .. n-1`` out:
        [n - start, num_layers, 2, block_size, num_kv_heads, head_dim] (released window blocks: zeros)."""
        full = self.kv_cache[:, :, seq.block_table[start:n]]  # [Lf, 2, n - start, ...]
        if not self.hybrid:
            return full.permute(2, 0, 1, 3, 4, 5).contiguous()
        c = self.kv_cache
        out = c.new_zeros(n - start, len(self.full_layers) + len(self.window_layers), 2, *c.shape[3:])
        out[:, self.full_layers] = full.permute(2, 0, 1, 3, 4, 5)
        kept = [(i, b) for i, b in enumerate(seq.window_block_table[start:n]) if b != NULL_BLOCK]
        if kept:
            rows, ids = zip(*kept)
            win = self.window_kv_cache[:, :, list(ids)].permute(2, 0, 1, 3, 4, 5)  # [k, Lw, 2, ...]
            out[torch.tensor(rows)[:, None], torch.tensor(self.window_layers)[None, :]] = win
        return out

    def write_blocks(self, seq: Sequence, blocks: torch.Tensor) -> None:
        """Copy blocks in (the layout ``read_blocks`` returns) to the sequence's first
        ``len(blocks)`` blocks; window layers only where the window table keeps a block."""
        n = blocks.shape[0]
        blocks = blocks.to(self.kv_cache.dtype)
        self.kv_cache[:, :, seq.block_table[:n]] = blocks[:, self.full_layers].permute(1, 2, 0, 3, 4, 5)
        if self.hybrid:
            kept = [(i, b) for i, b in enumerate(seq.window_block_table[:n]) if b != NULL_BLOCK]
            if kept:
                rows, ids = zip(*kept)
                win = blocks[list(rows)][:, self.window_layers]  # [k, Lw, 2, ...]
                self.window_kv_cache[:, :, list(ids)] = win.permute(1, 2, 0, 3, 4, 5)

    def write_full_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Copy storage-tier blocks [n, num_full_layers, 2, block_size, num_kv_heads, head_dim]
        (every layer for models without window layers) into full-pool blocks ``block_ids``."""
        self.kv_cache[:, :, block_ids] = blocks.to(self.kv_cache.dtype).permute(1, 2, 0, 3, 4, 5)

    def read_window_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy window-pool blocks out: [n, num_window_layers, 2, block_size, num_kv_heads, head_dim]."""
        return self.window_kv_cache[:, :, block_ids].permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_window_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Copy blocks in ``read_window_blocks``' layout into window-pool blocks ``block_ids``."""
        self.window_kv_cache[:, :, block_ids] = blocks.to(self.window_kv_cache.dtype).permute(1, 2, 0, 3, 4, 5)
