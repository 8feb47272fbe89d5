"""Triton kernels vs the torch references on a CUDA GPU: time per call, side by side.

Each kernel runs on one realistic shape (a Llama-3-8B-like layer: 32 query heads,
8 KV heads, head_dim 128, hidden 4096, bf16, 16-token blocks; a Qwen3-30B-A3B-like
MoE layer: 128 experts, top-8, hidden 2048, expert width 768) through the torch
reference (libs/kernels/attention.py, models/layers.py, models/moe.py) and the Triton
kernel (libs/kernels/triton_*.py). Both results are compared first (max |diff| printed,
so a fast wrong kernel shows); then ``triton.testing.do_bench`` (median of
repeated CUDA-event-timed runs, caches flushed between) times each. Printed per
row: torch ms, triton ms, torch / triton (> 1: Triton faster).

Rows: paged decode attention (64 sequences at 2,048 tokens of context), varlen
prefill attention (4 chunks of 512 new tokens over 1,536 cached), the same decode
with a 128-token window and sinks (GPT-OSS), KV store (4,096 tokens), RMSNorm,
fused add + RMSNorm (4,096 x 4,096), rotary (4,096 tokens, q and k), MoE experts
(512 tokens). About a minute on a datacenter GPU, most of it Triton compiling.

Run: ``python benchmarks/bench_kernels.py [--quick]`` (scripts/gpu_check.sh runs it).
Exits 2 without CUDA: the interpreter's timings would mean nothing. ``--smoke``
(with TRITON_INTERPRET=1, on a CPU) runs every row once on toy shapes, to check
this script itself where no GPU is at hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch


def _meta_on(meta, device):
    """The metadata with its tensors on ``device`` (the reference indexes the caches with them)."""
    moved = {f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
             if isinstance(getattr(meta, f.name), torch.Tensor)}
    return dataclasses.replace(meta, **moved)


def _attention_case(query_lens, context_lens, bs, h, hkv, d, dtype, device):
    from deepinfer.kernels.attention import build_metadata

    g = torch.Generator().manual_seed(0)
    nb = [-(-c // bs) for c in context_lens]
    perm = torch.randperm(sum(nb), generator=g).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in nb]
    k_cache = torch.randn(sum(nb), bs, hkv, d, generator=g).to(device, dtype)
    v_cache = torch.randn(sum(nb), bs, hkv, d, generator=g).to(device, dtype)
    meta = build_metadata(query_lens, context_lens, tables, bs)
    q = torch.randn(sum(query_lens), h, d, generator=g).to(device, dtype)
    return q, k_cache, v_cache, meta


SHAPES = {  # decode batch, decode context, prefill chunks x new tokens, cached prefix, tokens, experts, MoE tokens
    "full": dict(h=32, hkv=8, d=128, hidden=4096, n_dec=64, ctx=2048, chunks=4, new=512, t=4096, experts=128,
                 moe_hidden=2048, moe_inter=768, moe_t=512),
    "quick": dict(h=32, hkv=8, d=128, hidden=4096, n_dec=16, ctx=2048, chunks=4, new=512, t=4096, experts=32,
                  moe_hidden=2048, moe_inter=768, moe_t=512),
    "smoke": dict(h=4, hkv=2, d=16, hidden=64, n_dec=2, ctx=40, chunks=2, new=8, t=8, experts=4,
                  moe_hidden=32, moe_inter=16, moe_t=8),
}


def rows(shape: dict, dev: str, dt: torch.dtype):
    """(name, torch fn, triton fn) per benchmarked kernel."""
    from deepinfer.kernels import attention as ref_attention
    from deepinfer.kernels import triton_attention, triton_cache, triton_moe, triton_norm, triton_rotary  # noqa: F401
    from deepinfer.models.layers import RMSNorm, apply_rope
    from deepinfer.models.moe import SparseMoeBlock

    h, hkv, d, hidden, n_dec, ctx, t = (shape[k] for k in ("h", "hkv", "d", "hidden", "n_dec", "ctx", "t"))
    bs = 16
    scale = d ** -0.5
    out = []

    q, kc, vc, meta = _attention_case([1] * n_dec, [ctx] * n_dec, bs, h, hkv, d, dt, dev)
    m = _meta_on(meta, dev)
    out.append((f"decode attention B={n_dec} ctx={ctx}",
                lambda: ref_attention.paged_attention(q, kc, vc, m, scale),
                lambda: triton_attention.paged_attention(q, kc, vc, meta, scale)))
    sinks = torch.randn(h, device=dev)
    out.append((f"decode attention B={n_dec} window=128 sinks",
                lambda: ref_attention.paged_attention(q, kc, vc, m, scale, window=128, sinks=sinks),
                lambda: triton_attention.paged_attention(q, kc, vc, meta, scale, window=128, sinks=sinks)))
    chunks, new = shape["chunks"], shape["new"]
    qp, kcp, vcp, metap = _attention_case([new] * chunks, [ctx] * chunks, bs, h, hkv, d, dt, dev)
    mp = _meta_on(metap, dev)
    out.append((f"prefill attention {chunks} x {new} new over {ctx - new} cached",
                lambda: ref_attention.paged_attention(qp, kcp, vcp, mp, scale),
                lambda: triton_attention.paged_attention(qp, kcp, vcp, metap, scale)))

    k_new = torch.randn(t, hkv, d, device=dev, dtype=dt)
    slots = torch.randperm(kcp.shape[0] * bs, device=dev)[:t]
    kc2, vc2 = kcp.clone(), vcp.clone()
    out.append((f"KV store T={t}",
                lambda: ref_attention.store_kvcache(k_new, k_new, kc2, vc2, slots),
                lambda: triton_cache.store_kvcache(k_new, k_new, kc2, vc2, slots)))

    norm = RMSNorm(hidden, 1e-5).to(dev, dt).requires_grad_(False)
    x = torch.randn(t, hidden, device=dev, dtype=dt)
    res = torch.randn(t, hidden, device=dev, dtype=dt)
    out.append((f"RMSNorm {t} x {hidden}", lambda: norm(x), lambda: triton_norm.rms_norm(x, norm.weight, norm.eps)))
    out.append((f"add + RMSNorm {t} x {hidden}", lambda: (norm(x + res), x + res),
                lambda: triton_norm.fused_add_rms_norm(x, res, norm.weight, norm.eps)))

    pos = torch.randint(0, 8192, (t,), device=dev)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
    emb = torch.outer(pos.float(), inv).repeat(1, 2)
    cos, sin = emb.cos().to(dt)[:, None], emb.sin().to(dt)[:, None]
    qr = torch.randn(t, h, d, device=dev, dtype=dt)
    kr = torch.randn(t, hkv, d, device=dev, dtype=dt)
    out.append((f"rotary q+k T={t}", lambda: (apply_rope(qr, cos, sin), apply_rope(kr, cos, sin)),
                lambda: triton_rotary.apply_rope(qr, kr, cos, sin)))

    experts, top_k = shape["experts"], min(8, shape["experts"] // 2)
    moe = SparseMoeBlock(shape["moe_hidden"], shape["moe_inter"], experts, top_k, norm_topk_prob=True)
    moe.requires_grad_(False)
    for p in moe.parameters():
        p.normal_(0, 0.02)
    moe = moe.to(dev, dt)
    moe.init_buffers(dev)
    xm = torch.randn(shape["moe_t"], shape["moe_hidden"], device=dev, dtype=dt)

    def moe_with(backend):
        def run():
            moe.backend = backend
            return moe(xm)
        return run

    out.append((f"MoE experts T={shape['moe_t']} E={experts} top-{top_k}", moe_with("torch"), moe_with("triton")))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller shapes (decode batch 16, 32 experts)")
    p.add_argument("--smoke", action="store_true", help="CPU, toy shapes, under TRITON_INTERPRET=1: checks the script")
    args = p.parse_args(argv)
    if args.smoke:
        import os
        import time

        if os.environ.get("TRITON_INTERPRET") != "1":
            print("bench_kernels: --smoke needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2

        def timed(fn):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return _table(rows(SHAPES["smoke"], "cpu", torch.float16), timed, "cpu (Triton interpreter: times mean nothing)")
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device visible to torch: nothing to time (the Triton interpreter on a "
              "CPU is a correctness tool, not a speed one)", file=sys.stderr)
        return 2
    import triton.testing

    def timed(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50)

    shape = SHAPES["quick" if args.quick else "full"]
    return _table(rows(shape, "cuda", torch.bfloat16), timed, torch.cuda.get_device_name())


def _table(cases, timed, device: str) -> int:
    import triton

    print(f"device: {device}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'kernel':<48} {'torch ms':>9} {'triton ms':>10} {'torch/triton':>13} {'max|diff|':>10}")
    with torch.inference_mode():
        for name, ref, tri in cases:
            a, b = ref(), tri()
            a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
            diff = max(((x.float() - y.float()).abs().max().item() for x, y in zip(a, b) if x is not None), default=0)
            t_ref, t_tri = timed(ref), timed(tri)
            print(f"{name:<48} {t_ref:>9.3f} {t_tri:>10.3f} {t_ref / t_tri:>12.2f}x {diff:>10.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
