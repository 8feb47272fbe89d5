"""Speculative decoding (engine.spec_decode): drafters, DSpark's adaptive verification length,
lossless verification (greedy token for token, sampling in distribution)."""

from types import SimpleNamespace

import pytest
import torch

from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.spec_decode import (MIN_DECODE_STEPS, AcceptanceCalibrator, Draft, NgramIndex, SpecConfig,
                                          SpecDecoder)
from deepinfer.models.convert import ensure_default_model
from deepinfer.protocol import SamplingParams

from model_helpers import save_tiny


# ---------------------------------------------------------------------------- drafters


def test_ngram_index_takes_the_longest_suffix_and_its_latest_occurrence():
    idx = NgramIndex(1, 3)
    toks = [5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6, 7]
    # suffix [5, 6, 7] occurred at 0..3: what followed it is the draft (each n-gram on the
    # way was followed by nothing else: shares 1)
    assert idx.lookup(toks, 3) == (3, [8, 9, 6], [1.0, 1.0, 1.0])
    toks += [8, 0, 6]  # now only the 1-gram [6] matches; its latest earlier occurrence is at 10
    # [6] was followed by 7 three times of three; [7] by 8 twice, by 1 once
    assert idx.lookup(toks, 2) == (1, [7, 8], [1.0, 2 / 3])
    assert NgramIndex(2, 3).lookup([1, 2, 3, 4], 4) == (0, [], [])  # no repeat, no draft


def test_ngram_index_is_incremental():
    """Extending a context gives the same drafts as indexing it from scratch."""
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 6, (300,), generator=g).tolist()
    grow = NgramIndex(2, 4)
    for n in range(5, len(toks), 7):
        assert grow.lookup(toks[:n], 5) == NgramIndex(2, 4).lookup(toks[:n], 5)


def test_calibrator_learns_conditional_acceptance_per_bucket():
    cal = AcceptanceCalibrator(prior=0.5, prior_weight=4)
    assert cal.confidence(("x", 0)) == 0.5
    for _ in range(200):  # the first draft always accepted, the second always rejected
        cal.observe([("x", 0), ("x", 1), ("x", 2)], 1)
    assert cal.confidence(("x", 0)) > 0.95
    assert cal.confidence(("x", 1)) < 0.05
    assert cal.confidence(("x", 2)) == 0.5  # never reached: still the prior


def test_ngram_confidence_keys_tokens_the_target_replaced_before():
    """An edit recurs (a rename, say): a draft token the target rejected when this request
    drafted it before gets its own calibration key, so its confidence is learned apart."""
    dec = _decoder(StepCostModel(a=0.01, b=1e-3))
    seq = Sequence("0", [1, 2, 3, 4, 1, 2, 3], 7, SamplingParams(temperature=0.0))
    d = dec._ngram_draft(seq, 3)
    assert d.tokens == [4, 1, 2] and [b[2] for b in d.buckets] == ["kept"] * 3
    seq.draft_token_ids = d.tokens
    dec._buckets[seq.request_id] = d.buckets
    logits = torch.full((4, 16), -10.0)
    logits[0, 4] = logits[1, 9] = logits[2, 2] = logits[3, 0] = 10.0  # 4 accepted, 1 replaced by 9
    assert dec.verify(logits, [seq], [0], {}, []).token_ids == [[4, 9]]
    assert dec.states["0"].replaced == {1} and dec.states["0"].last == "some"
    seq.draft_token_ids = []
    d = dec._ngram_draft(seq, 3)
    assert d.tokens == [4, 1, 2] and [b[2] for b in d.buckets] == ["kept", "replaced", "kept"]
    for _ in range(50):  # the replaced token keeps being rejected: its bucket learns it, the others do not
        dec.calibrator.observe(d.buckets, 1)
    kept_same_j = d.buckets[1][:2] + ("kept",) + d.buckets[1][3:]
    assert dec.calibrator.confidence(d.buckets[1]) < 0.1 < 0.9 < dec.calibrator.confidence(kept_same_j)


