"""The engine against Hugging Face transformers on the same weights (the embedded SmolLM2)."""

import dataclasses

import pytest
import torch

from deepinfer.engine.interface import EngineConfig, RequestError
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.models.convert import ensure_default_model
from deepinfer.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompts(hf):
    _, tok = hf
    texts = ["What is the capital of France?", "List three primary colors.",
             "Summarise this: " + "The quick brown fox jumps over the lazy dog. " * 12]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for t in texts]


def hf_greedy(hf, ids, n):
    model, _ = hf
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def run(engine, reqs, overlapped=False):
    """Run requests to completion; ``overlapped`` drives the engine with ``step_async``."""
    out = {rid: [] for rid, *_ in reqs}
    for rid, ids, sp in reqs:
        engine.add_request(rid, ids, sp)
    while engine.has_unfinished():
        for o in (engine.step_async() if overlapped else engine.step()):
            out[o.request_id] += o.new_token_ids
    return out


def test_batched_greedy_matches_transformers(model_dir, hf, prompts):
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20))
    out = run(engine, [(str(i), p, GREEDY) for i, p in enumerate(prompts)])
    assert engine.peak_batch_size == len(prompts)
    for i, p in enumerate(prompts):
        assert out[str(i)] == hf_greedy(hf, p, GREEDY.max_tokens), f"prompt {i}"


def test_prefill_export_then_decode_import_equals_one_engine(model_dir, prompts):
    """The disaggregated path in-process: KV leaves one engine and continues in another."""
    cfg = EngineConfig(kv_cache_bytes=64 << 20)
    whole = run(LLMEngine(model_dir, cfg), [("a", prompts[2], GREEDY)])["a"]
    pre = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, prefill_only=True))
    pre.add_request("a", prompts[2], GREEDY)
    (first,) = pre.step()
    assert first.finish_reason == "handoff" and first.num_kv_tokens == len(prompts[2])
    assert pre.kv_tokens_used == 0  # blocks freed after export
    dec = LLMEngine(model_dir, cfg)
    dec.add_request("a", prompts[2], GREEDY, output_token_ids=first.new_token_ids,
                    kv_blocks=first.kv_blocks, num_kv_tokens=first.num_kv_tokens)
    rest = []
    while dec.has_unfinished():
        for o in dec.step():
            rest += o.new_token_ids
    assert dec.num_steps == GREEDY.max_tokens - 1  # no prefill step: KV was imported
    assert first.new_token_ids + rest == whole


def test_preemption_under_tiny_kv_cache_keeps_outputs_exact(model_dir, prompts):
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20))
    expected = run(roomy, [(str(i), p, sp) for i, p in enumerate(prompts[:2])])
    # 6 blocks = 96 tokens of KV for two sequences of ~38 + 24 tokens (4 blocks each)
    tight = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=roomy.block_bytes * 6))
    out = run(tight, [(str(i), p, sp) for i, p in enumerate(prompts[:2])])
    assert tight.scheduler.num_preemptions > 0
    assert out == expected


def test_preemption_under_async_scheduling_keeps_outputs_exact(model_dir, prompts):
    """With a step in flight nothing is preempted; the engine waits for it, then preempts.
    (40 tokens each: the prompts share their first blocks, which the second one waits for and hits.)"""
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = run(LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20)),
                   [(str(i), p, sp) for i, p in enumerate(prompts[:2])])
    tight = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=LLMEngine(model_dir).block_bytes * 6))
    out = run(tight, [(str(i), p, sp) for i, p in enumerate(prompts[:2])], overlapped=True)
    assert tight.scheduler.num_preemptions > 0
    assert out == expected
    assert tight.block_manager.num_used_blocks == 0


