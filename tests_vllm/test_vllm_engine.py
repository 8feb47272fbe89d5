"""VllmEngine (deepinfer.engine.vllm_engine): vLLM stepped in-process behind our request surface.

Refusals are checked without loading a model. Then three engine processes: a prefill-only VllmEngine
(first token, finish "handoff", blocks saved by the connector), a decode VllmEngine (prompt + that token
as ``output_token_ids``, the prefix loaded from the storage tier, tokens streamed step by step, one
request aborted mid-way) and vLLM's own ``LLM.generate`` without the connector as the reference.
"""

from __future__ import annotations

import json

import pytest
from conftest import run_engine, run_json, write_json
from texts import TEXT_A, TEXT_B, TEXT_C

from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.spec_decode import SpecConfig
from deepinfer.engine.vllm_engine import UnsupportedOnVllm, VllmEngine, unsupported
from deepinfer.kvstore.hashing import block_hashes, model_fingerprint

NEW_TOKENS = 12


@pytest.mark.parametrize("cfg, hf, needle", [
    (EngineConfig(block_size=128, speculative=SpecConfig("ngram", 5, "adaptive")), {}, "adaptive verification"),
    (EngineConfig(block_size=128, batch_invariant=True), {}, "--batch-invariant"),
    (EngineConfig(block_size=16), {}, "multiple of 32"),
    (EngineConfig(block_size=128), {"sliding_window": 512, "layer_types": ["sliding_attention"]}, "bounded SWA replay"),
    (EngineConfig(block_size=128), {"num_experts": 8}, "expert load balancing"),
    (EngineConfig(block_size=128), {"vision_config": {}, "text_config": {}}, "images"),
])
def test_mesh_features_vllm_lacks_are_refused_before_loading(tmp_path, cfg, hf, needle):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **hf}))
    with pytest.raises(UnsupportedOnVllm, match=needle):
        VllmEngine(tmp_path, cfg)  # no weights here: the refusal comes before vLLM loads anything


def test_the_default_model_and_config_are_accepted(model_dir):
    assert unsupported(EngineConfig(block_size=128), model_dir) == []
    # a prefill-only engine never speculates, so a worker-wide --speculative does not block it
    assert unsupported(EngineConfig(block_size=128, prefill_only=True, speculative=SpecConfig()), model_dir) == []


def test_min_tokens_fit_a_prefill_only_engine_and_count_the_streamed_tokens():
    """A prefill-only engine asks vLLM for 1 token: min_tokens 5 must not make vLLM refuse it (it raised
    ValueError: the gateway answered 500); after a handoff the streamed tokens count towards min_tokens."""
    from deepinfer.engine.vllm_engine import vllm_sampling
    from deepinfer.protocol import SamplingParams

    s = SamplingParams(max_tokens=16, min_tokens=5)
    assert vllm_sampling(s, 1).min_tokens == 1  # prefill: its one token may not be EOS either
    assert vllm_sampling(s, 15, streamed=1).min_tokens == 4  # decode after the handoff
    assert vllm_sampling(SamplingParams(max_tokens=16, min_tokens=16), 15, streamed=1).min_tokens == 15
    assert vllm_sampling(s, 10, streamed=6).min_tokens == 0


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    a, b, c = tok(TEXT_A)["input_ids"][:260], tok(TEXT_B)["input_ids"][:260], tok(TEXT_C)["input_ids"]
    tmp = tmp_path_factory.mktemp("vllm-engine")
    root = tmp / "kv"
    prefill = run_json("vllm_engine_run.py", [
        "--model", str(model_dir), "--kv-root", str(root), "--prefill-only", "--requests", str(write_json(tmp, [
            {"id": rid, "prompt": p, "output": [], "max_tokens": NEW_TOKENS} for rid, p in (("a", a), ("b", b),
                                                                                           ("c", c))]))])
    first = {rid: prefill["chunks"][rid][0][0] for rid in ("a", "b", "c")}
    # b's first block corrupted: decode is granted b's 2 blocks, their load fails, vLLM recomputes b
    fingerprint = model_fingerprint(model_dir, "float32", 128, "vllm-cpu")
    (f,) = [f for f in root.rglob("*.kvb") if f.stem == block_hashes(b, 128, fingerprint)[0]]
    corrupt = bytearray(f.read_bytes())
    corrupt[-8] ^= 0xFF
    f.write_bytes(bytes(corrupt))
    decode = run_json("vllm_engine_run.py", [
        "--model", str(model_dir), "--kv-root", str(root), "--requests", str(write_json(tmp, [
            {"id": "a", "prompt": a, "output": first["a"], "max_tokens": NEW_TOKENS},
            {"id": "b", "prompt": b, "output": first["b"], "max_tokens": NEW_TOKENS},
            {"id": "c", "prompt": c, "output": first["c"], "max_tokens": NEW_TOKENS},
            {"id": "x", "prompt": a[:50], "output": [], "max_tokens": NEW_TOKENS, "abort_after_steps": 3}]))])
    reference = run_engine(model_dir, [a, c, b], NEW_TOKENS, None, tmp)
    return dict(prefill=prefill, decode=decode, reference=reference, first=first, c=c)


def test_prefill_only_engine_samples_one_token_and_hands_off(runs):
    for rid in ("a", "b", "c"):
        assert runs["prefill"]["chunks"][rid] == [[runs["first"][rid], "handoff", 0]]
    assert not runs["prefill"]["unfinished"]


def test_decode_engine_streams_what_a_single_vllm_run_generates(runs):
    decode, reference = runs["decode"], runs["reference"]
    for i, rid in enumerate(("a", "c")):
        chunks = decode["chunks"][rid]
        assert len(chunks) == NEW_TOKENS - 1  # one token per step: streamed, not all at the end
        assert [ch[1] for ch in chunks] == [None] * (NEW_TOKENS - 2) + ["length"]
        assert chunks[0][2] > 0  # the stored prefix came from the storage tier
        streamed = runs["first"][rid] + [t for ch in chunks for t in ch[0]]
        assert streamed == reference["outputs"][i]["token_ids"]


def test_abort_stops_a_request_mid_stream(runs):
    decode = runs["decode"]
    assert decode["aborted"] == ["x"]
    assert 1 <= len(decode["chunks"]["x"]) <= 3 and all(ch[1] is None for ch in decode["chunks"]["x"])
    assert not decode["unfinished"]


def test_decode_engine_loaded_the_handed_off_blocks_and_reports_only_those(runs):
    """The equality above also holds when every load fails and vLLM recomputes (num_cached_tokens counts
    granted blocks): the worker-side counters prove the loads. ``prefix_hit_tokens`` (load reports) counts
    loaded blocks, not granted ones (b's 2 blocks were granted, failed and recomputed)."""
    decode, c = runs["decode"], runs["c"]
    assert decode["connector"] == {"blocks_loaded": 2 + len(c) // 128, "load_errors": 2}
    assert decode["prefix_hit_tokens"] == decode["connector"]["blocks_loaded"] * 128
    streamed = runs["first"]["b"] + [t for ch in decode["chunks"]["b"] for t in ch[0]]
    assert streamed == runs["reference"]["outputs"][2]["token_ids"]  # b: recomputed, still right
