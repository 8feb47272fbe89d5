"""``--dtype auto``: the weights and KV cache dtype, chosen by timing this CPU's GEMMs.

Whether bf16 beats fp32 is a property of the CPU, not of the model: on a CPU with
AMX and AVX512-BF16 oneDNN's bf16 GEMM ran 2-10x faster than fp32 on
SmolLM2-135M's shapes (even at 1 row: the LM head 2.2 against 7.1 ms), while a
CPU without native bf16 emulates it and loses. So the engine times, at start-up,
the linear layers of the model it is about to load (random weights of the same
shapes, through the same ``Linear`` and packed GEMM the engine runs) in fp32 and
in bf16, at a decode-sized, a verify-sized and a prefill-sized row count, and
takes bf16 when it is clearly faster overall (``BF16_MAX_RATIO``). The choice and
its figures are logged by the caller. Workers of one mesh choose apart: for a
choice that cannot differ between them, pass the dtype explicitly.

Attention, norms and sampling follow the weights' dtype (logits are always fp32),
so this also halves the KV cache's bytes per block; the storage tier's
fingerprint includes the dtype, so a bf16 block is never read as fp32.

Where "auto" stays at fp32 (a CPU without bf16 GEMMs, e.g. AVX2 only), a third
choice is timed once the model is loaded: "bfloat16-weights" (every weight
rounded to bf16, activations and KV cache in fp32; decode-sized steps read the
linear weights from bf16 copies through ``kernels.cpu_gemv``, half the bytes
of fp32: decode there is bound by memory bandwidth). ``choose_bf16_weight_rows``
times passes of 1, 2, 4... rows through every linear layer of the model (all of
them, so the weights stream from memory as in a real step, not from cache) on
both paths and takes it when the 1-row pass is clearly faster.

Where "auto" (or the caller) chose bf16, the same kernel is timed against oneDNN's
bf16 GEMM for decode-sized steps: on a CPU with AVX512-BF16 but no AMX oneDNN's
1-row bf16 GEMM was slower than fp32's, while the kernel reads the same bf16
weights at memory speed. Only the kernel changes there (the weights and the KV
cache stay bf16), so it is taken wherever its 1-row pass is faster at all.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from deepinfer import probe_cache
from deepinfer.kernels import cpu_gemv
from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import Linear, bf16_gemm_supported
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

PROBE_ROWS = (1, 16, 256)  # decode, a speculative verify step, a prefill chunk
# bf16 only when clearly faster: workers of one mesh time the probe apart (on shared cores), and a
# CPU near parity must not give them different dtypes (a storage tier each: no handoff would hit)
BF16_MAX_RATIO = 0.8
MAX_PROBE_OUT = 16384  # wider layers (the LM head) are timed at this width and scaled: bounds the memory

# (in_features, out_features, how many the model has)
Shape = tuple[int, int, int]


@dataclass
class DtypeChoice:
    """dtype: "float32" or "bfloat16"; reason: one line for the log; seconds: per dtype, per
    row count of ``PROBE_ROWS``, the model's linear layers' summed time (s); empty when
    nothing was timed."""

    dtype: str
    reason: str
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)

    def log_fields(self) -> dict:
        return {"dtype": self.dtype, "reason": self.reason,
                "probe_ms": {d: {m: round(s * 1e3, 3) for m, s in t.items()} for d, t in self.seconds.items()}}


def linear_shapes(cfg: ModelConfig) -> list[Shape]:
    """The dense linear layers of one forward pass: attention projections and MLP per layer, the LM head."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    return [(h, q, n), (h, kv, 2 * n), (q, h, n), (h, i, 2 * n), (i, h, n), (h, cfg.vocab_size, 1)]


def time_linears(shapes: list[Shape], dtype: torch.dtype, rows: tuple[int, ...] = PROBE_ROWS) -> dict[int, float]:
    """Seconds one pass of ``rows`` rows through every layer of ``shapes`` takes in ``dtype``
    (best of 3 per shape after a warm-up, times its count), per row count. Layers are packed
    as the engine packs them (``Linear.pack``) and run with its default packed-rows cut.
    Timed once per machine and settings (``probe_cache``)."""
    seconds = probe_cache.measured("linears", [shapes, str(dtype), list(rows)],
                                   lambda: list(_time_linears(shapes, dtype, rows).values()))
    return dict(zip(rows, seconds))


