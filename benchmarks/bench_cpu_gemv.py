"""The weight-only bf16 CPU kernel (libs/kernels/cpu_gemv) against torch's fp32 and bf16 GEMMs, on one thread.

What it measures: the time of one pass through every linear layer of SmolLM2-135M (30 layers of q 576->576,
k and v 576->192, o 576->576, gate and up 576->1536, down 1536->576; then the LM head 576->49152), i.e. the
GEMM part of one decode step, for M = 1, 2, 4, 8, 16 rows (tokens) at once. Every layer has its own weights,
allocated separately as in a real model, so a pass streams ~540 MB of fp32 (~270 MB of bf16) from memory,
not from cache: at decode sizes that traffic, not the arithmetic, sets the time. Side by side:

* ``mkl packed``: fp32, ``torch.ops.mkl._mkl_reorder_linear_weight(w, 16)`` once, then
  ``torch.ops.mkl._mkl_linear`` (what torch's CPU inference paths use for fp32 linears),
* ``fp32 linear``: ``F.linear`` on fp32 weights,
* ``bf16 linear``: ``F.linear`` with bf16 weights and bf16 activations (fast only with AVX512-BF16 / AMX),
* ``bf16 packed``: bf16, ``torch.ops.mkldnn._reorder_linear_weight`` once, then oneDNN's
  ``_linear_pointwise`` (what a bf16 engine runs; only where oneDNN has a bf16 GEMM),
* ``ours``: ``cpu_gemv.linear_bf16w`` (fp32 activations, bf16 weights, fp32 accumulation),
* ``ours bf16``: the same from bf16 activations to a bf16 result (widened before, rounded after: what a
  bf16 engine runs through the kernel).

Printed per M: ms per pass (best of ``--repeat`` after a warm-up pass; wall clock, or with ``--cpu-time``
this thread's CPU time, steadier on a machine shared with other work), the effective GB/s of ours, and
ours / fastest fp32 and ours bf16 / bf16 packed (< 1: ours faster). Before timing, each M checks ours against ``x @ w.float().T`` on one
layer (max |diff| printed), so a fast wrong kernel shows.

Run: ``.venv/bin/python benchmarks/bench_cpu_gemv.py [--rows 1,2,4,8,16] [--repeat 5]``: about a minute and
~1.4 GB of memory (fp32, MKL-packed and bf16 copies of the weights). The CPU must have avx2 + fma and a C
compiler (the kernel is built on first use); exits 2 otherwise. Timings on a shared machine are noisy: run
it twice.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

from deepinfer.kernels import cpu_gemv

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
# (in, out) per linear of one decoder layer: q, k, v, o, gate, up, down
LAYER_SHAPES = [(HIDDEN, 576), (HIDDEN, 192), (HIDDEN, 192), (576, HIDDEN), (HIDDEN, INTER), (HIDDEN, INTER),
                (INTER, HIDDEN)]


def best_ms(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()  # warm-up (first-touch, MKL's lazy init)
    b = math.inf
    for _ in range(repeat):
        t = clock()
        fn()
        b = min(b, clock() - t)
    return b * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16", help="comma-separated M values")
    ap.add_argument("--repeat", type=int, default=5, help="timed passes per method (best is kept)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with this thread's CPU time instead of the wall clock (a machine shared with "
                         "other work: leaves out the time other processes hold the core)")
    args = ap.parse_args()
    if not cpu_gemv.available():
        print(f"cpu_gemv unavailable: {cpu_gemv.unavailable_reason()}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    torch.manual_seed(0)
    clock = time.thread_time if args.cpu_time else time.perf_counter

    shapes = [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [(HIDDEN, VOCAB)]
    w32 = [torch.randn(n_out, n_in) * n_in ** -0.5 for n_in, n_out in shapes]  # one allocation per layer
    w16 = [w.bfloat16() for w in w32]
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, 16) for w in w32]
    bf16_gemm = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    packed16 = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in w16] if bf16_gemm else []
    n_weights = sum(w.numel() for w in w32)
    print(f"SmolLM2-135M linears: {len(shapes)} weights, {n_weights / 1e6:.1f} M parameters, "
          f"{4 * n_weights / 1e6:.0f} MB fp32 / {2 * n_weights / 1e6:.0f} MB bf16 per pass; 1 thread; "
          f"best of {args.repeat}, {'thread CPU time' if args.cpu_time else 'wall clock'}")
    print(f"{'M':>3} {'mkl packed':>11} {'fp32 linear':>12} {'bf16 linear':>12} {'bf16 packed':>12} {'ours':>8} "
          f"{'ours bf16':>10} {'ours GB/s':>10} {'ours/fp32':>10} {'bf16: ours/packed':>18} {'max|diff|':>10}")

    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}
        xs16 = {k: x.bfloat16() for k, x in xs.items()}
        ref = xs[INTER] @ w16[6].float().T
        diff = (cpu_gemv.linear_bf16w(xs[INTER], w16[6]) - ref).abs().max().item()

        def mkl_packed():
            for p, w in zip(packed, w32):
                torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, m)

        def fp32_linear():
            for w in w32:
                F.linear(xs[w.shape[1]], w)

        def bf16_linear():
            for w in w16:
                F.linear(xs16[w.shape[1]], w)

        def bf16_packed():
            for p, w in zip(packed16, w16):
                torch.ops.mkldnn._linear_pointwise(xs16[w.shape[1]], p, None, "none", [], "")

        def ours():
            f = cpu_gemv.linear_bf16w
            for w in w16:
                f(xs[w.shape[1]], w)

        def ours_bf16():
            f = cpu_gemv.linear_bf16w
            for w in w16:
                f(xs16[w.shape[1]].float(), w).to(torch.bfloat16)

        t = {name: best_ms(fn, args.repeat, clock) for name, fn in
             [("mkl", mkl_packed), ("fp32", fp32_linear), ("bf16", bf16_linear), ("ours", ours),
              ("ours16", ours_bf16)] + ([("packed16", bf16_packed)] if bf16_gemm else [])}
        gbs = 2 * n_weights / (t["ours"] / 1e3) / 1e9
        ratio = t["ours"] / min(t["mkl"], t["fp32"])
        p16 = f"{t['packed16']:>10.1f}ms" if bf16_gemm else f"{'-':>12}"
        r16 = f"{t['ours16'] / t['packed16']:>18.2f}" if bf16_gemm else f"{'-':>18}"
        print(f"{m:>3} {t['mkl']:>9.1f}ms {t['fp32']:>10.1f}ms {t['bf16']:>10.1f}ms {p16} {t['ours']:>6.1f}ms "
              f"{t['ours16']:>8.1f}ms {gbs:>10.1f} {ratio:>10.2f} {r16} {diff:>10.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
