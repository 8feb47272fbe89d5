"""Mixture-of-Experts in Triton: sorted-token expert dispatch and a grouped GEMM over expert slots.

The Triton path of ``models.moe.MoEBlock.dispatch``. The block still does the
routing and its bookkeeping (top-k, counters, round-robin replica slots); this
module computes every (token, expert) pair's weighted expert output in three
launches instead of one GEMM pair per slot::

    pairs sorted by slot, each slot's run padded to BLOCK_M rows (moe_align):
        padded row  0  1  2  3 | 4  5  6  7 | 8  9  .  . |      BLOCK_M = 4
        pair        a  b  c  . | d  .  .  . | e  f  g  h |      ('.' = padding, -1)
        slot        0          | 2          | 3          |      (slot 1: no pairs, no rows)

    h = x[token(pair)] @ W1[slot] + b1[slot]          grouped GEMM 1   [P, N1]
    a = activation(h)                                 torch, elementwise  [P, I]
    y = (a @ W2[slot] + b2[slot]) * routing weight    grouped GEMM 2   [P, hidden]

A program of the grouped GEMM owns one BLOCK_M-row block (all rows of one
slot, so it reads one expert's weights) and BLOCK_N output columns, and walks
K in BLOCK_K steps (the tiled GEMM of the Triton matmul tutorial). The sorting
and padding follow vLLM's fused_moe / ``moe_align_block_size`` (written here
from their description; no host sync: the padded length is bounded by
``P + R * (BLOCK_M - 1)``). Weights may be stored ``[R, K, N]`` or ``[R, N, K]``
(``nn.Linear``'s ``[out, in]``): the kernel takes strides, so neither is copied.

Tolerances vs the per-slot torch loop: fp32 max |diff| <= 1e-5 relative to the
output scale (dots accumulate in another order; fp32 dots run IEEE, not TF32),
fp16/bf16 ~1e-2.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_rows_ptr, c_rows_ptr, block_slot_ptr, w_ptr, bias_ptr, scale_ptr, c_ptr,
    K, N, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_be, stride_cm,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    c_row = tl.load(c_rows_ptr + m)
    row_ok = c_row >= 0
    if tl.max(row_ok.to(tl.int32), 0) == 0:  # a block of padding only
        return
    a_row = tl.load(a_rows_ptr + m, mask=row_ok, other=0).to(tl.int64)
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + slot * stride_we + k[:, None] * stride_wk + n[None, :] * stride_wn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + slot * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(c_ptr.dtype.element_ty)
    if HAS_SCALE:  # the routing weight, applied to the rounded output like the reference
        s = tl.load(scale_ptr + c_row, mask=row_ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) * s[:, None]).to(c_ptr.dtype.element_ty)
    c_row64 = c_row.to(tl.int64)
    tl.store(c_ptr + c_row64[:, None] * stride_cm + n[None, :], out, mask=row_ok[:, None] & n_ok[None, :])


def align_by_slot(slots: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded sorted layout of pairs: ``slots`` [P] int64 (slot of each pair) ->
    (pair of each padded row [P + R * (block_m - 1)] int64, -1 = padding; slot of each
    block of ``block_m`` rows [that length / block_m] int64). A slot's pairs keep their
    order (stable); a slot with no pairs gets no block."""
    p = slots.numel()
    counts = torch.bincount(slots, minlength=num_slots)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_start = padded.cumsum(0) - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(slots, stable=True)
    sorted_slots = slots[order]
    pos = pad_start[sorted_slots] + torch.arange(p, device=slots.device) - start[sorted_slots]
    length = p + num_slots * (block_m - 1)
    length = (length + block_m - 1) // block_m * block_m
    pair_of_row = torch.full((length,), -1, dtype=torch.int64, device=slots.device)
    pair_of_row[pos] = order
    block_ends = padded.cumsum(0) // block_m  # [R] first block after each slot's
    blocks = torch.arange(length // block_m, device=slots.device)
    block_slot = torch.searchsorted(block_ends, blocks, right=True).clamp(max=num_slots - 1)
    return pair_of_row, block_slot


def grouped_gemm(a: torch.Tensor, a_rows: torch.Tensor, pair_of_row: torch.Tensor, block_slot: torch.Tensor,
                 w: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None, *,
                 num_pairs: int, block_m: int, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """``out[p] = (a[a_rows[p]] @ w[slot(p)] + bias[slot(p)]) * scale[p]`` for every pair p -> [P, N].

    ``a`` [M, K]; ``a_rows`` [P] int64 (row of ``a`` each pair reads); ``pair_of_row``,
    ``block_slot``: ``align_by_slot``'s layout for ``block_m``; ``w`` [R, K, N] (any
    strides: pass ``weight.transpose(1, 2)`` for ``[R, N, K]`` storage); ``bias`` [R, N];
    ``scale`` [P] (float). Output dtype: ``a``'s. Raises ValueError on mismatched K, or
    blocks under 16 on a GPU.
    """
    k, n = w.shape[1], w.shape[2]
    if a.is_cuda and min(block_m, block_n, block_k) < 16:
        raise ValueError("tl.dot needs blocks of 16 or more on a GPU")
    if a.shape[1] != k:
        raise ValueError(f"a has {a.shape[1]} columns, w expects {k}")
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    # row -> the row of ``a`` it reads (padding: -1 stays -1 through the c_rows mask)
    a_row_of_row = torch.where(pair_of_row >= 0, a_rows[pair_of_row.clamp(min=0)], -1)
    grid = (block_slot.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, a_row_of_row, pair_of_row, block_slot, w, bias if bias is not None else w,
        scale if scale is not None else a, out,
        k, n, a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def moe_experts(x: torch.Tensor, tokens: torch.Tensor, pair_weights: torch.Tensor, slots: torch.Tensor,
                num_slots: int, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                b2: torch.Tensor | None, activation: Callable[[torch.Tensor], torch.Tensor], *,
                block_m: int | None = None) -> torch.Tensor:
    """Weighted expert outputs of every (token, expert) pair: [P, hidden], x's dtype.

    ``x`` [T, hidden]; per pair p: ``tokens`` [P] int64 (its token), ``pair_weights`` [P]
    (its routing weight), ``slots`` [P] int64 (the weight slot that computes it, < R);
    ``w1`` [R, hidden, N1], ``w2`` [R, I, hidden] (strided views allowed), biases [R, N] or
    None; ``activation`` maps [P, N1] -> [P, I] (e.g. SwiGLU of the gate and up halves).
    ``block_m``: rows per block (default 16; 64 once pairs per slot average over 64).
    """
    p = tokens.numel()
    if block_m is None:
        block_m = 64 if p >= 64 * num_slots else 16
    pair_of_row, block_slot = align_by_slot(slots, num_slots, block_m)
    h = grouped_gemm(x, tokens, pair_of_row, block_slot, w1, b1, num_pairs=p, block_m=block_m)
    a = activation(h)
    a = a if a.stride(-1) == 1 else a.contiguous()
    rows = torch.arange(p, device=x.device)
    return grouped_gemm(a, rows, pair_of_row, block_slot, w2, b2, pair_weights, num_pairs=p, block_m=block_m)
