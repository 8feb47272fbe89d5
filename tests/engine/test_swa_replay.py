"""SWA bounded replay on tiny random hybrid Gemma 3 models.

The storage tier keeps the full layers' blocks only; a prefix hit rebuilds the
window layers' state from the engine's window pool, the host SWA state cache
(exact) or by replaying the prefix's last W tokens (bounded replay), or
recomputes it (exact mode). Two models: the usual interleaving (window layers
below and above the full one: replay is an approximation) and one whose only
window layer sits on top of the full ones, where bounded replay is exact by
construction (every input of that layer at replayed positions comes from full
layers, which attend to the cold run's cached KV), so its tokens must equal
the cold run's.
"""


import pytest
import torch

from deepinfer.engine.kv_layout import KVLayout
from deepinfer.engine.interface import EngineConfig, RequestError
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.swa_cache import SWAStateCache
from deepinfer.kernels.attention import build_metadata
from deepinfer.kvstore import BlockStore, block_hashes, ephemeral_key
from deepinfer.kvstore.store import EPHEMERAL, is_ephemeral
from deepinfer.prefill.service import PrefillService
from deepinfer.protocol import DecodeRequest, PrefillRequest, SamplingParams
from model_helpers import hf_greedy_uncached, prompts, save_tiny

BS = 8
WINDOW = 12  # not a multiple of the block size: the replay starts inside a block
NEW_TOKENS = 10
PREFIX = 64  # 8 blocks; the replay feeds tokens [52, 64) again


