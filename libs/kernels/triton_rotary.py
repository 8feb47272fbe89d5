"""Rotary position embedding in Triton (rotate-half layout).

The Triton twin of ``models.layers.apply_rope``: for each token ``t`` and head,
with the first and second halves ``x1, x2`` of a head's ``D`` features and the
token's ``cos``/``sin`` rows (``models.layers.rope_tables``: frequencies
repeated, so only the first half of each row is read)::

    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin

(Su et al. 2021, RoFormer; HF's ``rotate_half`` form). Each program rotates
``BLOCK_R`` (token, head) rows; q and k are two launches of one kernel.
Computed in fp32, stored in the input's dtype. Tolerances vs the reference:
fp32 max |diff| <= 1e-5 (products may fuse into FMAs; the tests use 1e-5), fp16/bf16 one unit in
the last place (the reference rounds each product to the dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, num_rows,
    stride_xr, stride_or, stride_ct, stride_st,
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    ok = (rows < num_rows)[:, None] & (j < HALF)[None, :]
    tok = rows // HEADS
    c = tl.load(cos_ptr + tok[:, None] * stride_ct + j[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok[:, None] * stride_st + j[None, :], mask=ok, other=0.0).to(tl.float32)
    x1_ptr = x_ptr + rows[:, None] * stride_xr + j[None, :]
    x1 = tl.load(x1_ptr, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    o1_ptr = out_ptr + rows[:, None] * stride_or + j[None, :]
    tl.store(o1_ptr, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(o1_ptr + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=ok)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block_r: int) -> torch.Tensor:
    t, h, d = x.shape
    x2 = x.reshape(t * h, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t:
        half = d // 2
        _rope_kernel[(triton.cdiv(t * h, block_r),)](
            x2, cos, sin, out, t * h, x2.stride(0), d, cos.stride(0), sin.stride(0),
            HEADS=h, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_R=block_r,
        )
    return out


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               block_r: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, H, D] and ``k`` [T, Hkv, D] by their tokens' angles -> (q', k'), new tensors
    of the inputs' dtypes. ``cos``, ``sin``: [T, 1, D] or [T, D] (rotate-half tables, halves
    equal; any float dtype). Raises ValueError for an odd ``D`` or mismatched shapes/devices."""
    d = q.shape[-1]
    if d % 2 or k.shape[-1] != d or cos.shape[-1] != d or sin.shape[-1] != d:
        raise ValueError(f"head_dim must be even and shared: q {q.shape}, k {k.shape}, cos {cos.shape}")
    if not (q.device == k.device == cos.device == sin.device):
        raise ValueError("q, k, cos and sin must be on one device")
    t = q.shape[0]
    if k.shape[0] != t or cos.shape[0] != t or sin.shape[0] != t:
        raise ValueError(f"token counts differ: q {q.shape}, k {k.shape}, cos {cos.shape}")
    cos, sin = cos.reshape(t, d), sin.reshape(t, d)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    return _rope(q, cos, sin, block_r), _rope(k, cos, sin, block_r)