@torch.inference_mode()
def _time_linears(shapes: list[Shape], dtype: torch.dtype, rows: tuple[int, ...]) -> dict[int, float]:
    total = {m: 0.0 for m in rows}
    for fan_in, fan_out, count in shapes:
        width = min(fan_out, MAX_PROBE_OUT)
        layer = Linear(fan_in, width, bias=False).to(dtype)
        layer.pack()
        for m in rows:
            x = torch.randn(m, fan_in, dtype=dtype)
            layer(x)
            best = math.inf
            for _ in range(3):
                t = time.perf_counter()
                layer(x)
                best = min(best, time.perf_counter() - t)
            total[m] += best * count * fan_out / width
    return total


def choose_dtype(cfg: ModelConfig, requested: str = "auto", batch_invariant: bool = False,
                 bf16_supported: Callable[[], bool] | None = None,
                 probe: Callable[[list[Shape], torch.dtype], dict[int, float]] | None = None) -> DtypeChoice:
    """Resolve ``requested`` ("auto", "float32", "bfloat16" or "float16") for a model of config ``cfg``.

    An explicit dtype is kept. "auto" is "float32" when oneDNN has no bf16 GEMM here or in
    batch-invariant mode (its bitwise guarantees are measured on fp32's packed GEMM), else
    "bfloat16" when the geometric mean over ``PROBE_ROWS`` of bf16's / fp32's summed time is below
    ``BF16_MAX_RATIO``, else "float32". ``probe`` (default ``time_linears``) and
    ``bf16_supported`` (default ``bf16_gemm_supported``) let tests fake a CPU. Raises ValueError
    for an unknown dtype name.
    """
    bf16_supported = bf16_supported or bf16_gemm_supported
    probe = probe or time_linears
    if requested != "auto":
        if requested not in ("float32", "bfloat16", "float16", "bfloat16-weights"):
            raise ValueError(f"dtype must be auto, float32, bfloat16, bfloat16-weights or float16, not {requested!r}")
        if requested == "bfloat16-weights" and batch_invariant:
            raise ValueError("batch-invariant mode runs float32, not bfloat16-weights")
        return DtypeChoice(requested, "asked for")
    if batch_invariant:
        return DtypeChoice("float32", "batch-invariant mode runs fp32")
    if not bf16_supported():
        return DtypeChoice("float32", "no bf16 GEMM on this CPU (oneDNN)")
    shapes = linear_shapes(cfg)
    seconds = {"float32": probe(shapes, torch.float32), "bfloat16": probe(shapes, torch.bfloat16)}
    ratios = {m: seconds["bfloat16"][m] / seconds["float32"][m] for m in seconds["float32"]}
    mean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    per_rows = ", ".join(f"{m} rows {r:.2f}x" for m, r in ratios.items())
    dtype = "bfloat16" if mean < BF16_MAX_RATIO else "float32"
    return DtypeChoice(dtype, f"bf16/fp32 GEMM time on the model's shapes: {per_rows} (geomean {mean:.2f})",
                       seconds)


BF16W_ROWS = (1, 4, 8, 16, 32)  # row counts timed for the bf16-weights cut


@dataclass
class Bf16WeightsChoice:
    """max_rows: steps of at most this many rows read bf16 weights (0: not chosen); reason: one log
    line; seconds: {rows: (fp32 pass, bf16-weights pass)}."""

    max_rows: int
    reason: str
    seconds: dict[int, tuple[float, float]] = field(default_factory=dict)

    def log_fields(self) -> dict:
        return {"bf16_weights_max_rows": self.max_rows, "reason": self.reason,
                "probe_ms": {m: [round(a * 1e3, 2), round(b * 1e3, 2)] for m, (a, b) in self.seconds.items()}}


def choose_bf16_weight_rows(time_pass: Callable[[int, bool], float], rows: tuple[int, ...] = BF16W_ROWS,
                            baseline: str = "fp32", first_max_ratio: float = BF16_MAX_RATIO) -> Bf16WeightsChoice:
    """The row cut for ``kernels.cpu_gemv``: ``time_pass(m, bf16)`` (seconds of one pass of ``m``
    rows through the model's linear layers, through the kernel from bf16 weights or on the
    ``baseline`` path: the fp32 weights, or oneDNN's bf16 GEMM for a bf16 model) for each of
    ``rows`` (ascending) until the baseline is faster. max_rows is 0 unless the 1-row pass through
    the kernel took under ``first_max_ratio`` of the baseline's (``BF16_MAX_RATIO`` when the choice
    changes the weights' values, "bfloat16-weights"; 1.0 for a bf16 model, where only the kernel
    changes); else the largest timed count up to which the kernel was faster at every count."""
    seconds: dict[int, tuple[float, float]] = {}
    cut = 0
    for m in rows:
        base, bf16 = time_pass(m, False), time_pass(m, True)
        seconds[m] = (base, bf16)
        if bf16 >= (base * first_max_ratio if m == rows[0] else base):
            break
        cut = m
    ratios = ", ".join(f"{m} rows {b / a:.2f}x" for m, (a, b) in seconds.items())
    what = f"bf16-weights kernel/{baseline} pass time: {ratios}"
    if not cut:
        return Bf16WeightsChoice(0, f"{what}: {baseline} kept", seconds)
    return Bf16WeightsChoice(cut, f"{what}: bf16 weights up to {cut} rows", seconds)