def tiny_gemma3(tmp_path_factory, name, layer_types):
    from transformers import Gemma3TextConfig

    path = tmp_path_factory.mktemp(name)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        initializer_range=0.05, sliding_window=WINDOW, layer_types=layer_types,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        query_pre_attn_scalar=24,
    )
    return path, save_tiny(path, config)


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory):
    return tiny_gemma3(tmp_path_factory, "gemma3-interleaved",
                       ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def window_on_top(tmp_path_factory):
    return tiny_gemma3(tmp_path_factory, "gemma3-window-on-top",
                       ["full_attention", "full_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def texts():
    """A shared document (``PREFIX`` tokens), two prompts asking about it, and a second turn of
    the first conversation (the first prompt, its answer, a follow-up)."""
    prefix, a, b, c = prompts(512, [PREFIX, 9, 11, 13], seed=7)
    return prefix, prefix + a, prefix + b, prefix + a + c


def engine(path, **kw):
    return LLMEngine(path, EngineConfig(block_size=BS, kv_cache_bytes=4 << 20, **kw))


def run(eng, rid, ids, n=NEW_TOKENS, mode=None):
    """Greedy ``n`` tokens; (tokens, the first StepOutput: prefix path, replayed tokens, KV export)."""
    eng.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, swa_replay=mode))
    tokens, first = [], None
    while eng.has_unfinished():
        for o in eng.step():
            first = first or o
            tokens += o.new_token_ids
    return tokens, first


def store_prompt(path, store, ids):
    """A cold prefill-only run of ``ids`` whose whole blocks go to the tier as prefill stores them
    (full layers only); returns the export (StepOutput) and the prefix hashes."""
    pre = engine(path, prefill_only=True)
    _, out = run(pre, "cold", ids, n=1)
    hashes = block_hashes(ids, BS, pre.fingerprint)
    for i, h in enumerate(hashes[: out.num_exact_blocks]):
        store.put(h, pre.kv_layout.full_part(out.kv_blocks[i]), num_tokens=BS)
    return out, hashes


def load_from_store(eng, store, hashes):
    """The prefill worker's load: stored blocks -> staging -> ``load_prefix``."""
    cfg = eng.model_config
    staging = torch.empty(len(hashes), len(eng.kv_layout.full_layers), 2, BS, cfg.num_key_value_heads,
                          cfg.head_dim)
    got = store.read_prefix_into(hashes, "chat", staging)
    return eng.load_prefix(hashes[:got], staging[:got])


def full_pool_blocks(eng, hashes):
    """The full layers' KV of the cached blocks ``hashes``: [n, num_full_layers, 2, BS, Hkv, D]."""
    ids = [eng.block_manager.cached[h] for h in hashes]
    return eng.runner.kv_cache[:, :, ids].permute(2, 0, 1, 3, 4, 5).clone()


def test_storage_tier_holds_full_layers_only_and_they_load_bit_for_bit(interleaved, texts, tmp_path):
    """Prefix files carry the full layer's KV only (1 of 4 layers here), and what a
    bounded replay leaves in the full pool is the cold run's KV, bit for bit: replayed
    positions never overwrite it."""
    path, _ = interleaved
    _, p1, p2, _ = texts
    probe = engine(path)
    store = BlockStore(tmp_path, probe.fingerprint)
    out, hashes = store_prompt(path, store, p1)
    n = PREFIX // BS
    cold_full = torch.stack([probe.kv_layout.full_part(b) for b in out.kv_blocks[:n]])
    header_shape = list(store.get(hashes[0]).shape)
    assert header_shape == [1, 2, BS, 2, 32]  # [full layers, K/V, tokens, KV heads, head dim]
    assert store.get(hashes[0]).numel() * 4 == probe.block_bytes  # the engine's own block bytes agree
    b = engine(path)
    assert load_from_store(b, store, hashes[:n]) == n
    assert torch.equal(full_pool_blocks(b, hashes[:n]), cold_full)
    tokens, first = run(b, "b", p2, mode="bounded")
    assert first.prefix_path == "bounded_replay" and first.num_replayed_tokens == WINDOW
    assert torch.equal(full_pool_blocks(b, hashes[:n]), cold_full)  # untouched by the replay
    cold = run(engine(path), "c", p2)[0]
    assert len(tokens) == len(cold) == NEW_TOKENS


def test_window_state_from_the_swa_cache_gives_the_cold_runs_tokens(interleaved, texts, tmp_path):
    """A prefill worker ran turn 1 (p1): the window state at the end of its whole blocks is in
    the SWA state cache. Both pools are evicted, the full layers of turn 2's prefix come back
    from the storage tier, and turn 2 (p3, extending p1) is an exact reuse: the cold run's tokens."""
    path, hf = interleaved
    _, p1, _, p3 = texts
    b = engine(path, prefill_only=True)
    store = BlockStore(tmp_path, b.fingerprint)
    _, out = run(b, "turn-1", p1, n=1)
    hashes = block_hashes(p1, BS, b.fingerprint)
    for i, h in enumerate(hashes):  # as prefill stores them: whole blocks, full layers only
        store.put(h, b.kv_layout.full_part(out.kv_blocks[i]), num_tokens=BS)
    assert len(b.swa_cache) == 2  # blocks 7, 8: a query at position 72 sees keys 61..72
    b.block_manager.reset_prefix_cache()  # both pools evicted; the host SWA cache survives
    assert b.cached_prefix_blocks(hashes) == 0
    assert load_from_store(b, store, hashes) == len(hashes)
    before = b.num_computed_tokens_total
    _, first = run(b, "turn-2", p3, n=1, mode="bounded")
    hit = len(hashes) * BS
    assert first.prefix_path == "swa_cache" and first.num_cached_tokens == hit
    assert b.num_computed_tokens_total - before == len(p3) - hit
    assert b.swa_cache.hits == 2
    colocated = engine(path)
    load_from_store(colocated, store, hashes)
    colocated.kv.swa_cache = b.swa_cache  # the same host cache, on an engine that decodes too
    colocated.block_manager.swa_cache = b.swa_cache
    tokens, first = run(colocated, "turn-2", p3)
    assert first.prefix_path == "swa_cache"
    assert tokens == run(engine(path), "cold", p3)[0] == hf_greedy_uncached(hf, p3, NEW_TOKENS)


def test_bounded_replay_feeds_the_last_window_and_exact_mode_recomputes(interleaved, texts, tmp_path):
    path, hf = interleaved
    _, p1, p2, _ = texts
    store = BlockStore(tmp_path, engine(path).fingerprint)
    _, hashes = store_prompt(path, store, p1)
    n = PREFIX // BS
    replay = engine(path)
    load_from_store(replay, store, hashes[:n])
    tokens, first = run(replay, "b", p2)  # the engine's default mode: bounded
    assert first.prefix_path == "bounded_replay"
    assert first.num_cached_tokens == PREFIX - WINDOW and first.num_replayed_tokens == WINDOW
    assert replay.num_computed_tokens_total == WINDOW + len(p2) - PREFIX + NEW_TOKENS - 1
    assert replay.block_manager.prefix_paths["bounded_replay"] == 1
    # approximate KV never becomes shared: not cached, not in the SWA state cache
    assert replay.cached_prefix_blocks(block_hashes(p2, BS, replay.fingerprint)) == n
    assert len(replay.swa_cache) == 0
    exact = engine(path, swa_replay="bounded")
    load_from_store(exact, store, hashes[:n])
    tokens, first = run(exact, "b", p2, mode="exact")  # the request overrides the server
    assert first.prefix_path == "exact_recompute" and first.num_replayed_tokens == 0
    assert exact.num_computed_tokens_total == len(p2) + NEW_TOKENS - 1
    assert tokens == hf_greedy_uncached(hf, p2, NEW_TOKENS)


def test_keys_before_the_replay_start_never_count(interleaved, texts, tmp_path):
    """The replay starts inside a window block (position 52 of block 6): that block's slots
    for positions 48-51 hold whatever the pool held before. Filling the window pool with
    garbage first changes no bit of the logprobs."""
    path, _ = interleaved
    _, p1, p2, _ = texts
    store = BlockStore(tmp_path, engine(path).fingerprint)
    _, hashes = store_prompt(path, store, p1)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=5)
    outs = []
    for garbage in (False, True):
        b = engine(path)
        load_from_store(b, store, hashes[: PREFIX // BS])
        if garbage:
            b.runner.window_kv_cache.normal_(std=10.0)
        b.add_request("b", p2, sp)
        steps = []
        while b.has_unfinished():
            steps += [(o.prefix_path, o.new_token_ids, o.wire_logprobs()) for o in b.step()]
        outs.append(steps)
    assert outs[0][0][0] == "bounded_replay" and outs[0] == outs[1]


def test_replay_rebuilds_the_first_window_layer_exactly_and_the_others_approximately(interleaved, texts, tmp_path):
    """Layer 0 (a window layer) sees only its own token, so its replayed KV equals the cold run's;
    layer 1 attends over the truncated window, so its KV differs: the approximation is real here."""
    path, _ = interleaved
    _, p1, p2, _ = texts
    store = BlockStore(tmp_path, engine(path).fingerprint)
    _, hashes = store_prompt(path, store, p1)
    n = PREFIX // BS
    cold = engine(path, prefill_only=True, batch_invariant=True)
    cold_kv = run(cold, "c", p2, n=2)[1].kv_blocks  # a handoff: every block [blocks, layers, 2, BS, Hkv, D]
    b = engine(path, prefill_only=True, batch_invariant=True)
    load_from_store(b, store, hashes[:n])
    out = run(b, "b", p2, n=2)[1]
    assert out.prefix_path == "bounded_replay" and out.num_exact_blocks == n
    rows = slice((PREFIX - WINDOW) // BS + 1, out.kv_blocks.shape[0] - 1)  # whole blocks from the replay on
    replayed, reference = out.kv_blocks[rows], cold_kv[rows]
    assert torch.allclose(replayed[:, 0], reference[:, 0], atol=1e-5)
    assert not torch.allclose(replayed[:, 1], reference[:, 1], atol=1e-3)


def test_bounded_replay_is_exact_when_the_window_layer_sits_on_top(window_on_top, texts, tmp_path):
    """Every input of the top window layer at a replayed position comes from full layers
    attending to the cold run's cached KV, so the replay rebuilds its exact state."""
    path, hf = window_on_top
    _, p1, p2, _ = texts
    store = BlockStore(tmp_path, engine(path).fingerprint)
    _, hashes = store_prompt(path, store, p1)
    b = engine(path)
    load_from_store(b, store, hashes[: PREFIX // BS])
    tokens, first = run(b, "b", p2, mode="bounded")
    assert first.prefix_path == "bounded_replay" and first.num_replayed_tokens == WINDOW
    assert tokens == hf_greedy_uncached(hf, p2, NEW_TOKENS)


def test_replayed_handoff_reaches_decode_with_window_parts_and_exact_blocks_only_stored(interleaved, texts,
                                                                                       tmp_path):
    """Prefill (bounded replay) -> storage tier -> decode, through the workers' KV connector's block
    writing and reading: exact whole blocks under their prefix hash (full layers only), the blocks
    computed after the replay and the window layers' parts as ephemeral blocks; decode joins
    them and continues exactly as the prefill engine would have."""
    path, _ = interleaved
    _, p1, p2, _ = texts
    pre = engine(path, prefill_only=True)
    store = BlockStore(tmp_path, pre.fingerprint)
    _, hashes = store_prompt(path, store, p1)
    n = PREFIX // BS
    load_from_store(pre, store, hashes[:n])
    first, out = run(pre, "r1", p2, n=2)
    assert out.prefix_path == "bounded_replay" and out.finish_reason == "handoff"
    req = PrefillRequest("r1", p2, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), "s")
    keys, window_keys, stored = pre.kv_connector(None, store, None, None)._write_prompt(req, out)
    assert keys[:n] == hashes[:n] == stored and all(is_ephemeral(k) for k in keys[n:])
    assert window_keys[out.first_window_block] == ephemeral_key("r1", out.first_window_block, part="w")
    assert not any(window_keys[: out.first_window_block])
    assert not store.contains(block_hashes(p2, BS, pre.fingerprint)[n])  # approximate: never stored
    handoff = DecodeRequest("r1", p2, first, req.sampling, "s", keys, out.num_kv_tokens, BS,
                            window_block_keys=window_keys, num_exact_blocks=out.num_exact_blocks)
    dec = engine(path)
    kv, complete = dec.kv_connector(None, store, None, None).read_blocks(handoff)
    assert complete and torch.equal(kv, out.kv_blocks)
    assert not any(store.contains(k, EPHEMERAL) for k in keys[n:] + [k for k in window_keys if k])
    dec.add_request("r1", p2, req.sampling, output_token_ids=first, kv_blocks=kv, num_kv_tokens=out.num_kv_tokens,
                    num_exact_tokens=n * BS)
    rest = []
    while dec.has_unfinished():
        for o in dec.step():
            rest += o.new_token_ids
    same = engine(path)
    load_from_store(same, store, hashes[:n])
    assert first + rest == run(same, "one-engine", p2)[0]  # the same replay, no handoff
    assert dec.cached_prefix_blocks(block_hashes(p2 + first + rest, BS, dec.fingerprint)) == n


def test_the_prefix_path_is_a_trace_attribute(interleaved, texts, tmp_path, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import deepinfer.prefill.service as prefill_service

    path, _ = interleaved
    _, p1, p2, _ = texts
    store = BlockStore(tmp_path, engine(path).fingerprint)
    _, hashes = store_prompt(path, store, p1)
    b = engine(path, prefill_only=True)
    load_from_store(b, store, hashes[: PREFIX // BS])
    out = run(b, "r", p2, n=2)[1]
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(prefill_service, "tracer", lambda: provider.get_tracer("test"))
    req = PrefillRequest("r", p2, SamplingParams(), "s")
    PrefillService.record_spans(prefill_service.PrefillJob(req, req.attempt, None), out)
    (span,) = exporter.get_finished_spans()
    assert span.name == "prefill.prefix" and span.attributes["deepinfer.prefix.path"] == "bounded_replay"
    assert span.attributes["deepinfer.prefix.replayed_tokens"] == WINDOW
    assert span.attributes["deepinfer.prefix.cached_tokens"] == PREFIX - WINDOW
    assert span.attributes["deepinfer.prefill.chunks"] == len(out.chunk_times) >= 1


def test_preempted_or_resumed_sequences_recompute_exactly(interleaved, texts, tmp_path):
    """A request with tokens already generated (resumed after a failure) never replays."""
    path, hf = interleaved
    _, p1, p2, _ = texts
    store = BlockStore(tmp_path, engine(path).fingerprint)
    _, hashes = store_prompt(path, store, p1)
    reference = hf_greedy_uncached(hf, p2, NEW_TOKENS)
    b = engine(path)
    load_from_store(b, store, hashes[: PREFIX // BS])
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    b.add_request("resumed", p2, sp, output_token_ids=reference[:3])
    out, first = [], None
    while b.has_unfinished():
        for o in b.step():
            first = first or o
            out += o.new_token_ids
    assert first.prefix_path == "exact_recompute"
    assert reference[:3] + out == reference


def test_bad_swa_replay_values_are_refused(interleaved):
    path, _ = interleaved
    with pytest.raises(RequestError, match="swa_replay"):
        engine(path).add_request("x", [1, 2, 3], SamplingParams(swa_replay="fast"))
    with pytest.raises(ValueError, match="swa_replay"):
        engine(path, swa_replay="approximate")


def test_window_key_start_masks_keys_before_the_replay():
    """A sequence replaying from position 10 (inside block 1 of 4-token blocks) attends no
    window key before 10, however early its query; another sequence is unaffected."""
    meta = build_metadata([6, 6], [16, 16], [[-1, 1, 2, 3], [4, 5, 6, 7]], block_size=4,
                          first_blocks=[1, 0], key_starts=[10, 0])
    m = meta.mask(8)[:, 0]  # [B, Tq, L]; sequence 0's key axis starts at position 4
    assert (meta.key_positions[0][m[0, 0]]).tolist() == [10]  # query at position 10 sees itself only
    assert (meta.key_positions[0][m[0, 5]]).tolist() == list(range(10, 16))
    assert (meta.key_positions[1][m[1, 0]]).tolist() == list(range(3, 11))


def test_swa_state_cache_is_an_lru_bounded_in_bytes():
    block = torch.zeros(3, 2, 4, 1, 8)  # 768 bytes
    cache = SWAStateCache(capacity_bytes=3 * 768)
    for h in "abc":
        assert cache.put(h, block.clone())
    assert cache.get("a") is not None  # refreshed: "b" is now the oldest
    cache.put("d", block.clone())
    assert "b" not in cache and cache.has_all(["a", "c", "d"]) and cache.nbytes == 3 * 768
    assert cache.evictions == 1 and cache.get("b") is None and (cache.hits, cache.misses) == (1, 1)
    assert not cache.put("big", torch.zeros(4 * 768 // 4))  # larger than the whole cache: not kept
    assert len(cache) == 3


def test_kv_layout_splits_and_joins_blocks():
    layout = KVLayout(4, (0, 1, 3))
    block = torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3)
    full, window = layout.full_part(block), layout.window_part(block)
    assert full.shape[0] == 1 and torch.equal(full[0], block[2]) and torch.equal(window[2], block[3])
    assert torch.equal(layout.join(full, window), block)
    assert layout.join(full, None)[[0, 1, 3]].abs().sum() == 0
    with pytest.raises(ValueError):
        layout.join(window, full)
    assert KVLayout(2).full_part(block) is block
