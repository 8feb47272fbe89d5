"""KV-cache store in Triton: write new K/V rows into their cache slots by slot mapping.

The Triton twin of ``kernels.attention.store_kvcache``. A token's K (and V)
``[Hkv, D]`` is one row of ``Hkv * D`` elements; slot ``s`` lives at block
``s // block_size``, offset ``s % block_size`` of the cache
``[num_blocks, block_size, Hkv, D]``. Each program copies ``BLOCK_T`` tokens'
rows (a 2-D tile ``[BLOCK_T, next_pow2(Hkv * D)]``) for K and for V, the
scatter of vLLM's ``reshape_and_cache`` (written here from its description).

A negative slot is skipped (vLLM's padding convention); the reference raises
on one instead, so the engine never passes one. Exact copy: the result equals
the reference bit for bit (a dtype cast, if any, is torch's round-to-nearest).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
    BLOCK_SIZE: tl.constexpr, ROW: tl.constexpr, BLOCK_ROW: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_ROW)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (j < ROW)[None, :]
    block, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64[:, None] * stride_kt + j[None, :], mask=ok)
    v = tl.load(v_ptr + t64[:, None] * stride_vt + j[None, :], mask=ok)
    kc = (block * stride_kcb + off * stride_kcs)[:, None] + j[None, :]
    vc = (block * stride_vcb + off * stride_vcs)[:, None] + j[None, :]
    tl.store(k_cache_ptr + kc, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + vc, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, *, block_t: int = 16) -> None:
    """Write ``k``, ``v`` [T, Hkv, D] into ``k_cache``, ``v_cache`` [num_blocks, block_size, Hkv, D]
    at ``slot_mapping`` [T] (int32/int64; negative = skip). In place. Raises ValueError when a
    cache's (Hkv, D) rows are not contiguous or the tensors are not on one device."""
    t, hkv, d = k.shape
    for c in (k_cache, v_cache):
        if c.stride(3) != 1 or c.stride(2) != d:
            raise ValueError("cache rows [Hkv, D] must be contiguous")
        if c.device != k.device:
            raise ValueError(f"k on {k.device}, a cache on {c.device}")
    if t == 0:
        return
    k = k.reshape(t, hkv * d)
    v = v.reshape(t, hkv * d)
    k = k if k.stride(1) == 1 else k.contiguous()
    v = v if v.stride(1) == 1 else v.contiguous()
    slots = slot_mapping.to(k.device)
    row = hkv * d
    _store_kvcache_kernel[(triton.cdiv(t, block_t),)](
        k, v, k_cache, v_cache, slots, t, k.stride(0), v.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        BLOCK_SIZE=k_cache.shape[1], ROW=row, BLOCK_ROW=triton.next_power_of_2(row), BLOCK_T=block_t,
    )
