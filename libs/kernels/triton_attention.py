"""Paged attention in Triton: decode and varlen prefill over block tables (GQA, sliding window, sinks).

The Triton twin of ``kernels.attention.paged_attention`` (same arguments, same
result within the tolerances below). The cache layout is the reference's::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    key column c of sequence i -> block block_tables[i, c // block_size], offset c % block_size
                               -> absolute position first_pos[i] + c

One kernel serves both phases (the approach of vLLM's Triton "unified"
attention, written here from the FlashAttention-2 algorithm, Dao 2023): a
program owns ``BLOCK_Q`` consecutive queries of one sequence and *all* the
query heads that share one KV head (GQA group ``G = H / Hkv``), packed into the
rows of one tile, so each K/V tile is loaded once per group::

    tile row r -> query q0 + r // G, head kv_head * G + r % G      (BLOCK_M >= BLOCK_Q * G rows)

    grid = (num_seqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads)

It walks its keys ``BLOCK_N`` columns at a time (looking each column's block up
in the block table, so any cache block size works), from the first key any of
its queries may see (window, replay start, released blocks) to its last
query's position, with an online softmax in fp32 (exp2 domain). Decode steps
(one query per sequence) use ``BLOCK_Q = 1``: the tile is one token's G heads.

A query at absolute position p sees key position k iff::

    key_start <= k <= p      and, with a window W,   k > p - W

(HF masking_utils' causal and ``sliding_window_overlay`` masks; ``key_start``
is the reference's ``key_starts`` of bounded SWA replay). Sinks (GPT-OSS, Xiao
et al. 2023): the softmax denominator gets ``exp(sink[h])``, which the online
softmax starts from (running max = sink, running sum = 1).

Tolerances vs the torch reference (tests/kernel/test_triton_kernels.py): fp32
max |diff| <= 2e-5 (fp32 dots run IEEE, not TF32), fp16/bf16 <= 2e-2.
Not done here: split-KV ("flash decoding") for long single sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.attention import AttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_info_ptr, sinks_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q0 = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2)
    info = seq_info_ptr + seq * 5
    q_start = tl.load(info)
    q_len = tl.load(info + 1)
    ctx_len = tl.load(info + 2)
    first_pos = tl.load(info + 3)
    key_start = tl.load(info + 4)
    if q0 >= q_len:
        return
    r = tl.arange(0, BLOCK_M)
    qi = q0 + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (qi < q_len)
    q_pos = ctx_len - q_len + qi
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + qi).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # keys [lo, hi) in columns: from the first any query here may see, to the last query's position
    last_q = tl.minimum(q0 + BLOCK_Q, q_len) - 1
    hi = ctx_len - q_len + last_q + 1 - first_pos
    lo_pos = tl.maximum(first_pos, key_start)
    if HAS_WINDOW:
        lo_pos = tl.maximum(lo_pos, ctx_len - q_len + q0 - window + 1)
    lo = (lo_pos - first_pos) // BLOCK_N * BLOCK_N

    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        col = start + tl.arange(0, BLOCK_N)
        col_ok = col < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + col // BLOCK_SIZE, mask=col_ok, other=0).to(tl.int64)
        off = col % BLOCK_SIZE
        k_off = block * stride_kb + off * stride_ks + kv_head * stride_kh
        v_off = block * stride_vb + off * stride_vs + kv_head * stride_vh
        k = tl.load(k_cache_ptr + k_off[None, :] + d[:, None], mask=d_ok[:, None] & col_ok[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
        k_pos = first_pos + col
        ok = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= key_start) & row_ok[:, None] & col_ok[None, :]
        if HAS_WINDOW:
            ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no key yet keeps max -inf: shift by 0 instead (no inf - inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + qi).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def seq_info(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step kernel inputs, built once per step and device and shared by every layer:
    ([B, 5] int32 rows (query start in the packed batch, query length, context length,
    absolute position of key column 0, first attendable key position), block tables
    [B, nb] int32)."""
    key = ("triton_attention", str(device))
    got = meta.kernel_inputs.get(key)
    if got is None:
        b = meta.num_seqs
        q_lens = torch.tensor(meta.query_lens, dtype=torch.int64)
        starts = q_lens.cumsum(0) - q_lens
        first = meta.key_positions[:, 0].to(device="cpu", dtype=torch.int64)
        key_starts = torch.tensor(meta.key_starts or [0] * b, dtype=torch.int64)
        info = torch.stack([starts, q_lens, torch.tensor(meta.context_lens, dtype=torch.int64), first, key_starts], 1)
        got = meta.kernel_inputs[key] = (info.to(device=device, dtype=torch.int32),
                                         meta.block_tables.to(device=device, dtype=torch.int32).contiguous())
    return got


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, sinks: torch.Tensor | None = None, *,
                    block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Attention of packed queries ``q`` [T, H, D] over their sequences' cached context -> [T, H, D].

    Arguments as ``kernels.attention.paged_attention`` (``q`` and the caches of one
    dtype: float32, float16 or bfloat16; ``scale`` multiplies q.k; ``window`` W in
    tokens; ``sinks`` [H] logits). The new tokens' K/V must already be stored.
    ``block_m`` / ``block_n``: tile rows (queries x heads of a group) and key
    columns, powers of two (defaults: decode 16 x 64, prefill 64 x 64; tests
    shrink them; at least 16 each on a GPU). Raises ValueError when H is not a multiple of Hkv, or the
    tensors are not on one device.
    """
    t, h, d = q.shape
    hkv = k_cache.shape[-2]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} KV heads")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q on {q.device}, caches on {k_cache.device} / {v_cache.device}")
    group = h // hkv
    decode = meta.max_query_len == 1
    bm = block_m or (16 if decode else 64)
    bm = max(bm, triton.next_power_of_2(group))
    block_q = 1 if decode else bm // group
    bn = block_n or 64
    if q.is_cuda:  # tl.dot needs 16 or more rows, columns and depth on GPUs (the interpreter does not)
        bm, bn = max(bm, 16), max(bn, 16)
    info, tables = seq_info(meta, q.device)
    q = q.contiguous() if q.stride(-1) != 1 else q
    out = torch.empty_like(q)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, block_q), hkv)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, tables, info, sinks if sinks is not None else q,
        scale * LOG2E, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_Q=block_q, BLOCK_M=bm, BLOCK_N=bn,
        HAS_SINKS=sinks is not None, HAS_WINDOW=window is not None, PRECISION=precision,
    )
    return out
