"""Layers shared by the model families: linear, RMSNorms, RoPE, paged attention, gated MLP.

Activations are packed ``[T, ...]`` (all sequences of a step, varlen); only
``Attention`` looks at sequence boundaries, through
``kernels.attention.AttentionMetadata``. The math follows ``transformers``'
modeling files (named per class) operation for operation, so greedy outputs
match them token for token.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer import probe_cache
from deepinfer.kernels import cpu_gemv
from deepinfer.kernels.attention import AttentionMetadata, paged_attention, store_kvcache


class Linear(nn.Linear):
    """``nn.Linear`` that can run from a packed copy of its weight (CPU; fp32 or bf16).

    ``pack()`` stores the weight in a GEMM-ready layout, the one torch.compile's
    CPU freezing uses: MKL's for fp32 (``torch.ops.mkl._mkl_reorder_linear_weight``),
    oneDNN's for bf16 (``torch.ops.mkldnn._reorder_linear_weight``; AMX or
    AVX512-BF16 kernels where the CPU has them). Packed GEMM is faster than ``F.linear`` for few rows
    (decode: it skips re-packing the weight on every call) and slower for
    prefill-sized M, so rows above ``packed_max_rows`` use ``F.linear``. Where
    the two cross depends on the CPU and the shape (``tune_packed_rows``
    measures it; ``PACKED_MAX_ROWS`` until then). The packed layout does not
    depend on M. Costs one extra copy of the weight.

    Batch invariance: packed GEMM gives each row the same bits for any M >= 4
    (1-3 rows take another kernel on some CPUs; oneDNN's bf16 gave the same bits
    for 1-2,000 rows on an AMX host), for a given thread count; ``F.linear`` gives other bits
    for M < 16 and, for some shapes, for M = 129-192 too. So in batch-invariant
    mode (set per module by the engine) a packed layer always runs packed, and
    both pad to 16 rows: a row's result then never depends on how many other
    rows share the step.
    """

    PACKED_MAX_ROWS = 128
    INVARIANT_MIN_ROWS = 16
    packed_max_rows = PACKED_MAX_ROWS  # most rows run packed (per layer: ``tune_packed_rows``)
    batch_invariant = False
    packed: torch.Tensor | None = None
    # the weight as bf16 (a copy of an fp32 weight whose values are bf16 already, "bfloat16-weights";
    # a bf16 weight itself): steps of at most ``bf16w_max_rows`` rows read it through ``kernels.cpu_gemv``
    weight_bf16: torch.Tensor | None = None
    bias_f32: torch.Tensor | None = None
    bf16w_max_rows = 0

    def keep_bf16_weight(self) -> bool:
        """Ready the weight for ``kernels.cpu_gemv`` (steps of at most ``bf16w_max_rows`` rows); False
        (and nothing changes) where that kernel cannot run here or the weight is neither fp32 nor bf16
        on the CPU. An fp32 weight gets a bf16 copy: its values must be bf16 values already (``loader``
        "bfloat16-weights"), so the two copies hold the same numbers. A bf16 weight is read in place;
        its activations are widened to fp32 for the kernel and the result rounded back to bf16, as
        oneDNN's bf16 GEMM accumulates in fp32 and rounds its output."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or not cpu_gemv.available():
            return False
        self.weight_bf16 = w.detach().to(torch.bfloat16).contiguous()  # (no copy when bf16 already)
        self.bias_f32 = None if self.bias is None else self.bias.detach().float().contiguous()
        return True

    def pack(self) -> bool:
        """Build the packed weight; False (and nothing changes) where the weight is not on the CPU
        or no packed GEMM exists for its dtype here (fp32 needs MKL; bf16 oneDNN with bf16 support)."""
        w = self.weight
        if w.device.type != "cpu":
            return False
        if w.dtype == torch.float32 and torch.backends.mkl.is_available():
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), self.INVARIANT_MIN_ROWS)
            return True
        if w.dtype == torch.bfloat16 and bf16_gemm_supported():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
            return True
        return False

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, in_features] (the weight's dtype) through the packed weight: [M, out_features]."""
        if self.packed.dtype == torch.float32:
            return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, self.weight, self.bias, x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        m = x.shape[0]
        # NOTE: padded on the packed path too: MKL runs 1-3 rows through another kernel, whose
        # bits differ (seen on one AMD EPYC host, not on another)
        if self.batch_invariant and m < self.INVARIANT_MIN_ROWS:
            return self.forward(F.pad(x, (0, 0, 0, self.INVARIANT_MIN_ROWS - m)))[:m]
        if m <= self.bf16w_max_rows and self.weight_bf16 is not None:
            y = cpu_gemv.linear_bf16w(x.float(), self.weight_bf16, self.bias_f32)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        # NOTE: above packed_max_rows plain linear is faster but, for some shapes (M = 129-192
        # on the 1536->576 projection), gives other bits than packed: batch-invariant mode stays packed.
        if self.packed is None or (m > self.packed_max_rows and not self.batch_invariant):
            return F.linear(x, self.weight, self.bias)
        return self.packed_forward(x)


def bf16_gemm_supported() -> bool:
    """Whether oneDNN can run bf16 GEMMs on this CPU (AVX512-BF16/AMX, or AVX512 emulating them)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# (in_features, out_features, dtype, torch threads) -> measured ``Linear.packed_max_rows``, once per process
_PACKED_ROWS: dict[tuple, int] = {}
TUNE_ROWS = (8, 16, 24, 32, 48, 64, 96, 128)


def tune_packed_rows(layers: list[Linear], grid: tuple[int, ...] = TUNE_ROWS) -> dict[tuple[int, int], int]:
    """Set each packed layer's ``packed_max_rows`` to where packed GEMM stops being faster.

    Per weight shape (measured once per process and torch thread count, and kept for the next
    processes on this machine: ``probe_cache``): the M of ``grid``
    before the first at which ``F.linear`` beat the packed GEMM (best of 3 timed calls each on
    random rows [M, in_features] in the weight's dtype), or the last M of the grid if it never did; 0 when it
    already did at the first (then the packed copy is dropped: no step would use it). Returns
    (in_features, out_features) -> rows. Costs ~0.5 s for
    SmolLM2-135M's shapes on one thread.

    NOTE: the crossover is a property of the CPU. On one AMD EPYC host packed GEMM won up to
    128 rows on every SmolLM2 shape; on an Intel Xeon host (2026-12-02) ``F.linear`` won from
    24 rows on the 576 -> 49,152 LM head (51 against 113 ms at 128 rows) and from 48-64 on the
    MLP, so verify steps of speculative decoding (tens of rows through the head) ran at half
    speed on a fixed threshold.
    """
    threads = torch.get_num_threads()
    out: dict[tuple[int, int], int] = {}
    for layer in layers:
        if layer.packed is None:
            continue
        key = (layer.in_features, layer.out_features, layer.weight.dtype, threads)
        if key not in _PACKED_ROWS:
            _PACKED_ROWS[key] = probe_cache.measured(
                "packed_rows", [layer.in_features, layer.out_features, str(layer.weight.dtype), list(grid)],
                lambda: _measure_crossover(layer, grid))
        layer.packed_max_rows = out[key[:2]] = _PACKED_ROWS[key]
        if not layer.packed_max_rows:
            layer.packed = None  # never faster here: its memory back (a copy of the weight)
    return out


@torch.inference_mode()
def _measure_crossover(layer: Linear, grid: tuple[int, ...]) -> int:
    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    rows = 0
    for m in grid:
        x = torch.randn(m, layer.in_features, dtype=layer.weight.dtype)
        packed = best(lambda: layer.packed_forward(x))
        plain = best(lambda: F.linear(x, layer.weight, layer.bias))
        if plain < packed:
            break
        rows = m
    return rows


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))``, normalised in fp32, scaled in ``x``'s dtype (modeling_llama LlamaRMSNorm).

    ``backend`` "triton": ``kernels.triton_norm`` (set by ``kernels.select.use``)."""

    backend = "torch"

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            from deepinfer.kernels import triton_norm

            return triton_norm.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """``(1 + weight) * (x / rms(x))`` all in fp32, then cast (modeling_gemma3 Gemma3RMSNorm).

    The stored weight is zero-centred: a fresh norm is the identity.
    ``backend`` "triton": ``kernels.triton_norm`` (set by ``kernels.select.use``).
    """

    backend = "torch"

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            from deepinfer.kernels import triton_norm

            return triton_norm.rms_norm(x, self.weight, self.eps, gemma=True)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU / GeGLU (modeling_llama LlamaMLP, Gemma3MLP)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# --- rotary position embeddings (Su et al. 2021, RoFormer; HF modeling_rope_utils) ---

def rope_frequencies(params: dict, head_dim: int, device="cpu") -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] float32, attention factor) for one ``rope_parameters`` dict.

    Types: default, linear, llama3, yarn (Peng et al. 2023; the factor scales
    cos/sin). Raises NotImplementedError for others (dynamic, longrope...)
    rather than silently diverging.
    """
    d = head_dim
    base = params["rope_theta"]
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
    inv = 1.0 / pos_freqs
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / params["factor"], 1.0
    if kind == "llama3":  # piecewise scaling of long wavelengths (Llama 3.1)
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old = params["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":  # modeling_rope_utils._compute_yarn_parameters
        return _yarn(params, d, pos_freqs)
    raise NotImplementedError(f"rope_type {kind!r} not supported")


def _yarn(params: dict, d: int, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by ``factor``, keep high ones, linear ramp between."""
    base, factor = params["rope_theta"], params["factor"]
    old = params["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # prevent a singular ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=pos_freqs.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attn


def rope_tables(inv_freq: torch.Tensor, max_positions: int,
                attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim] float32 (rotate-half layout: frequencies repeated),
    scaled by ``attention_factor`` (YaRN; 1 otherwise)."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if attention_factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, D] -> x rotated by each token's position."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Self-attention over the paged KV cache: q/k/v projections, optional
    per-head q/k RMSNorm before RoPE (Qwen3, Gemma 3), RoPE, cache write,
    paged attention (optionally windowed, optionally with per-head sink
    logits), output projection.

    forward(x [T, hidden], cos [T, 1, D], sin [T, 1, D], meta) -> [T, hidden].
    ``sliding_window`` W: each query sees only keys at positions > q_pos - W
    (HF masking_utils ``sliding_window_overlay``). ``rope`` names the
    cos/sin table this layer uses (families with per-layer RoPE bases).
    ``backend`` "triton": rotary, KV store and attention run the ``kernels.triton_*``
    kernels (set by ``kernels.select.use``).
    """

    backend = "torch"

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: type[nn.Module] | None = None,
                 eps: float = 1e-6, scale: float | None = None, sliding_window: int | None = None,
                 rope: str = "default", sinks: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.rope = rope
        self.q_proj = Linear(hidden, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(head_dim, eps)
            self.k_norm = qk_norm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        # GPT-OSS: one learned logit per head that joins each softmax denominator.
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        # Set by the model runner: this layer's views into the KV cache, and which
        # KV group's metadata it reads (0 = full pool, 1 = sliding-window pool).
        self.kv_group = 0
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, cos, sin, meta: AttentionMetadata | list[AttentionMetadata]):
        if isinstance(meta, list):  # one per KV group
            meta = meta[self.kv_group]
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.backend == "triton":
            return self.o_proj(self._triton_attention(q, k, v, cos, sin, meta).reshape(t, -1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, window=self.sliding_window,
                            sinks=self.sinks)
        return self.o_proj(o.reshape(t, -1))

    def _triton_attention(self, q, k, v, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        from deepinfer.kernels import triton_attention, triton_cache, triton_rotary

        q, k = triton_rotary.apply_rope(q, k, cos, sin)
        triton_cache.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return triton_attention.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale,
                                                window=self.sliding_window, sinks=self.sinks)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (Llama, Qwen, Mistral).

    ``backend`` "triton": the first residual add runs inside the second norm's kernel
    (``kernels.triton_norm.fused_add_rms_norm``)."""

    backend = "torch"

    def __init__(self, self_attn: Attention, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, cos, sin, meta):
        if self.backend == "triton" and type(self.post_attention_layernorm) is RMSNorm:
            from deepinfer.kernels import triton_norm

            h = self.self_attn(self.input_layernorm(x), cos, sin, meta)
            norm = self.post_attention_layernorm
            n, x = triton_norm.fused_add_rms_norm(x, h, norm.weight, norm.eps)
            return x + self.mlp(n)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def layer_window(raw: dict, i: int) -> int | None:
    """Sliding window of layer ``i`` from a HF config dict, None for full attention.

    ``layer_types`` (HF 4.54+) decides per layer. Configs without it window
    every layer when ``sliding_window`` is set (Mistral), unless
    ``use_sliding_window`` says otherwise (Qwen2/Qwen3 keep a dormant value).
    """
    window = raw.get("sliding_window") or None
    types = raw.get("layer_types")
    if types is not None:
        return window if types[i] == "sliding_attention" else None
    return window if raw.get("use_sliding_window", True) else None


def embed_scale(hidden: int, device="cpu") -> torch.Tensor:
    """sqrt(hidden) rounded to fp32 like Gemma's ``embed_scale`` buffer (0-dim)."""
    return torch.tensor(math.sqrt(hidden), dtype=torch.float32, device=device)