def test_async_scheduling_matches_sync_and_transformers(model_dir, hf, prompts):
    """Mixed lengths, EOS stops, chunked prefill and a prefix-cache hit, with step t+1
    scheduled while step t runs: the same tokens as one step at a time and as HF."""
    _, tok = hf
    reqs = [(str(i), p, SamplingParams(temperature=0.0, max_tokens=n))
            for i, (p, n) in enumerate(zip(prompts + [prompts[2][:-3] + [28, 2]], [3, 24, 9, 17]))]
    # (16 tokens a step: chunks enough for 20+ steps, the prompts' shared system prompt computed once)
    cfg = dict(kv_cache_bytes=64 << 20, max_num_batched_tokens=16)
    sync = LLMEngine(model_dir, EngineConfig(**cfg))
    expected = run(sync, reqs)
    engine = LLMEngine(model_dir, EngineConfig(**cfg))
    out = run(engine, reqs, overlapped=True)
    assert out == expected
    for rid, ids, sp in reqs:
        ref = hf_greedy(hf, ids, sp.max_tokens)
        if tok.eos_token_id in ref:  # HF keeps padding after EOS; the engine stops at it
            ref = ref[: ref.index(tok.eos_token_id) + 1]
        assert out[rid] == ref, rid
    assert engine.block_manager.num_hit_tokens > 0  # the 4th prompt reused the 3rd's prefix
    assert engine.block_manager.num_used_blocks == 0  # every finished sequence freed its blocks
    # every step but the first was scheduled while the one before it ran
    assert engine.num_overlapped_steps == engine.num_steps - 1 and engine.num_steps > 20


def test_abort_while_a_step_is_in_flight_frees_blocks_after_it(model_dir, prompts):
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = run(LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20)), [("b", prompts[1], sp)])["b"]
    engine.add_request("a", prompts[0], sp)
    engine.add_request("b", prompts[1], sp)
    out = {"a": [], "b": []}
    for _ in range(4):
        for o in engine.step_async():
            out[o.request_id] += o.new_token_ids
    a = next(s for s in engine.scheduler.running if s.request_id == "a")
    assert a.num_inflight_steps == 1  # a forward pass that writes a's KV is running
    assert engine.abort("a")
    assert a.block_table  # not freed under the running forward pass
    while engine.has_unfinished():
        for o in engine.step_async():
            out[o.request_id] += o.new_token_ids
    assert not a.block_table and engine.block_manager.num_used_blocks == 0
    assert out["b"] == expected and 0 < len(out["a"]) < 12


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(model_dir, prompts):
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20))
    sp = lambda seed: SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=seed, ignore_eos=True)
    out = run(engine, [("a", prompts[0], sp(1)), ("b", prompts[0], sp(1)), ("c", prompts[0], sp(2))])
    assert out["a"] == out["b"] and out["a"] != out["c"]


def test_too_long_prompt_is_refused(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=16 << 20, max_model_len=64))
    with pytest.raises(RequestError):
        engine.add_request("x", list(range(64)), GREEDY)
    with pytest.raises(RequestError):
        engine.add_request("y", [], GREEDY)


def test_abort_frees_kv(model_dir, prompts):
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=16 << 20))
    engine.add_request("a", prompts[0], SamplingParams(temperature=0, max_tokens=100))
    engine.step()
    assert engine.kv_tokens_used > 0
    assert engine.abort("a") and engine.kv_tokens_used == 0 and not engine.has_unfinished()


def test_prefix_cache_hit_computes_only_new_tokens_and_matches_cold_run(model_dir, prompts):
    shared = prompts[2]  # ~100-token prompt
    other = shared[:-5] + [504, 3575, 314, 260, 2]  # same long prefix, different tail
    cold = run(LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20)), [("b", other, GREEDY)])["b"]
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20))
    run(engine, [("a", shared, GREEDY)])
    before = engine.num_computed_tokens_total
    engine.add_request("b", other, GREEDY)
    out = []
    first = True
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
            if first:
                cached = o.num_cached_tokens
                first = False
    assert cached == (len(shared) - 5) // 16 * 16 and cached >= 80
    # prompt tokens computed = only those after the cached blocks; then one per decode step
    assert engine.num_computed_tokens_total - before == (len(other) - cached) + (len(out) - 1)
    assert out == cold


@pytest.mark.parametrize("cfg", [dict(max_num_batched_tokens=24), dict(step_time_budget_s=0.02),
                                 dict(step_time_budget_s=0.2, calibrate=True)])
def test_chunked_prefill_matches_transformers(model_dir, hf, prompts, cfg):
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, **cfg))
    out = run(engine, [(str(i), p, GREEDY) for i, p in enumerate(prompts)])
    assert engine.num_steps > GREEDY.max_tokens  # prompts really were split over several steps
    for i, p in enumerate(prompts):
        assert out[str(i)] == hf_greedy(hf, p, GREEDY.max_tokens), f"prompt {i}"


