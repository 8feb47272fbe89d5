"""DeepInferConnector (deepinfer.engine.vllm_connector): KV blocks saved by one vLLM engine are loaded by another.

Three engine processes, in order (each a fresh vLLM engine, so nothing comes from vLLM's own prefix cache):
  1. with the connector, max_tokens=1: prompts A and B (first 200 tokens: a reuse source) and C (whole:
     a prefill whose first token is handed off); saves each prompt's first full block;
  2. (after B's block file is corrupted) with the connector, 16 tokens: A and B whole (260 tokens; loads
     A's block, finds B's corrupt: a miss, recomputed, not an error; saves what it computed), and C plus
     its first token from 1 (a decode worker after the prefill->decode handoff: loads C's block);
  3. without the connector, A, B and C: the reference. Greedy outputs of 2 (C: 1's first token, then 2's)
     must match 3 token for token.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_engine
from texts import TEXT_A, TEXT_B, TEXT_C

from deepinfer.kvstore import BlockStore
from deepinfer.kvstore.hashing import block_hashes, model_fingerprint

FIRST, FULL, NEW_TOKENS = 200, 260, 16


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    a, b = (tok(t)["input_ids"][:FULL] for t in (TEXT_A, TEXT_B))
    c = tok(TEXT_C)["input_ids"]
    assert len(a) == len(b) == FULL
    tmp = tmp_path_factory.mktemp("vllm")
    root = tmp / "kv"
    first = run_engine(model_dir, [a[:FIRST], b[:FIRST], c], 1, root, tmp)
    bs = first["connector"]["block_size"]
    assert bs <= FIRST - 1, f"block size {bs}: the prompts hold no full block"
    fingerprint = model_fingerprint(model_dir, "float32", bs, "vllm-cpu")
    files = {f.stem: f for f in (root / fingerprint).rglob("*.kvb")}
    key_b = block_hashes(b[:bs], bs, fingerprint)[0]
    store = BlockStore(root, fingerprint)
    pristine_b = store.get(key_b)
    corrupt = bytearray(files[key_b].read_bytes())
    corrupt[-8] ^= 0xFF  # payload byte: the checksum no longer matches
    files[key_b].write_bytes(bytes(corrupt))
    handoff = c + first["outputs"][2]["token_ids"]
    second = run_engine(model_dir, [a, b, handoff], NEW_TOKENS, root, tmp)
    reference = run_engine(model_dir, [a, b, c], NEW_TOKENS, None, tmp)
    return dict(model_dir=model_dir, a=a, b=b, c=c, bs=bs, root=root, fingerprint=fingerprint, files=files,
                store=store, key_b=key_b, pristine_b=pristine_b, first=first, second=second, reference=reference)


def test_first_engine_saves_full_prompt_blocks_under_our_hashes(runs):
    bs, fp = runs["bs"], runs["fingerprint"]
    assert fp != model_fingerprint(runs["model_dir"], "float32", bs)  # never the native engine's directory
    expected = {block_hashes(p, bs, fp)[0] for p in (runs["a"][:FIRST], runs["b"][:FIRST], runs["c"])}
    assert set(runs["files"]) == expected
    assert runs["first"]["connector"]["blocks_saved"] == 3
    assert runs["first"]["connector"]["blocks_loaded"] == 0


def test_second_engine_loads_the_prefix_and_matches_a_run_without_connector(runs):
    second, reference = runs["second"], runs["reference"]
    assert second["connector"]["blocks_loaded"] == 2  # A's and C's blocks (B's is corrupt)
    assert second["outputs"][0]["num_cached_tokens"] == runs["bs"]
    assert reference["outputs"][0]["num_cached_tokens"] == 0
    assert len(reference["outputs"][0]["token_ids"]) == NEW_TOKENS
    assert second["outputs"][0]["token_ids"] == reference["outputs"][0]["token_ids"]


def test_prefill_decode_handoff_through_the_store_matches_a_single_process_run(runs):
    """Prefill (engine 1: C's first token, its blocks saved) -> decode (engine 2: C + that token, the
    stored prefix loaded, the partial last block recomputed) == engine 3's 16 tokens of C."""
    prefill, decode, reference = runs["first"], runs["second"], runs["reference"]
    assert decode["outputs"][2]["num_cached_tokens"] == runs["bs"] * ((len(runs["c"])) // runs["bs"])
    streamed = prefill["outputs"][2]["token_ids"] + decode["outputs"][2]["token_ids"][:NEW_TOKENS - 1]
    assert streamed == reference["outputs"][2]["token_ids"]


def test_corrupt_block_is_a_miss_recomputed_and_saved_again(runs):
    counters, store, bs = runs["second"]["connector"], runs["store"], runs["bs"]
    assert counters["load_errors"] == 1
    assert runs["second"]["outputs"][1]["token_ids"] == runs["reference"]["outputs"][1]["token_ids"]
    # saved here: A's second block, B's first (recomputed) and second: both prompts' two full blocks now verify
    assert counters["blocks_saved"] == 3
    for p in (runs["a"], runs["b"]):
        for key in block_hashes(p[:2 * bs], bs, runs["fingerprint"]):
            assert store.get(key) is not None
    resaved = store.get(runs["key_b"])
    assert resaved.shape == runs["pristine_b"].shape
    assert torch.allclose(resaved, runs["pristine_b"], atol=1e-4, rtol=1e-4)
