"""Paged attention against a direct per-sequence reference, for steps that mix query lengths."""

import math

import pytest
import torch

from deepinfer.kernels.attention import build_metadata, paged_attention, store_kvcache


def _reference(q, ks, vs, query_lens, context_lens, scale, window):
    """Plain softmax attention per sequence over its whole context (positions 0..c-1)."""
    outs, start = [], 0
    for i, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        qi = q[start:start + ql].float()  # [ql, H, D]
        k, v = ks[i].float(), vs[i].float()  # [cl, Hkv, D]
        rep = qi.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        qpos = torch.arange(cl - ql, cl)[:, None]
        kpos = torch.arange(cl)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        scores = scores.masked_fill(~allowed[None], -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += ql
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("query_lens,context_lens", [
    ([1, 1, 1], [7, 20, 3]),  # pure decode (one padded call)
    ([1, 4, 6, 1, 4], [9, 17, 6, 33, 4]),  # verify steps: uneven draft counts (grouped calls)
    ([12, 1, 1, 3], [12, 40, 2, 19]),  # a prefill chunk next to decodes
    ([21, 21], [21, 21]),  # cold prompts of one length (causal SDPA without a mask, unless windowed)
    ([21, 21], [21, 30]),  # one length, one with cached context (masked)
])
def test_paged_attention_matches_reference(query_lens, context_lens, window):
    torch.manual_seed(0)
    h, hkv, d, bs, nblocks = 6, 2, 8, 4, 64
    k_cache = torch.zeros(nblocks, bs, hkv, d)
    v_cache = torch.zeros(nblocks, bs, hkv, d)
    perm = torch.randperm(nblocks).tolist()  # blocks scattered across the cache
    tables, ks, vs = [], [], []
    for cl in context_lens:
        n = -(-cl // bs)
        tables.append([perm.pop() for _ in range(n)])
        ks.append(torch.randn(cl, hkv, d))
        vs.append(torch.randn(cl, hkv, d))
    # cached context first (as earlier steps stored it), then this step's new tokens
    if query_lens != context_lens:
        cached = build_metadata([c - q for q, c in zip(query_lens, context_lens)], [c - q for q, c in
                                zip(query_lens, context_lens)], tables, bs)
        store_kvcache(torch.cat([k[:c - q] for k, q, c in zip(ks, query_lens, context_lens)]),
                      torch.cat([v[:c - q] for v, q, c in zip(vs, query_lens, context_lens)]),
                      k_cache, v_cache, cached.slot_mapping)
    meta = build_metadata(query_lens, context_lens, tables, bs)
    assert meta.cold == (query_lens == context_lens)
    store_kvcache(torch.cat([k[c - q:] for k, q, c in zip(ks, query_lens, context_lens)]),
                  torch.cat([v[c - q:] for v, q, c in zip(vs, query_lens, context_lens)]),
                  k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(sum(query_lens), h, d)
    out = paged_attention(q, k_cache, v_cache, meta, d ** -0.5, window=window)
    ref = _reference(q, ks, vs, query_lens, context_lens, d ** -0.5, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