def test_long_prompt_is_chunked_and_does_not_starve_a_short_one(model_dir, prompts):
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=128 << 20, step_time_budget_s=0.1,
                                               max_num_batched_tokens=512))
    engine.add_request("long", list(range(1000, 2500)), SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    engine.add_request("short", prompts[0], SamplingParams(temperature=0, max_tokens=2))
    firsts = []
    while engine.has_unfinished() and "short" not in firsts:
        firsts += [o.request_id for o in engine.step() if o.new_token_ids]
    assert firsts[0] == "short"  # the short prompt's first token came while the long one was still prefilling
    assert engine.scheduler.running[0].request_id == "long" and engine.scheduler.running[0].is_prefilling


def test_seeded_sampling_is_identical_across_the_prefill_decode_handoff(model_dir, prompts):
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=7, ignore_eos=True)
    whole = run(LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20)), [("a", prompts[1], sp)])["a"]
    pre = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, prefill_only=True))
    pre.add_request("a", prompts[1], sp)
    (first,) = pre.step()
    dec = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20))
    dec.add_request("a", prompts[1], sp, output_token_ids=first.new_token_ids, kv_blocks=first.kv_blocks,
                    num_kv_tokens=first.num_kv_tokens)
    rest = []
    while dec.has_unfinished():
        for o in dec.step():
            rest += o.new_token_ids
    assert first.new_token_ids + rest == whole


def run_with_logprobs(engine, reqs):
    out = {rid: [] for rid, *_ in reqs}
    for rid, ids, sp in reqs:
        engine.add_request(rid, ids, sp)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += [(t, lp.logprob, tuple(lp.top)) for t, lp in zip(o.new_token_ids, o.logprobs)]
    return out


@pytest.mark.parametrize("invariant,packed", [(True, True), (True, False), (False, False)])
def test_batch_invariant_mode_gives_identical_bits_alone_and_in_a_batch_of_16(model_dir, hf, invariant, packed):
    """Tokens and logprobs (bit for bit) of a request alone vs inside a batch of 16 of other lengths.

    With the mode off (and unpacked weights, whose GEMM bits depend on M) the
    bits differ, so the test can tell the mode works; with it on they are
    identical, with packed and with unpacked weights."""
    _, tok = hf
    topics = ["the sea", "a cat", "trains", "coffee", "winter", "music", "bees", "the moon", "chess", "rain",
              "bridges", "apples", "clocks", "deserts", "owls", "paper"]
    ps = [tok.apply_chat_template([{"role": "user", "content": f"Write about {t}. " * (1 + i % 5)}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
          for i, t in enumerate(topics)]
    assert len({len(p) for p in ps}) > 4  # different lengths
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3)
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=128 << 20, batch_invariant=invariant,
                                               packed_weights=packed, enable_prefix_caching=False))
    batched = run_with_logprobs(engine, [(str(i), p, sp) for i, p in enumerate(ps)])
    assert engine.peak_batch_size == 16
    same = [run_with_logprobs(engine, [(f"a{i}", ps[i], sp)])[f"a{i}"] == batched[str(i)] for i in (0, 7, 15)]
    assert all(same) if invariant else not all(same)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_seeded_sampling_ignores_the_cache_the_chunking_and_the_batch(model_dir, hf, dtype):
    """Seed 7, temperature 1, tokens and logprobs bit for bit: the prompt computed cold, from the
    prefix cache (only its last partial block computed), cut into 40-token chunks, next to other
    requests, and resumed on another engine after 4 tokens (a failover: the prompt and those tokens
    recomputed, the seed's draws for them replayed). With the mode off some of these differ, so the
    test can tell it works."""
    from deepinfer.models.layers import bf16_gemm_supported

    if dtype == "bfloat16" and not bf16_gemm_supported():
        pytest.skip("no bf16 GEMM on this CPU")
    _, tok = hf

    def chat(text):
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)

    p = chat("Summarise this: " + "The quick brown fox jumps over the lazy dog. " * 27)
    others = [chat(f"Write about {t}. " * n) for t, n in (("the sea", 1), ("trains", 4), ("owls", 9))]
    assert len(p) > 300 and len(p) % 16
    sp = SamplingParams(temperature=1.0, max_tokens=10, seed=7, ignore_eos=True, logprobs=True, top_logprobs=3)

    def outputs(invariant: bool) -> list:
        cfg = dict(kv_cache_bytes=64 << 20, batch_invariant=invariant, dtype=dtype)
        engine = LLMEngine(model_dir, EngineConfig(**cfg))
        cold = run_with_logprobs(engine, [("cold", p, sp)])["cold"]
        cached = run_with_logprobs(engine, [("cached", p, sp)])["cached"]
        assert engine.block_manager.num_hit_tokens == len(p) // 16 * 16
        chunked_engine = LLMEngine(model_dir, EngineConfig(**cfg, max_num_batched_tokens=40))
        chunked = run_with_logprobs(chunked_engine, [("chunked", p, sp)])["chunked"]
        assert chunked_engine.num_steps >= len(p) // 40
        batch = [("batched", p, sp)] + [(f"o{i}", o, dataclasses.replace(sp, seed=i)) for i, o in enumerate(others)]
        batched = run_with_logprobs(LLMEngine(model_dir, EngineConfig(**cfg)), batch)["batched"]
        resumed_engine = LLMEngine(model_dir, EngineConfig(**cfg))
        resumed_engine.add_request("resumed", p, sp, output_token_ids=[t for t, *_ in cold[:4]])
        resumed = cold[:4]
        while resumed_engine.has_unfinished():
            for o in resumed_engine.step():
                resumed += [(t, lp.logprob, tuple(lp.top)) for t, lp in zip(o.new_token_ids, o.logprobs)]
        return [cold, cached, chunked, batched, resumed]

    on = outputs(True)
    assert all(o == on[0] for o in on[1:]), [o == on[0] for o in on[1:]]
    off = outputs(False)
    assert not all(o == off[0] for o in off[1:])