def test_decode_step_model_follows_an_uncalibrated_engine_until_its_first_fit():
    """Without a start-up calibration there is nothing to keep: d and e follow the engine's
    model until it has been fitted once, and are kept from then on."""
    engine_cost = StepCostModel(a=0.01, b=1e-3, d=1e-7, e=0.0)
    dec = _decoder(engine_cost)
    seqs = _decode_seqs(4)
    pieces = [(1, 100)] * 4
    dec.observe_step(seqs, pieces, 0.02)
    engine_cost.d, engine_cost.e = 2e-7, 1e-5  # refitted, but never by ``fit``: still followed
    dec.observe_step(seqs, pieces, 0.02)
    assert (dec.decode_cost.d, dec.decode_cost.e) == (2e-7, 1e-5)
    engine_cost.samples.extend([([1, n, n * 50.0, n * 100.0], 0.01 + 1e-3 * n + 1e-5 * n * 100) for n in (1, 4, 16)])
    engine_cost.fit()
    fitted = (engine_cost.d, engine_cost.e)
    dec.observe_step(seqs, pieces, 0.02)
    assert (dec.decode_cost.d, dec.decode_cost.e) == fitted and engine_cost.num_fits == 1
    engine_cost.e = 0.0  # a later refit over decode steps alone
    dec.observe_step(seqs, pieces, 0.02)
    assert (dec.decode_cost.d, dec.decode_cost.e) == fitted


# ---------------------------------------------------------------------------- DSpark Algorithm 1


def _decoder(cost: StepCostModel, verify: str = "adaptive") -> SpecDecoder:
    # no SPS points: the linear fallback; no structured output
    engine = SimpleNamespace(cost_model=cost, model_config=SimpleNamespace(num_hidden_layers=4), structured=None)
    return SpecDecoder(SpecConfig(verify=verify, num_speculative_tokens=5), engine)


def _decode_seqs(n: int, context: int = 100) -> list[Sequence]:
    seqs = []
    for i in range(n):
        s = Sequence(str(i), [1] * (context + 1), context, SamplingParams())
        s.num_computed_tokens, s.num_scheduled_tokens = context, 1
        seqs.append(s)
    return seqs


def _drafts(confs: list[list[float]]) -> list[Draft]:
    return [Draft(list(range(len(c))), c, [()] * len(c)) for c in confs]


def test_adaptive_verifies_long_drafts_at_light_load():
    """One request, a step costs mostly its fixed part: every likely draft pays."""
    dec = _decoder(StepCostModel(a=0.05, b=1e-4, d=0.0, e=0.0))
    seqs = _decode_seqs(1)
    assert dec._choose(seqs, seqs, _drafts([[0.9] * 5]), 4096) == [5]


def test_adaptive_verifies_only_likely_drafts_at_heavy_load():
    """32 requests at a per-token cost comparable to the fixed one: only high-confidence
    drafts are worth a slot, and the chosen lengths follow the confidences."""
    dec = _decoder(StepCostModel(a=0.01, b=1e-3, d=0.0, e=0.0))
    seqs = _decode_seqs(32)
    confs = [[0.95, 0.9, 0.9, 0.9, 0.9] if i < 4 else [0.2] * 5 for i in range(32)]
    lengths = dec._choose(seqs, seqs, _drafts(confs), 4096)
    # (a draft pays while its acceptance chance a exceeds Θ* x marginal step cost, ~0.78 here)
    assert lengths[:4] == [2, 2, 2, 2] and not any(lengths[4:]), lengths

    def theta(ls):  # expected tokens per second of a step verifying ls[r] drafts of request r
        tau = sum(1 + float(torch.tensor(c[:k]).cumprod(0).sum()) if k else 1 for c, k in zip(confs, ls))
        return tau / (0.01 + sum(1e-3 * (1 + k) for k in ls))
    assert theta(lengths) >= max(theta([k] * 32) for k in range(6))
    assert theta(lengths) >= max(theta([k] * 4 + [0] * 28) for k in range(6))


