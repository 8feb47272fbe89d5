"""Paged KV cache: storing new K/V by slot mapping, and attention over block tables.

Cache layout (one layer)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

A sequence's block table lists its block ids in order, so token ``i`` of the
sequence lives at slot ``block_table[i // block_size] * block_size + i % block_size``.

The torch reference below handles any mix of prefill chunks and decode tokens
in one step (varlen): each sequence's context K/V are gathered from the cache a
block at a time into ``[B, L_max, Hkv, D]`` and one SDPA call with a boolean
mask (causal within the sequence, padding excluded) does the math. When every
sequence feeds the same number of queries (pure decode) the packed queries
``[T, H, D]`` are that batch as they are; when the lengths differ (a prefill
chunk next to decodes, verify steps with uneven draft counts) the sequences are
grouped by query length, one SDPA call per group with the keys trimmed to the
group's longest context, so no sequence pays for another's queries (padding
every sequence to Tq_max = 9 instead of 6 cost 32 verifying sequences at
context 400 28% more SDPA time). The gather indices, masks and groups are
built once per step and shared by every layer.

Sliding-window layers (Mistral, Gemma 2/3, GPT-OSS) see only keys at
positions ``> q_pos - W`` (HF masking_utils ``sliding_window_overlay``)::

    key pos   0 1 2 3 4 5 6        W = 3, query at position 6
    full      x x x x x x x
    window            x x x

``AttentionMetadata.mask(W)`` builds that mask from the step's causal mask on
first use and caches it per W, so every layer of a window size shares one.

Sliding-window layers keep only the window's blocks (the engine's window KV
group): a sequence's leading blocks that no query can see any more are
released, so its window block table starts at logical block ``first_block``
(earlier entries are -1). ``build_metadata(first_blocks=...)`` gathers from
there: the key axis of sequence i starts at position ``first_blocks[i] *
block_size`` (``key_positions`` holds each column's absolute position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built by the model runner.

    slot_mapping: [T] int64, cache slot of each new token (packed order).
    query_index: [T] int64, position of each packed token in the flattened
        padded query batch ``[B * Tq_max]``.
    context_slots: [B, L_max] int64, cache slot of each context position of
        each sequence (positions past a sequence's context length point at slot 0
        and are masked out). L_max is the longest context rounded up to whole blocks.
    attn_mask: [B, 1, Tq_max, L_max] bool, True where a query may attend a key.
    num_seqs: B; max_query_len: Tq_max.
    query_positions: [B, Tq_max] int64, absolute position of each query
        (0 for padded rows); needed only by ``mask(window)``.
    key_positions: [B, L_max] int64, absolute position of each key column.
    key_lens: keys gathered per sequence (context length minus released blocks).
    key_starts: first key position each sequence may attend (empty: 0 for all).
    kernel_inputs: per-step tensors a kernel derives from the above, built on first
        use and shared by every layer (``triton_attention.seq_info``).
    cold: every sequence feeds its whole context from position 0 (query length =
        context length, nothing released, no key_starts): plain causal attention.
    """

    slot_mapping: torch.Tensor
    query_index: torch.Tensor
    context_slots: torch.Tensor
    attn_mask: torch.Tensor
    num_seqs: int
    max_query_len: int
    query_positions: torch.Tensor | None = None
    # Batch-invariant mode: attend sequence by sequence at exact lengths (no padding), so a
    # sequence's bits do not depend on the others' lengths (SDPA's tiling does).
    per_sequence: bool = False
    block_tables: torch.Tensor | None = None  # [B, L_max / block_size] int64, padded with block 0
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    key_positions: torch.Tensor | None = None
    key_lens: list[int] = field(default_factory=list)
    key_starts: list[int] = field(default_factory=list)
    kernel_inputs: dict = field(default_factory=dict, repr=False)
    cold: bool = False
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _groups: dict[int, list] = field(default_factory=dict, repr=False)

    def mask(self, window: int | None = None) -> torch.Tensor:
        """The step's mask [B, 1, Tq, L] bool, restricted to keys at positions
        ``> q_pos - window`` when ``window`` is set; built once per window size.

        A query always sees itself, so no valid row becomes empty; padded rows
        sit at position 0 and keep key 0.
        """
        if window is None or window >= self.attn_mask.shape[-1]:
            return self.attn_mask
        m = self._window_masks.get(window)
        if m is None:
            recent = self.key_positions[:, None, :] > self.query_positions[:, :, None] - window  # [B, Tq, L]
            m = self._window_masks[window] = self.attn_mask & recent[:, None]
        return m

    def groups(self, window: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
        """The step's sequences grouped by query length, for steps that mix lengths:
        per group (packed token index [G * q] int64, block ids [G * nb] int64, mask
        [G, 1, q, nb * block_size] bool, q), keys trimmed to the group's longest
        context. Built once per window size and shared by every layer."""
        key = -1 if window is None else window
        g = self._groups.get(key)
        if g is None:
            mask, bs = self.mask(window), self.attn_mask.shape[-1] // self.block_tables.shape[1]
            starts = torch.tensor([0] + self.query_lens[:-1]).cumsum(0)
            by_len: dict[int, list[int]] = {}
            for i, q in enumerate(self.query_lens):
                by_len.setdefault(q, []).append(i)
            g = self._groups[key] = []
            for q, rows in by_len.items():
                idx = torch.tensor(rows)
                nb = -(-max(self.key_lens[i] for i in rows) // bs)
                tokens = (starts[idx][:, None] + torch.arange(q)[None, :]).reshape(-1)
                g.append((tokens, self.block_tables[idx, :nb].reshape(-1), mask[idx, :, :q, :nb * bs], q))
        return g


def build_metadata(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
    per_sequence: bool = False, first_blocks: list[int] | None = None, key_starts: list[int] | None = None,
) -> AttentionMetadata:
    """Build the step's metadata from integers.

    query_lens[i]: new tokens of sequence i this step; context_lens[i]: tokens
    with KV after this step (cached + new), so the new tokens sit at positions
    ``[context_lens[i] - query_lens[i], context_lens[i])``. first_blocks[i]:
    first logical block of sequence i whose KV is kept (default 0); the
    entries of its block table before it are ignored. key_starts[i]: first key
    position sequence i may attend (default 0; must not exceed its first new
    token's position).
    """
    b = len(query_lens)
    first = first_blocks or [0] * b
    # Keys are gathered whole blocks at a time, so the key axis is padded to full blocks.
    nb = max(-(-c // block_size) - f for c, f in zip(context_lens, first))
    tq, lmax = max(query_lens), nb * block_size
    tables = torch.zeros(b, nb, dtype=torch.long)
    for i, (t, f) in enumerate(zip(block_tables, first)):
        t = t[f : f + nb]
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.long).clamp(min=0)
    ctx = torch.tensor(context_lens)
    qlen = torch.tensor(query_lens)
    col = torch.arange(lmax)
    pos = torch.tensor(first)[:, None] * block_size + col[None, :]  # [B, L] absolute key positions
    valid = pos < ctx[:, None]  # [B, L]
    if key_starts is not None and any(key_starts):
        valid &= pos >= torch.tensor(key_starts)[:, None]
    blocks = torch.gather(tables, 1, (col // block_size)[None, :].expand(b, -1))
    context_slots = torch.where(valid, blocks * block_size + col % block_size, 0)
    # query j of seq i is at absolute position ctx_i - qlen_i + j; it sees keys <= that.
    qpos = (ctx - qlen)[:, None] + torch.arange(tq)[None, :]  # [B, Tq]
    mask = (pos[:, None, :] <= qpos[:, :, None]) & valid[:, None, :]
    qvalid = torch.arange(tq)[None, :] < qlen[:, None]
    mask &= qvalid[:, :, None]
    # padded query rows attend to key 0 so softmax stays finite (their output is discarded)
    mask[:, :, 0] |= ~qvalid
    query_index = (torch.arange(b)[:, None] * tq + torch.arange(tq)[None, :])[qvalid]
    key_lens = [c - f * block_size for c, f in zip(context_lens, first)]
    slot_mapping = torch.cat([context_slots[i, k - q : k] for i, (q, k) in enumerate(zip(query_lens, key_lens))])
    return AttentionMetadata(slot_mapping, query_index, context_slots, mask[:, None], b, tq,
                             query_positions=torch.where(qvalid, qpos, 0), per_sequence=per_sequence,
                             query_lens=list(query_lens), context_lens=list(context_lens), block_tables=tables,
                             key_positions=pos, key_lens=key_lens, key_starts=list(key_starts or []),
                             cold=query_lens == context_lens and not any(first) and not any(key_starts or []))


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new keys/values ``[T, Hkv, D]`` into the caches at ``slot_mapping`` ``[T]``."""
    hkv, d = k.shape[-2:]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of packed queries ``q`` [T, H, D] over their sequences' cached context.

    The new tokens' K/V must already be stored (``store_kvcache``). ``window``:
    sliding-window size W (keys at positions > q_pos - W), None = full.
    ``sinks`` [H]: per-head logits added to each softmax's denominator (GPT-OSS
    attention sinks; Xiao et al. 2023). Returns [T, H, D].
    """
    t, h, d = q.shape
    hkv = k_cache.shape[-2]
    b, tq = meta.num_seqs, meta.max_query_len
    if meta.per_sequence and sinks is None:
        return _per_sequence_attention(q, k_cache, v_cache, meta, scale, window)
    if t != b * tq and sinks is None:  # mixed query lengths: one call per length, no query padding
        out = q.new_empty(t, h, d)
        for tokens, blocks, mask, ql in meta.groups(window):
            g = mask.shape[0]
            qg = q[tokens].view(g, ql, h, d).transpose(1, 2)
            k = k_cache.index_select(0, blocks).view(g, -1, hkv, d).transpose(1, 2)
            v = v_cache.index_select(0, blocks).view(g, -1, hkv, d).transpose(1, 2)
            out[tokens] = _attend(qg, k, v, mask, scale).transpose(1, 2).reshape(-1, h, d)
        return out
    if t == b * tq:  # every sequence has the same query length (e.g. pure decode): no scatter
        qp = q.view(b, tq, h, d)
    else:
        qp = q.new_zeros(b * tq, h, d)
        qp[meta.query_index] = q
        qp = qp.view(b, tq, h, d)
    # NOTE: gathering whole blocks (index_select of block_size*Hkv*D rows) is ~3x faster
    # on CPU than gathering token slots one by one.
    blocks = meta.block_tables.view(-1)
    k = k_cache.index_select(0, blocks).view(b, -1, hkv, d)  # [B, L, Hkv, D]
    v = v_cache.index_select(0, blocks).view(b, -1, hkv, d)
    if sinks is None and meta.cold and (window is None or window >= tq) and tq > SMALL_QUERY_MAX:
        # prompts from position 0, all of one length: causal SDPA on exactly their keys, no mask
        # (1.6k tokens, bf16: 21.8 against 35.4 ms per layer with the materialised mask)
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), k[:, :tq].transpose(1, 2),
                                             v[:, :tq].transpose(1, 2), is_causal=True, scale=scale,
                                             enable_gqa=(h != hkv))
    elif sinks is None:
        out = _attend(qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), meta.mask(window), scale)
    else:
        out = _attention_with_sinks(qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                    meta.mask(window), scale, sinks)
    out = out.transpose(1, 2).reshape(b * tq, h, d)
    return out if t == b * tq else out[meta.query_index]


# Up to this many queries per sequence, ``_attend`` computes attention with two batched
# matmuls instead of SDPA. Measured on a 2-core Xeon (SmolLM2-135M's 9 heads, 3 KV heads,
# head_dim 64): SDPA's CPU kernel in bf16 takes 1.29 ms for 16 one-token queries at
# context 224, the matmuls 0.14 ms (fp32: 0.16 vs 0.17); at 16 queries 1.10 vs 0.59 ms;
# from 32 queries on SDPA wins (1.81 vs 4.19 ms), as it does for prefill chunks.
SMALL_QUERY_MAX = 16


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, Tq, D], k/v [B, Hkv, L, D], mask [B, 1, Tq, L] bool -> [B, H, Tq, D] (q's dtype).

    Decode-sized queries (Tq <= ``SMALL_QUERY_MAX``): scores of each KV head's
    H / Hkv query heads in one matmul (no K/V repeat for GQA), softmax in
    float32, then one matmul with V. Longer queries: SDPA.
    """
    b, h, tq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if tq > SMALL_QUERY_MAX:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=(h != hkv))
    g = h // hkv
    # NOTE: K made contiguous first: the matmul on the gathered, head-strided view took 0.29 ms
    # at 16 sequences x 224 keys (bf16, one thread), the copy and the matmul 0.09 ms.
    scores = torch.matmul(q.reshape(b, hkv, g * tq, d), k.contiguous().transpose(2, 3)).float()
    scores = scores.view(b, hkv, g, tq, n)
    scores = scores.mul_(scale).masked_fill_(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, g * tq, n)
    return torch.matmul(probs, v).view(b, h, tq, d)


# Batch-invariant attention pads a sequence's queries to at least this many rows, and its key
# axis to a whole number of key tiles of this many columns.
INVARIANT_MIN_QUERIES = 16
INVARIANT_KEY_TILE = 512


def _per_sequence_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None):
    """``paged_attention`` one sequence at a time: [T, H, D] -> [T, H, D], each query row's bits
    independent of the batch, of how many queries its sequence feeds in the step (chunking, the
    prefix-cache state, draft tokens) and of how many keys follow its own (masked).

    NOTE: measured on CPU SDPA (fp32 and bf16, explicit mask): a query row gets other bits when
    1-15 rows share the call than when it runs alone, and other bits again for most query
    counts when the key axis is shorter than one 512-column key tile (a 301-token prompt: its
    last row alone vs in a 13-row chunk). So a sequence's queries are padded to
    ``INVARIANT_MIN_QUERIES`` rows (copies of its first one, dropped after) and its keys with
    zero, masked columns to a multiple of ``INVARIANT_KEY_TILE``: then a row's bits were equal
    for every query count 1-1,300 and every key length tried, in both dtypes. Verifying draft
    tokens (``engine.spec_decode``) computes each position exactly as decoding it alone would,
    and a prompt computes as it would cold, cached or cut into any chunks.
    """
    h, d = q.shape[1:]
    hkv = k_cache.shape[-2]
    mask = meta.mask(window)
    outs, start = [], 0
    for i, (ql, cl) in enumerate(zip(meta.query_lens, meta.key_lens)):
        slots = meta.context_slots[i, :cl]
        n = -(-cl // INVARIANT_KEY_TILE) * INVARIANT_KEY_TILE
        k = k_cache.new_zeros(n, hkv, d)
        v = v_cache.new_zeros(n, hkv, d)
        k[:cl] = k_cache.view(-1, hkv, d)[slots]
        v[:cl] = v_cache.view(-1, hkv, d)[slots]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, n, D]
        qi = q[start : start + ql].transpose(0, 1)[None]  # [1, H, ql, D]
        mi = F.pad(mask[i : i + 1, :, :ql, :cl], (0, n - cl), value=False)
        if ql < INVARIANT_MIN_QUERIES:
            pad = INVARIANT_MIN_QUERIES - ql
            qi = torch.cat([qi, qi[:, :, :1].expand(-1, -1, pad, -1)], dim=2)
            mi = torch.cat([mi, mi[:, :, :1].expand(-1, -1, pad, -1)], dim=2)
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mi, scale=scale, enable_gqa=(h != hkv))
        outs.append(o[0, :, :ql].transpose(0, 1))
        start += ql
    return torch.cat(outs)


def _attention_with_sinks(q, k, v, mask, scale, sinks):
    """q [B, H, Tq, D], k/v [B, Hkv, L, D], mask [B, 1, Tq, L] bool, sinks [H] -> [B, H, Tq, D].

    Explicit softmax over ``[scores, sink]`` with the sink column dropped
    afterwards: the sink absorbs probability mass but contributes no value
    (modeling_gpt_oss ``eager_attention_forward``, same operation order).
    """
    b, h, tq, _ = q.shape
    if k.shape[1] != h:
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    logits = torch.cat([scores, sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, tq, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