def time_linear_pass(layers: list[Linear], m: int, bf16: bool, repeats: int = 2) -> float:
    """Seconds (best of ``repeats`` after a warm-up) of one pass of ``m`` random rows (the weights'
    dtype) through every layer of ``layers`` in order, each as the engine runs it: through
    ``kernels.cpu_gemv`` from ``Linear.weight_bf16`` when ``bf16``, else its own path (packed or
    plain). Timing all layers in turn streams the weights from memory, as a decode step does.
    Timed once per machine and settings (``probe_cache``)."""
    paths = [[layer.in_features, layer.out_features, layer.packed is not None, layer.packed_max_rows] for layer in layers]
    key = [hashlib.sha256(json.dumps(paths).encode()).hexdigest()[:24], len(layers), str(layers[0].weight.dtype), m,
           bf16, repeats]
    return probe_cache.measured("linear_pass", key, lambda: _time_linear_pass(layers, m, bf16, repeats))


@torch.inference_mode()
def _time_linear_pass(layers: list[Linear], m: int, bf16: bool, repeats: int) -> float:
    dtype = layers[0].weight.dtype
    inputs = {n: torch.randn(m, n, dtype=dtype) for n in {layer.in_features for layer in layers}}
    saved = [layer.bf16w_max_rows for layer in layers]
    for layer in layers:
        layer.bf16w_max_rows = m if bf16 else 0

    def one_pass():
        for layer in layers:
            layer(inputs[layer.in_features])

    try:
        one_pass()
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            one_pass()
            best = min(best, time.perf_counter() - t)
        return best
    finally:
        for layer, rows in zip(layers, saved):
            layer.bf16w_max_rows = rows


@torch.inference_mode()
def apply_bf16_weights(model: torch.nn.Module, linears: list[Linear], dtype: str) -> tuple[Bf16WeightsChoice | None, str]:
    """Let decode-sized steps read the linear weights as bf16 through ``kernels.cpu_gemv`` where the
    start-up probe times them faster (``choose_bf16_weight_rows``): asked for ("bfloat16-weights":
    the weights are rounded already); tried under ``--dtype auto`` when it kept fp32 (the weights
    are then rounded in place once chosen, tied weights staying tied, and the dtype becomes
    "bfloat16-weights"); for a bf16 model, against oneDNN's bf16 GEMM (the weights as they are).
    Logged as ``bf16 weights chosen``. Returns the choice (None: no kernel here) and the dtype."""
    if not all([layer.keep_bf16_weight() for layer in linears]):
        for layer in linears:
            layer.weight_bf16 = layer.bias_f32 = None
        log.info("bf16 weights chosen", bf16_weights_max_rows=0,
                 reason=f"no bf16-weights kernel here: {cpu_gemv.unavailable_reason() or 'not a CPU model'}")
        return None, dtype
    time_pass = functools.partial(time_linear_pass, linears)
    choice = (choose_bf16_weight_rows(time_pass, baseline="bf16 GEMM", first_max_ratio=1.0)
              if dtype == "bfloat16" else choose_bf16_weight_rows(time_pass))
    log.info("bf16 weights chosen", **choice.log_fields())
    if not choice.max_rows:
        for layer in linears:
            layer.weight_bf16 = layer.bias_f32 = None
        return choice, dtype
    if dtype == "float32":
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(torch.bfloat16))
        for layer in linears:
            if layer.packed is not None:
                layer.pack()  # of the rounded values
        dtype = "bfloat16-weights"
    for layer in linears:
        layer.bf16w_max_rows = choice.max_rows
        if layer.packed_max_rows <= choice.max_rows:
            layer.packed = None  # every step it would serve reads the bf16 weights: its memory back
    return choice, dtype