def test_adaptive_leaves_prefill_chunks_out_of_the_rate():
    """A prefill chunk in the step is owed whatever is verified: counted in the step's time it
    would lower the rate drafts must beat and let the unlikely ones in (here: every 0.2 draft)."""
    dec = _decoder(StepCostModel(a=0.01, b=1e-3, d=0.0, e=0.0))
    seqs = _decode_seqs(32)
    confs = [[0.95, 0.9, 0.9, 0.9, 0.9] if i < 4 else [0.2] * 5 for i in range(32)]
    alone = dec._choose(seqs, seqs, _drafts(confs), 4096)
    chunk = Sequence("p", [1] * 2000, 2000, SamplingParams())
    chunk.num_computed_tokens, chunk.num_scheduled_tokens = 0, 1024
    assert dec._choose(seqs + [chunk], seqs, _drafts(confs), 4096) == alone == [2] * 4 + [0] * 28
    ones = []  # 1-token chunks short of their prompts' ends: prefill too (they sample no token)
    for i in range(32):
        s = Sequence(f"q{i}", [1] * 300, 300, SamplingParams())
        s.num_computed_tokens, s.num_scheduled_tokens = 100, 1
        ones.append(s)
    assert dec._choose(seqs + ones, seqs, _drafts(confs), 4096) == alone


def test_adaptive_prices_by_the_decode_step_model_once_it_has_seen_decode_steps():
    """Verified tokens go through the LM head, prefill tokens do not: decode steps (each sequence
    its last token plus drafts) refit the a and b of a model of their own, which adaptive
    verification prices by after MIN_DECODE_STEPS of them; d and e are the engine model's at
    the first decode step, kept when the engine's later refits change them (a decode worker's
    window of decode steps alone cannot tell e from a). Steps with any prefill chunk (a long
    one, or a 1-token chunk short of the prompt's end) never reach it."""
    engine_cost = StepCostModel(a=0.01, b=1e-3, d=0.0, e=1e-5)
    engine_cost.num_fits = 1  # calibrated at start-up
    dec = _decoder(engine_cost)
    truth = StepCostModel(a=0.02, b=4e-3, d=0.0, e=1e-5)  # what decode steps really cost
    chunk = Sequence("p", [1] * 600, 600, SamplingParams())
    for k in range(40):
        seqs = _decode_seqs(4 + k % 5, context=100 + 10 * k)
        for i, s in enumerate(seqs):
            s.draft_token_ids = [7] * ((i + k) % 4)
        pieces = [(1 + len(s.draft_token_ids), s.num_computed_tokens) for s in seqs]
        dec.observe_step(seqs, pieces, truth.predict(pieces))
        dec.observe_step([chunk], [(512, 0)], 0.5)  # a prefill step: another cost per token
        dec.observe_step(seqs + [chunk], pieces + [(64, 0)], 0.9)  # decodes beside a prefill chunk
        dec.observe_step([chunk], [(1, 10)], 0.05)  # a 1-token chunk mid-prompt
        assert (dec.cost() is engine_cost) == (k + 1 < MIN_DECODE_STEPS)
        if k == 0:  # the engine's refit over decode steps alone folds the KV gather into a
            engine_cost.a, engine_cost.d, engine_cost.e = 0.03, 1e-6, 0.0
    model = dec.decode_cost
    assert len(model.samples) == 40 and (model.d, model.e) == (0.0, 1e-5)
    assert model.b == pytest.approx(4e-3, rel=1e-3) and model.a == pytest.approx(0.02, rel=1e-3)
    # and _choose prices by it: the same drafts as a decoder whose engine model is the truth,
    # not those the engine's cheaper per-token cost lets in
    seqs = _decode_seqs(32)
    confs = [[0.95, 0.9, 0.9, 0.9, 0.9] if i < 4 else [0.6] * 5 for i in range(32)]
    priced = dec._choose(seqs, seqs, _drafts(confs), 4096)
    assert priced == _decoder(truth)._choose(seqs, seqs, _drafts(confs), 4096)
    assert priced != _decoder(engine_cost)._choose(seqs, seqs, _drafts(confs), 4096)


