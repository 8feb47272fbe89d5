"""RMSNorm in Triton, optionally fused with the residual add before it.

The Triton twins of ``models.layers.RMSNorm`` (Llama: ``weight * (x / rms(x))``,
normalised in fp32, cast to ``x``'s dtype, then scaled) and ``GemmaRMSNorm``
(``(1 + weight) * (x / rms(x))`` all in fp32, then cast), with
``rms(x) = sqrt(mean(x^2) + eps)`` (Zhang & Sennrich 2019). With a residual
``r`` the kernel computes ``s = x + r`` (rounded to the dtype, as torch's
add) and returns ``(norm(s), s)``: the ``x = x + attn(...)``,
``post_attention_layernorm(x)`` pair of a pre-norm decoder layer in one pass
over memory (``fused_add_rms_norm``; vLLM's "fused add RMSNorm" and the Triton
layer-norm tutorial's row reduction, written here from their descriptions).

Each program normalises ``BLOCK_ROWS`` rows of ``N`` elements (a 2-D tile
``[BLOCK_ROWS, next_pow2(N)]``; the whole row is in registers, fine for hidden
sizes up to ~16k). Tolerances vs the reference: fp32 max |diff| <= 1e-5 relative
to the output scale (the sum of squares is reduced in another order), fp16 /
bf16 one unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, num_rows, eps,
    stride_x, stride_r, stride_s, stride_o,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = (rows < num_rows)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + rows[:, None] * stride_s + cols[None, :], x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)
    y = xf * inv[:, None]
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if GEMMA:
        out = y * (1.0 + w[None, :])
    else:
        out = y.to(x.dtype).to(tl.float32) * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, gemma: bool,
            block_rows: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} for rows of {n}")
    if weight.device != x.device or (residual is not None and residual.device != x.device):
        raise ValueError("x, weight and residual must be on one device")
    x2 = _rows(x, n)
    rows = x2.shape[0]
    dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows, n, dtype=dtype, device=x.device)
    total = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} for x {tuple(x.shape)} {x.dtype}")
        res = _rows(residual, n)
        total = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    else:
        res = x2
    total_rows = total if total is not None else x2
    block_n = triton.next_power_of_2(n)
    br = block_rows or max(1, min(64, 4096 // block_n))
    if rows:
        _rms_norm_kernel[(triton.cdiv(rows, br),)](
            x2, res, total_rows, weight, out, rows, eps, x2.stride(0), res.stride(0), total_rows.stride(0),
            out.stride(0), N=n, BLOCK_N=block_n, BLOCK_ROWS=br, HAS_RESIDUAL=residual is not None, GEMMA=gemma,
        )
    shape = (*x.shape[:-1], n)
    return out.view(shape), None if total is None else total.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False,
             block_rows: int | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` [..., N] over its last dim with ``weight`` [N] -> [..., N].

    Llama style (``gemma=False``): output dtype that of ``weight * x`` (torch's
    promotion); Gemma style: ``x``'s. ``block_rows``: rows per program (default: a
    tile of ~4k elements). Raises ValueError on a weight of another length or tensors
    on different devices.
    """
    return _launch(x, None, weight, eps, gemma, block_rows)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       gemma: bool = False, block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (both [..., N], one dtype) and RMSNorm of ``s`` in one pass:
    returns (norm(s), s), new tensors (the inputs are not written). Errors as ``rms_norm``,
    plus ValueError when the residual's shape or dtype differs from ``x``'s."""
    return _launch(x, residual, weight, eps, gemma, block_rows)