def test_packed_rows_are_tuned_per_shape_and_route_the_gemm(monkeypatch):
    """``tune_packed_rows``: packed GEMM runs up to the measured crossover, ``F.linear`` above it.
    Here plain linear is made slow below 32 rows and free from 32 on, so the crossover must be
    24 (the grid point before 32); a second layer of the same shape is not measured again."""
    import time as _time

    import torch.nn.functional as F

    from deepinfer.models import layers
    from deepinfer.models.layers import Linear, tune_packed_rows

    torch.manual_seed(0)
    a, b = Linear(96, 80, bias=False), Linear(96, 80, bias=False)
    if not (a.pack() and b.pack()):
        pytest.skip("no MKL")
    real = F.linear
    plain_rows = []

    def fake_linear(x, w, bias=None):
        plain_rows.append(x.shape[0])
        if x.shape[0] < 32:
            _time.sleep(0.005)
            return real(x, w, bias)
        return x.new_zeros(x.shape[0], w.shape[0])  # "free": and visibly not the packed result

    monkeypatch.setattr(F, "linear", fake_linear)
    monkeypatch.setattr(layers, "_PACKED_ROWS", {})
    monkeypatch.setenv("DEEPINFER_PROBE_CACHE", "0")  # timed here, with the fake
    assert tune_packed_rows([a, b]) == {(96, 80): 24}
    assert a.packed_max_rows == b.packed_max_rows == 24
    measured = len(plain_rows)
    tune_packed_rows([b])
    assert len(plain_rows) == measured  # cached per shape
    x = torch.randn(40, 96)
    plain_rows.clear()
    assert torch.allclose(a(x[:24]), x[:24] @ a.weight.T, atol=1e-5) and plain_rows == []  # packed
    assert torch.equal(a(x), torch.zeros(40, 80)) and plain_rows == [40]  # above: F.linear
    a.batch_invariant = True  # batch-invariant mode never leaves the packed path
    assert torch.allclose(a(x), x @ a.weight.T, atol=1e-5)
    c = Linear(64, 48, bias=False)
    c.pack()
    monkeypatch.setattr(F, "linear", lambda x, w, bias=None: x.new_zeros(x.shape[0], w.shape[0]))
    assert tune_packed_rows([c]) == {(64, 48): 0}  # plain wins from the first size on:
    assert c.packed is None  # the packed copy no step would use is dropped


def test_engine_tunes_its_packed_layers_unless_batch_invariant(model_dir):
    from deepinfer.models.layers import TUNE_ROWS, Linear

    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=16 << 20))
    tuned = [m for m in engine.model.modules() if isinstance(m, Linear) and "packed_max_rows" in vars(m)]
    assert tuned and {m.packed_max_rows for m in tuned} <= {0, *TUNE_ROWS}
    # a layer whose packed GEMM never won (every layer, on some CPUs) drops its packed copy
    assert all((m.packed is None) == (m.packed_max_rows == 0) for m in tuned)
    inv = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=16 << 20, batch_invariant=True))
    assert not any("packed_max_rows" in vars(m) for m in inv.model.modules() if isinstance(m, Linear))