def test_the_decode_step_model_keeps_the_engines_per_token_cost_until_its_steps_can_tell():
    """Decode steps all of 32 sequences without drafts feed the same number of tokens, so they
    cannot tell the per-token cost b from the fixed cost a: b stays the engine model's (not the
    class default, which would price drafts at a quarter of their cost)."""
    engine_cost = StepCostModel(a=0.05, b=4e-3, d=1e-7, e=1e-5)
    dec = _decoder(engine_cost)
    for k in range(MIN_DECODE_STEPS + 8):
        seqs = _decode_seqs(32, context=300 + k)
        pieces = [(1, s.num_computed_tokens) for s in seqs]
        dec.observe_step(seqs, pieces, 0.6)
    model = dec.cost()
    assert model is dec.decode_cost and model.b == engine_cost.b and model.a > 0


def test_fixed_verifies_every_draft_within_the_token_budget():
    dec = _decoder(StepCostModel(a=0.01, b=1e-3, d=0.0, e=0.0), verify="fixed")
    seqs = _decode_seqs(3)
    assert dec._choose(seqs, seqs, _drafts([[0.1] * 5, [0.1] * 2, [0.1] * 5]), 9) == [5, 2, 2]


# ---------------------------------------------------------------------------- verification


def _seq_with_drafts(drafts: list[int], temperature: float) -> Sequence:
    s = Sequence("r", [0, 1], 2, SamplingParams(temperature=temperature, max_tokens=16))
    s.draft_token_ids = list(drafts)
    return s


def test_greedy_verification_accepts_while_equal_to_argmax():
    rows = torch.full((4, 6), -5.0)
    for j, t in enumerate([3, 4, 1, 2]):
        rows[j, t] = 5.0
    assert SpecDecoder._verify_one(rows, _seq_with_drafts([3, 4, 5], 0.0)) == [3, 4, 1]  # third draft wrong
    assert SpecDecoder._verify_one(rows, _seq_with_drafts([3, 4, 1], 0.0)) == [3, 4, 1, 2]  # bonus token
    assert SpecDecoder._verify_one(rows, _seq_with_drafts([0, 4, 1], 0.0)) == [3]


