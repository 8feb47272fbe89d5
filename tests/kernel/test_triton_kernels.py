"""Triton kernels against their torch references, and the engine on either path.

Where they run: on a CUDA machine natively (scripts/gpu_check.sh); on a CPU under
the Triton interpreter, which must be on before triton is first imported (its
``triton.jit`` decides at decoration time, triton's own library included), so a
plain ``pytest`` run skips this module and ``test_triton_interpreter.py`` runs it
in a child process with TRITON_INTERPRET=1: the variable never reaches the other
test modules' process. Shapes are tiny: the interpreter runs every program in Python.

Tolerances (max |triton - torch|), as the kernels' docstrings state: fp32 attention
2e-5; fp32 norm / rotary / MoE 1e-5 of the output scale; fp16/bf16 ~2e-2 of it.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("on a CPU these run under the Triton interpreter, in a child process started by "
                "test_triton_interpreter.py", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (it is in the test extra: pip install -e '.[test]')")

from deepinfer.kernels import select  # noqa: E402
from deepinfer.kernels import triton_attention as ta  # noqa: E402
from deepinfer.kernels import triton_cache as tc  # noqa: E402
from deepinfer.kernels import triton_moe as tm  # noqa: E402
from deepinfer.kernels import triton_norm as tn  # noqa: E402
from deepinfer.kernels import triton_rotary as tr  # noqa: E402
from deepinfer.kernels.attention import build_metadata, paged_attention, store_kvcache  # noqa: E402
from deepinfer.models.layers import GemmaRMSNorm, RMSNorm, apply_rope, rope_frequencies, rope_tables  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
# NOTE: the interpreter casts fp32 -> bf16 by truncation, not round-to-nearest as GPUs and
# torch do (measured: x + h differs by an ulp), so half-precision checks use fp16 there
HALF = torch.bfloat16 if CUDA else torch.float16


def _close(out, ref, tol):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max |diff| {err:.3g} > {tol:g}"


# --- KV store and paged attention ---------------------------------------------------------

def _paged_case(query_lens, context_lens, bs, h, hkv, d, *, dtype=torch.float32, first_blocks=None,
                key_starts=None, spare_blocks=0, seed=0):
    """Caches with each sequence's blocks scattered (``spare_blocks`` allocated but empty
    blocks after each table's last), the cached context stored, this step's K/V to store."""
    g = torch.Generator().manual_seed(seed)
    nb = [-(-c // bs) + spare_blocks for c in context_lens]
    perm = torch.randperm(sum(nb) + 3, generator=g).tolist()  # + blocks no one owns
    tables = [[perm.pop() for _ in range(n)] for n in nb]
    if first_blocks:  # released blocks of a sliding-window group
        tables = [[-1] * f + t[f:] for t, f in zip(tables, first_blocks)]
    shape = (len(perm) + sum(nb), bs, hkv, d)
    k_cache = torch.randn(shape, generator=g).to(dtype)  # garbage everywhere not written
    v_cache = torch.randn(shape, generator=g).to(dtype)
    cached = [c - q for q, c in zip(query_lens, context_lens)]
    kept = [c - f * bs for c, f in zip(cached, first_blocks or [0] * len(cached))]  # in blocks still held
    if sum(kept):
        prev = build_metadata(kept, cached, tables, bs, first_blocks=first_blocks)
        store_kvcache(torch.randn(sum(kept), hkv, d, generator=g).to(dtype),
                      torch.randn(sum(kept), hkv, d, generator=g).to(dtype), k_cache, v_cache, prev.slot_mapping)
    meta = build_metadata(query_lens, context_lens, tables, bs, first_blocks=first_blocks, key_starts=key_starts)
    t = sum(query_lens)
    new = [torch.randn(t, hkv, d, generator=g).to(dtype) for _ in range(2)]
    q = torch.randn(t, h, d, generator=g).to(dtype)
    return q, k_cache, v_cache, new, meta


@pytest.mark.parametrize("bs,dtype", [(4, torch.float32), (16, torch.float32), (8, torch.bfloat16)])
def test_store_kvcache_writes_exactly_the_mapped_slots(bs, dtype):
    q, kc, vc, (k, v), meta = _paged_case([5, 1, 9], [5, 17, 24], bs, 4, 2, 16, dtype=dtype)
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kvcache(k, v, ref_k, ref_v, meta.slot_mapping)
    kc, vc = kc.to(DEVICE), vc.to(DEVICE)
    tc.store_kvcache(k.to(DEVICE), v.to(DEVICE), kc, vc, meta.slot_mapping.to(DEVICE), block_t=4)
    assert torch.equal(kc.cpu(), ref_k) and torch.equal(vc.cpu(), ref_v)  # untouched slots too


def test_store_kvcache_skips_negative_slots_and_empty_steps():
    kc, vc = torch.randn(3, 4, 2, 16, device=DEVICE), torch.randn(3, 4, 2, 16, device=DEVICE)
    before = kc.clone()
    k = torch.randn(2, 2, 16, device=DEVICE)
    tc.store_kvcache(k, k, kc, vc, torch.tensor([5, -1], device=DEVICE))
    assert torch.equal(kc.view(-1, 2, 16)[5], k[0])
    kc.view(-1, 2, 16)[5] = before.view(-1, 2, 16)[5]
    assert torch.equal(kc, before)
    tc.store_kvcache(k[:0], k[:0], kc, vc, torch.tensor([], dtype=torch.long, device=DEVICE))
    assert torch.equal(kc, before)


ATTENTION_CASES = {
    # name: (query_lens, context_lens, block_size, H, Hkv, window, sinks, tiles (block_m, block_n), extra)
    # decode, GQA 2, contexts ending mid-block, on a block edge (full last block) and at 1 token
    "decode_gqa2": ([1, 1, 1, 1], [5, 16, 1, 29], 8, 4, 2, None, False, (None, None), {}),
    # a prefill chunk over a cached prefix, a whole prompt and a decode; GQA 4; tiles across blocks
    "prefill_gqa4_prefix": ([7, 12, 1], [19, 12, 30], 4, 8, 2, None, False, (16, 8), {}),
    # sliding window 5 (shorter than a tile) on mixed lengths, block size not a power of two
    "window_mixed_bs6": ([6, 1, 3], [6, 25, 14], 6, 4, 2, 5, False, (16, 16), {}),
    # GPT-OSS: sinks on every head, MHA, window and a 16-token block; allocated but empty blocks
    "sinks_window_mha": ([1, 4, 1], [9, 20, 33], 16, 2, 2, 8, True, (16, 16), {"spare_blocks": 1}),
    "sinks_full_gqa4": ([3, 1], [3, 21], 8, 4, 1, None, True, (None, 16), {}),
    # a long prefill under a short window: one query tile spans many windows (its first query's
    # keys start well before its last one's), so the tile's key range must start at its first query
    "window_long_prefill_tile": ([20, 1], [20, 11], 4, 2, 1, 3, False, (16, 4), {}),
    # window group of a hybrid model: leading blocks released, a replay start (key_starts)
    "released_blocks_replay": ([1, 3], [22, 30], 4, 4, 2, 6, False, (None, 8),
                               {"first_blocks": [3, 5], "key_starts": [10, 25]}),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention_matches_reference(case):
    query_lens, context_lens, bs, h, hkv, window, sinks, (bm, bn), extra = ATTENTION_CASES[case]
    q, kc, vc, (k, v), meta = _paged_case(query_lens, context_lens, bs, h, hkv, 16, **extra)
    store_kvcache(k, v, kc, vc, meta.slot_mapping)
    s = torch.randn(h, generator=torch.Generator().manual_seed(3)) * 2 if sinks else None
    ref = paged_attention(q, kc, vc, meta, 0.25, window=window, sinks=s)
    out = ta.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), meta, 0.25, window=window,
                             sinks=None if s is None else s.to(DEVICE), block_m=bm, block_n=bn)
    _close(out.cpu(), ref, 2e-5)


def test_paged_attention_half_precision():
    q, kc, vc, (k, v), meta = _paged_case([4, 1], [10, 23], 8, 4, 2, 16, dtype=HALF)
    store_kvcache(k, v, kc, vc, meta.slot_mapping)
    ref = paged_attention(q.float(), kc.float(), vc.float(), meta, 0.25, window=6).to(HALF)
    out = ta.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), meta, 0.25, window=6, block_n=16)
    _close(out.cpu(), ref, 2e-2)


def test_paged_attention_refuses_heads_not_a_multiple_of_kv_heads():
    q, kc, vc, _, meta = _paged_case([1], [4], 4, 3, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        ta.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), meta, 0.25)


# --- RMSNorm, rotary --------------------------------------------------------------------

@pytest.mark.parametrize("norm_cls,dtype,n", [(RMSNorm, torch.float32, 48), (RMSNorm, HALF, 64),
                                              (GemmaRMSNorm, torch.float32, 40), (GemmaRMSNorm, torch.float16, 64)])
def test_rms_norm_matches_reference(norm_cls, dtype, n):
    g = torch.Generator().manual_seed(0)
    norm = norm_cls(n, 1e-6).to(dtype).requires_grad_(False)
    norm.weight.copy_(torch.randn(n, generator=g))
    x = (torch.randn(37, n, generator=g) * 3).to(dtype)
    tol = 1e-5 * 4 if dtype == torch.float32 else 2e-2 * 8  # ~|out| <= 4 (fp32), one ulp of ~8 (half)
    gemma = norm_cls is GemmaRMSNorm
    out = tn.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-6, gemma=gemma, block_rows=8)
    _close(out.cpu(), norm(x), tol)
    # a q/k norm: [T, H, D] over the last dim, rows not a multiple of block_rows
    head = norm_cls(n // 2, 1e-6).to(dtype).requires_grad_(False)
    head.weight.copy_(norm.weight[: n // 2])
    xh = x.view(37, 2, n // 2)
    _close(tn.rms_norm(xh.to(DEVICE), head.weight.to(DEVICE), 1e-6, gemma=gemma).cpu(), head(xh), tol)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_fused_add_rms_norm_matches_add_then_norm(dtype):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(64, 1e-5).to(dtype).requires_grad_(False)
    norm.weight.copy_(torch.randn(64, generator=g))
    x, h = torch.randn(2, 21, 64, generator=g).to(dtype)
    x0, h0 = x.clone(), h.clone()
    out, total = tn.fused_add_rms_norm(x.to(DEVICE), h.to(DEVICE), norm.weight.to(DEVICE), 1e-5, block_rows=4)
    assert torch.equal(total.cpu(), x + h)  # the residual sum is exact
    _close(out.cpu(), norm(x + h), 4e-5 if dtype == torch.float32 else 6e-2)
    assert torch.equal(x, x0) and torch.equal(h, h0)  # inputs untouched


@pytest.mark.parametrize("dtype,rope", [(torch.float32, {"rope_type": "default", "rope_theta": 10000.0}),
                                        (HALF, {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                          "original_max_position_embeddings": 32})])
def test_rotary_matches_reference(dtype, rope):
    g = torch.Generator().manual_seed(2)
    d = 32
    inv, factor = rope_frequencies(rope, d)
    cos_t, sin_t = rope_tables(inv, 256, factor)
    pos = torch.tensor([0, 1, 7, 30, 31, 200, 5])
    cos, sin = cos_t[pos].to(dtype)[:, None], sin_t[pos].to(dtype)[:, None]
    q, k = torch.randn(7, 6, d, generator=g).to(dtype), torch.randn(7, 2, d, generator=g).to(dtype)
    oq, ok = tr.apply_rope(q.to(DEVICE), k.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), block_r=8)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    _close(oq.cpu(), apply_rope(q, cos, sin), tol)
    _close(ok.cpu(), apply_rope(k, cos, sin), tol)


# --- MoE ------------------------------------------------------------------------------------

def test_grouped_gemm_matches_per_slot_matmul_with_empty_slots():
    g = torch.Generator().manual_seed(4)
    slots = torch.tensor([3, 0, 3, 3, 0, 3, 5, 3, 3, 3, 0])  # slots 1, 2, 4 get no pairs
    p, r, kdim, n = slots.numel(), 6, 24, 40
    a = torch.randn(9, kdim, generator=g)
    rows = torch.randint(0, 9, (p,), generator=g)
    w = torch.randn(r, n, kdim, generator=g)  # nn.Linear layout [R, out, in]: passed as a view
    bias, scale = torch.randn(r, n, generator=g), torch.rand(p, generator=g)
    bm = 16 if CUDA else 4  # the interpreter takes blocks a GPU's tl.dot refuses: several blocks per slot
    pair_of_row, block_slot = tm.align_by_slot(slots, r, bm)
    assert (pair_of_row >= 0).sum() == p and sorted(pair_of_row[pair_of_row >= 0].tolist()) == list(range(p))
    out = tm.grouped_gemm(a.to(DEVICE), rows.to(DEVICE), pair_of_row.to(DEVICE), block_slot.to(DEVICE),
                          w.to(DEVICE).transpose(1, 2), bias.to(DEVICE), scale.to(DEVICE), num_pairs=p, block_m=bm,
                          block_n=16, block_k=16)
    ref = torch.stack([(a[rows[i]] @ w[slots[i]].T + bias[slots[i]]) * scale[i] for i in range(p)])
    _close(out.cpu(), ref, 1e-4)


def _qwen_moe_block(shared: bool):
    from deepinfer.models.moe import SparseMoeBlock

    torch.manual_seed(5)
    block = SparseMoeBlock(32, 24, num_experts=6, top_k=2, norm_topk_prob=True,
                           shared_intermediate=16 if shared else 0).requires_grad_(False)
    for p in block.parameters():
        p.normal_(0, 0.3)
    return block


def _gpt_oss_block():
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.gpt_oss import GptOssMLP

    cfg = ModelConfig("gpt_oss", 64, 32, 24, 1, 2, 2, 16, 1e-5, 64, False,
                      raw={"num_local_experts": 6, "num_experts_per_tok": 2, "swiglu_limit": 1.0})  # a limit that clamps
    torch.manual_seed(6)
    block = GptOssMLP(cfg).requires_grad_(False)
    for p in block.parameters():
        p.normal_(0, 0.3)
    block.init_buffers()
    return block


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_moe_block_triton_matches_torch_with_replicas(family):
    block = _qwen_moe_block(shared=True) if family == "qwen2_moe" else _gpt_oss_block()
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(7))
    outs = {}
    for backend in ("torch", "triton"):
        block.init_buffers()  # identity placement, counters at zero
        block.backend = backend
        first = block(x)
        # replicas: expert 0 and 3 twice, 8 slots over 2 ranks; round-robin splits their tokens
        phy2log = torch.tensor([0, 1, 2, 0, 3, 4, 5, 3])
        log2phy = torch.tensor([[0, 3], [1, -1], [2, -1], [4, 7], [5, -1], [6, -1]])
        block.apply_placement(phy2log, log2phy, torch.tensor([2, 1, 1, 2, 1, 1]), num_ranks=2)
        outs[backend] = (first, block(x), block.expert_counts.clone(), block.rank_counts.clone())
        block.apply_placement(torch.arange(6), torch.arange(6)[:, None], torch.ones(6, dtype=torch.long), 1)
    (t1, t2, tcnt, trank), (g1, g2, gcnt, grank) = outs["torch"], outs["triton"]
    scale = t1.abs().max().item()
    _close(g1, t1, 1e-5 * max(1.0, scale))
    _close(g2, t2, 1e-5 * max(1.0, scale))
    assert torch.equal(gcnt, tcnt) and torch.equal(grank, trank)
    assert trank.tolist()[0] > 0 and trank.tolist()[1] > 0  # both ranks computed pairs


# --- selection -----------------------------------------------------------------------------

def test_selection_setting(monkeypatch):
    monkeypatch.delenv(select.ENV, raising=False)
    assert select.resolve(None, "cpu") == "torch"  # auto on a CPU: the reference
    assert select.resolve("torch", "cuda") == "torch"
    assert select.resolve("auto", "cuda") == "triton"  # auto where the model is on CUDA
    monkeypatch.setenv(select.ENV, "triton")
    assert select.requested() == "triton" and select.requested("torch") == "torch"  # an explicit setting wins
    if select.interpreted():  # this module built the kernels for the interpreter
        assert select.resolve(None, "cpu") == "triton"
    monkeypatch.setattr(select, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select.resolve("triton", "cpu")
    with pytest.raises(ValueError, match="kernels must be one of"):
        select.resolve("cuda", "cpu")


def test_selection_sets_every_module_with_a_triton_path():
    from deepinfer.models.layers import Attention, DecoderLayer, GatedMLP

    layer = DecoderLayer(Attention(32, 4, 2, 8, qk_norm=RMSNorm), GatedMLP(32, 48), 32, 1e-6)
    model = torch.nn.ModuleList([layer, _qwen_moe_block(shared=False), GemmaRMSNorm(32, 1e-6)])
    select.use(model, "triton")
    with_path = [m for m in model.modules() if hasattr(type(m), "backend")]
    assert len(with_path) == 8  # layer, attn, its q/k norms, 2 layer norms, MoE block, Gemma norm
    assert all(m.backend == "triton" for m in with_path)
    select.use(model, "torch")
    assert all(m.backend == "torch" for m in with_path)


# --- the engine on both paths ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    """A random GPT-OSS checkpoint: 2 layers (sliding window 4, full), sinks, GQA 2, 4 experts
    top-2, YaRN RoPE. Written from our own model class (transformers' import and init would
    take most of this module's time under the interpreter's budget)."""
    import json

    from safetensors.torch import save_file

    from deepinfer.models.config import ModelConfig
    from deepinfer.models.gpt_oss import GptOssForCausalLM

    path = tmp_path_factory.mktemp("gpt_oss_triton")
    (path / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"], "eos_token_id": 0,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                            "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False}}))
    torch.manual_seed(0)
    model = GptOssForCausalLM(ModelConfig.from_dir(path))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("layernorm.weight") or name == "model.norm.weight"
                    else 0.2 * torch.randn_like(p))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


@pytest.mark.skipif(CUDA, reason="the engine runs on the CPU: its Triton path there needs TRITON_INTERPRET=1 "
                                  "(scripts/gpu_check.sh runs this test so)")
def test_engine_greedy_output_identical_on_torch_and_triton_kernels(tiny_gpt_oss):
    from deepinfer.engine.interface import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.models.layers import Attention

    from model_helpers import engine_greedy, prompts

    ps = prompts(256, [3, 13])
    outs = {}
    for kernels in ("torch", "triton"):
        # block 4 < the 13-token prompt's 8-token chunks: cached-prefix prefill, released window blocks
        engine = LLMEngine(tiny_gpt_oss, EngineConfig(block_size=4, kv_cache_bytes=1 << 20, kernels=kernels,
                                                      max_num_batched_tokens=8, async_scheduling=False))
        assert engine.kernels == kernels
        assert all(a.backend == kernels for a in engine.model.modules() if isinstance(a, Attention))
        outs[kernels] = engine_greedy(engine, ps, 5)
    assert outs["triton"] == outs["torch"]
    assert len({t for o in outs["torch"] for t in o}) >= 4  # random weights, yet not one repeated token