def test_blocks_loaded_from_another_engine_are_prefix_hits(model_dir, prompts):
    """``load_prefix`` (the storage tier's way in): blocks exported by engine A, loaded into
    engine B's prefix cache, are hit by B's request, which then equals B's cold run."""
    from deepinfer.kvstore import block_hashes

    shared = prompts[2]
    other = shared[:-5] + [504, 3575, 314, 260, 2]
    a = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, prefill_only=True))
    a.add_request("a", shared, GREEDY)
    (out,) = a.step()
    n = len(shared) // 16
    hashes = block_hashes(shared, 16, a.fingerprint)
    b = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20))
    cold = run(LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20)), [("b", other, GREEDY)])["b"]
    assert b.load_prefix(hashes, out.kv_blocks[:n]) == n
    assert b.load_prefix(hashes, out.kv_blocks[:n]) == 0  # already cached: skipped
    assert b.cached_prefix_blocks(hashes) == n and b.kv_tokens_used == 0  # cached, unreferenced
    before = b.num_computed_tokens_total
    out_b = run(b, [("b", other, GREEDY)])["b"]
    assert out_b == cold
    hit = (len(shared) - 5) // 16 * 16
    assert b.block_manager.num_hit_tokens == hit
    assert b.num_computed_tokens_total - before == len(other) - hit + len(out_b) - 1


def test_bad_token_ids_are_refused_and_a_failed_step_leaks_no_blocks(model_dir, prompts, monkeypatch):
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=16 << 20, async_scheduling=False))
    for bad in ([-5, 100], [1, engine.model_config.vocab_size]):
        with pytest.raises(RequestError, match="token ids"):
            engine.add_request("bad", bad, GREEDY)
    engine.add_request("a", prompts[0], GREEDY)

    def boom(inputs):
        raise RuntimeError("forward failed")

    monkeypatch.setattr(engine.runner, "execute", boom)
    with pytest.raises(RuntimeError):
        engine.step()
    assert engine.abort("a") and engine.block_manager.num_used_blocks == 0


def test_batch_invariant_linear_rows_match_for_any_batch_size():
    """Packed GEMM in batch-invariant mode: a row's bits are the same alone and among 1-300 rows
    (plain linear differs for M = 129-192 on some shapes, so the mode never leaves the packed path)."""
    from deepinfer.models.layers import Linear

    torch.manual_seed(0)
    layer = Linear(1536, 576, bias=False)
    if not layer.pack():
        pytest.skip("no MKL")
    layer.batch_invariant = True
    x = torch.randn(300, 1536)
    alone = layer(x[:1])
    for m in (2, 15, 16, 100, 128, 129, 150, 192, 193, 300):
        assert torch.equal(layer(x[:m])[:1], alone), m


def test_simultaneous_requests_with_one_cold_prefix_compute_it_once(model_dir, hf):
    """In-flight prefix sharing: 16 requests that arrive together with the same cold ~21-block
    prefix compute it once (the engine's computed-token counter), and each answers as alone."""
    _, tok = hf
    system = "You are a careful assistant. " + "Facts: the sky is blue, grass is green. " * 30
    prompts = [tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": f"Question {i}: what colour is item {i}?"}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(16)]
    shared = next(i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1)
    assert shared >= 20 * 16
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=128 << 20, step_time_budget_s=0.3))
    out = run(engine, [(str(i), p, sp) for i, p in enumerate(prompts)])
    prefix_blocks = shared // 16
    unshared = sum(len(p) - prefix_blocks * 16 for p in prompts)
    # the prefix once, every prompt's rest, and the 3 decode tokens of each
    assert engine.num_computed_tokens_total == prefix_blocks * 16 + unshared + 16 * 3
    assert engine.block_manager.num_hit_tokens == 15 * prefix_blocks * 16
    alone = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False))
    for i in (0, 7, 15):
        assert out[str(i)] == run(alone, [("x", prompts[i], sp)])["x"], f"prompt {i}"


def test_a_request_id_already_in_the_engine_is_refused(model_dir, prompts):
    """Two sequences under one id would stream into one response: the second add is refused
    (until the first is gone)."""
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=16 << 20))
    engine.add_request("a", prompts[0], GREEDY)
    with pytest.raises(RequestError, match="already in the engine"):
        engine.add_request("a", prompts[1], GREEDY)
    assert engine.abort("a")
    engine.add_request("a", prompts[1], GREEDY)  # gone: the id may come back
    assert len(engine.scheduler.waiting) == 1