def _chi2_pvalue(a: list[int], b: list[int]) -> float:
    """Chi-square test that two count vectors come from one distribution (cells with fewer
    than 10 expected merged)."""
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    order = torch.argsort(a + b, descending=True)
    a, b = a[order], b[order]
    na, nb = float(a.sum()), float(b.sum())
    cells, ca, cb = [], 0.0, 0.0
    for x, y in zip(a.tolist(), b.tolist()):
        ca, cb = ca + x, cb + y
        if (ca + cb) * min(na, nb) / (na + nb) >= 10:
            cells.append((ca, cb))
            ca = cb = 0.0
    if ca + cb:
        cells[-1] = (cells[-1][0] + ca, cells[-1][1] + cb)
    stat = 0.0
    for x, y in cells:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    dof = max(1, len(cells) - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def test_sampling_verification_is_lossless_on_a_known_distribution():
    """Rows p0 (first token) and p1 (second token, given the first draft): the emitted first
    token is distributed as p0 and, when it is the draft, the second as p1, whatever the draft."""
    torch.manual_seed(0)
    vocab, n = 6, 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 1.0, 0.0, 0.7],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    p0, p1 = logits[0].softmax(-1), logits[1].softmax(-1)
    for draft in ([0, 1], [4, 3]):  # a likely and an unlikely first draft
        firsts, seconds = [0] * vocab, [0] * vocab
        for _ in range(n):
            out = SpecDecoder._verify_one(logits, _seq_with_drafts(draft, 1.0))
            firsts[out[0]] += 1
            if out[0] == draft[0]:
                seconds[out[1]] += 1
        want0 = (p0 * n).round().long().tolist()
        want1 = (p1 * sum(seconds)).round().long().tolist()
        assert _chi2_pvalue(firsts, want0) > 1e-3, (draft, firsts, want0)
        assert _chi2_pvalue(seconds, want1) > 1e-3, (draft, seconds, want1)


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    """A 2-layer Llama with an 8-token vocabulary and a sharpened head (peaked distributions,
    so drafts are both accepted and rejected often)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("toy_llama")
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    model = save_tiny(path, cfg, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(path)
    return path


def _sample_many(model_dir, spec: SpecConfig | None, n: int, seed: int) -> tuple[list[tuple], LLMEngine]:
    torch.manual_seed(seed)
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=128, speculative=spec,
                                               packed_weights=False))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: prompt lookup always has a draft
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = {}
    for start in range(0, n, 128):
        for i in range(start, min(n, start + 128)):
            engine.add_request(str(i), prompt, sp)
            outs[str(i)] = []
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] += o.new_token_ids
    return [tuple(v) for v in outs.values()], engine


def test_speculative_sampling_matches_plain_sampling_in_distribution(toy_model):
    n = 3000
    plain, _ = _sample_many(toy_model, None, n, seed=1)
    spec_out, engine = _sample_many(toy_model, SpecConfig("ngram", num_speculative_tokens=3, verify="fixed",
                                                          ngram_min=1), n, seed=2)
    s = engine.spec
    assert s.num_draft_tokens > 1000 and 0 < s.num_accepted_tokens < s.num_draft_tokens  # both paths taken
    assert all(len(o) == 3 for o in plain + spec_out)
    for pos in range(3):
        a, b = [0] * 8, [0] * 8
        for o in plain:
            a[o[pos]] += 1
        for o in spec_out:
            b[o[pos]] += 1
        assert _chi2_pvalue(a, b) > 1e-3, (pos, a, b)
    pairs = lambda outs: [sum(1 for o in outs if o[:2] == (x, y)) for x in range(8) for y in range(8)]
    assert _chi2_pvalue(pairs(plain), pairs(spec_out)) > 1e-3


# ---------------------------------------------------------------------------- greedy, real model


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    model_dir = ensure_default_model(progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    texts = ["Rewrite this code, renaming a to x and b to y:\n" + code,
             "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox.",
             "What is the capital of France?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for t in texts]
    return model_dir, prompts


def _greedy(model_dir, prompts, spec, n=40, logprobs=False):
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, batch_invariant=True, speculative=spec))
    out = {str(i): [] for i in range(len(prompts))}
    lps = {str(i): [] for i in range(len(prompts))}
    sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=logprobs, top_logprobs=2 if logprobs else 0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if logprobs:
                lps[o.request_id] += o.logprobs
    return out, lps, engine


def test_greedy_speculation_equals_plain_decoding_token_for_token(smol):
    model_dir, prompts = smol
    base, base_lps, _ = _greedy(model_dir, prompts, None, logprobs=True)
    for spec in (SpecConfig("ngram", num_speculative_tokens=1, verify="fixed"),
                 SpecConfig("ngram", num_speculative_tokens=7, verify="fixed"),
                 SpecConfig("ngram", num_speculative_tokens=5),
                 SpecConfig("draft", num_speculative_tokens=3, draft_layers=4, verify="fixed", draft_stop=0.0)):
        out, lps, engine = _greedy(model_dir, prompts, spec, logprobs=True)
        assert out == base, spec
        assert engine.spec.num_draft_tokens > 0, spec
        if spec.method == "ngram":
            assert engine.spec.num_accepted_tokens > 0, spec
        for rid in base:  # logprobs of the same tokens, from the verification rows
            assert len(lps[rid]) == len(base_lps[rid])
            for x, y in zip(lps[rid], base_lps[rid]):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-3


def test_speculation_frees_kv_and_respects_max_tokens_and_stop(smol):
    model_dir, prompts = smol
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, speculative=SpecConfig("ngram")))
    free = engine.block_manager.num_free_blocks
    for i, p in enumerate(prompts):
        engine.add_request(f"len{i}", p, SamplingParams(temperature=0.0, max_tokens=7))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                assert o.finish_reason in ("length", "stop")
    assert all(len(v) <= 7 for v in out.values()) and any(len(v) == 7 for v in out.values())
    assert engine.block_manager.num_free_blocks == free
    # the engine times its decode steps for adaptive verification's own cost model (the prompt's
    # prefill steps are not decode steps)
    assert 0 < len(engine.spec.decode_cost.samples) < engine.num_steps
    # a stop token inside accepted drafts ends the request there
    base = out["len0"]
    engine.add_request("stop", prompts[0], SamplingParams(temperature=0.0, max_tokens=7, stop_token_ids=[base[3]]))
    got = []
    while engine.has_unfinished():
        for o in engine.step():
            got += o.new_token_ids
            last = o.finish_reason
    assert got == base[: base.index(base[3]) + 1] and last == "stop"
    assert engine.block_manager.num_free_blocks == free


def test_structured_output_with_speculation_equals_plain_and_stays_valid(smol):
    """Drafts are cut where the grammar refuses them and each verify row is masked as after
    the drafts before it: greedy output equals the non-speculative structured output."""
    import json

    import jsonschema

    model_dir, prompts = smol
    schema = {"type": "object", "properties": {"items": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}},
        "required": ["name", "qty"]}}}, "required": ["items"]}
    specs = [{"type": "json_schema", "schema": schema}, {"type": "regex", "pattern": "(ab){6}c"},
             {"type": "choice", "choices": ["the quick brown fox", "the lazy dog"]}]

    def run(spec):
        engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, batch_invariant=True, speculative=spec))
        out = {}
        for i, st in enumerate(specs):
            engine.add_request(str(i), prompts[i % len(prompts)],
                               SamplingParams(temperature=0.0, max_tokens=80, structured=st))
            out[str(i)] = []
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
                assert o.finish_reason in (None, "stop"), o.finish_reason
        return out, engine

    base, _ = run(None)
    out, engine = run(SpecConfig("ngram", num_speculative_tokens=5, verify="fixed", ngram_min=1))
    assert out == base
    assert engine.spec.num_accepted_tokens > 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = [tok.decode(out[str(i)], skip_special_tokens=True) for i in range(3)]
    jsonschema.validate(json.loads(text[0]), schema)
    assert text[1] == "ab" * 6 + "c" and text[2] in specs[2]["choices"]


def test_structured_drafts_stop_before_eos(smol):
    """A few-shot history answered "12" makes prompt lookup draft ["2", EOS] after "1": the
    draft is cut before EOS (verifying a consumed EOS corrupted the grammar's rollback and gave
    "132" for a two-digit regex); the output equals the non-speculative one."""
    from transformers import AutoTokenizer

    model_dir, _ = smol
    tok = AutoTokenizer.from_pretrained(model_dir)
    st = {"type": "regex", "pattern": "[0-9]{2}"}
    prompts = []
    for hist, ask in [("12", "Give me 13."), ("10", "Give me 19."), ("12", "Give me 15.")]:
        msgs = [{"role": "user", "content": "Give me a two-digit number."}, {"role": "assistant", "content": hist},
                {"role": "user", "content": ask}]
        prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    outs = []
    for spec in (None, SpecConfig("ngram", num_speculative_tokens=5, verify="fixed", ngram_min=1)):
        engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=32 << 20, batch_invariant=True, speculative=spec))
        out, reasons = {}, {}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=8, structured=st))
            out[str(i)] = []
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
                reasons[o.request_id] = o.finish_reason or reasons.get(o.request_id)
        assert set(reasons.values()) == {"stop"}
        outs.append(out)
        for v in out.values():
            assert len(tok.decode(v, skip_special_tokens=True)) == 2
    assert outs[0] == outs[1]


# ---------------------------------------------------------------------------- through the mesh


def test_decode_worker_with_speculation_serves_the_same_greedy_text(make_mesh, smol):
    """A mesh whose decode worker speculates (prompt lookup): streamed and non-streamed
    completions of token-id prompts equal one batch-invariant engine's greedy tokens (the
    decode worker's multi-token steps reach the client whole and in order)."""
    import openai

    model_dir, prompts = smol
    fast = ["--no-calibrate", "--kv-cache-gb", "0.25", "--batch-invariant"]
    m = make_mesh(extra_args={"prefill": fast, "decode": fast + ["--speculative", "ngram"]})
    want, _, _ = _greedy(model_dir, prompts[:2], None, n=48)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    client = openai.OpenAI(base_url=m.gateway_url + "/v1", api_key="test", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for i, p in enumerate(prompts[:2]):
        r = client.completions.create(model=model, prompt=p, max_tokens=48, temperature=0)
        assert r.choices[0].text == tok.decode(want[str(i)], skip_special_tokens=True)
        assert r.usage.completion_tokens == len(want[str(i)])
        chunks = client.completions.create(model=model, prompt=p, max_tokens=48, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    client.close()
