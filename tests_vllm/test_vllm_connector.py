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

from deepinfer.kvstore import BlockStore
from deepinfer.kvstore.hashing import block_hashes, model_fingerprint

TEXT_A = (
    "Marta had kept the lighthouse on the northern cape for eleven winters when the letter arrived. It was "
    "written in a careful, slanted hand she did not recognise, and it asked whether she remembered a boy who "
    "had once rowed out to the rocks during a storm to bring her a basket of oranges. She did remember him. "
    "He had been perhaps twelve, soaked through and laughing, and he had refused to stay for soup because his "
    "mother would worry. The letter said that he was now a ship's engineer, that his vessel would pass the "
    "cape on the last night of October, and that he wanted to signal her as they went by. Marta read it three "
    "times, folded it into her coat pocket, and climbed the spiral stairs to polish the great lens, although "
    "it was already clean. For the next two weeks she checked the weather charts every morning, repaired the "
    "cracked shutter on the lamp room, and practised the old signal code with a hand lantern in the kitchen, "
    "feeling slightly foolish each time. On the last night of October the sea was calm and the sky was full "
    "of stars. She made tea, wound the clock, and sat by the window with the lantern on her knees, listening to "
    "the slow breathing of the sea against the rocks below. Just after midnight she saw the lights of a "
    "freighter far out on the horizon, and then"
)
TEXT_B = (
    "To repair a leaking kitchen tap, first turn off the water supply under the sink and open the tap to drain "
    "the remaining water. Cover the plughole with a cloth so that small screws cannot fall into the drain. Prise "
    "off the decorative cap on top of the handle with a flat screwdriver, undo the screw beneath it, and lift "
    "the handle away. Use an adjustable spanner to loosen the packing nut, then unscrew the valve stem by hand. "
    "At the bottom of the stem you will find a rubber washer held in place by a brass screw; a washer that is "
    "flattened, cracked or hardened is the usual cause of a drip. Take the old washer to a hardware shop so that "
    "you can buy an exact match, because a washer that is even slightly too small will not seal. Fit the new "
    "washer, tighten the brass screw, and smear a little plumber's grease on the threads of the stem before "
    "reassembling everything in reverse order. Turn the water back on slowly and check for leaks around the "
    "packing nut. If the tap still drips after a new washer has been fitted, the valve seat itself may be worn, "
    "and you will need a seat-cutting tool, which can be hired cheaply, or a plumber. Keep the old parts in a "
    "labelled bag until the job is finished, and you will need"
)
TEXT_C = (
    "The committee met on Tuesday afternoon to review the plans for the new public library. The architect "
    "presented three designs: a long, low building of timber and glass beside the park; a tall brick tower "
    "on the site of the old post office; and a conversion of the disused railway shed near the river. Each "
    "design was discussed in turn. Members liked the timber building for its light and its gardens, but the "
    "treasurer worried about the cost of heating so much glass through the winter. The tower would hold the "
    "most books on the smallest plot, yet several people felt that a library should not look like an office. "
    "The railway shed drew the longest debate. It was the cheapest option, it would save a handsome old "
    "structure from demolition, and its high iron roof could shelter reading rooms, a café and a space for "
    "children's events. Against it, the site flooded every few years, and the access road was narrow and "
    "badly lit. After two hours the chair asked for a show of hands. Four members voted for the timber "
    "building, two for the tower, and five for the railway shed, on the condition that the flood defences "
    "along the river be raised first. The architect promised revised drawings within a month, and the "
    "meeting closed as the"
)
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
