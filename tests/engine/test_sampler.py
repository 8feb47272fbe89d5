"""The sampler on synthetic logits: every knob's effect, logprobs, and seeded reproducibility."""

import math
from collections import Counter

import pytest
import torch

from deepinfer.engine.sampler import SampleResult, TokenLogprobs, apply_logits_processors, sample
from deepinfer.engine.sequence import Sequence
from deepinfer.protocol import PrefillRequest, SamplingParams, TokenChunk, pack, unpack

EOS = 0


def seq(prompt=(5, 6), output=(), **sampling) -> Sequence:
    tokens = list(prompt) + list(output)
    return Sequence("r", tokens, len(prompt), SamplingParams(**sampling))


def draws(logits_row: list[float], n: int = 2000, **sampling) -> Counter:
    """Sample ``n`` rows with the same logits and params (global RNG) and count the tokens."""
    logits = torch.tensor([logits_row] * n)
    return Counter(sample(logits, [seq(**sampling) for _ in range(n)], [None] * n).token_ids)


def log_probs(probs: list[float]) -> list[float]:
    return [math.log(p) if p > 0 else float("-inf") for p in probs]


# --- greedy ----------------------------------------------------------------------------


def test_greedy_is_the_argmax_and_leaves_the_logits_alone():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = sample(logits, [seq(temperature=0.0) for _ in range(4)], [None] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4
    assert torch.equal(logits, before)


def test_greedy_ignores_truncation_knobs_but_not_bias_or_penalties():
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0]])
    assert sample(logits, [seq(temperature=0, top_k=1, top_p=0.1, min_p=0.9)], [None]).token_ids == [1]
    assert sample(logits, [seq(temperature=0, logit_bias={2: 0.5})], [None]).token_ids == [2]
    assert sample(logits, [seq(temperature=0, output=[1], presence_penalty=0.2)], [None]).token_ids == [2]


# --- logit bias, min_tokens, penalties ---------------------------------------------------


def test_logit_bias_forces_and_bans_tokens():
    row = [0.0, 5.0, 1.0, 2.0]
    assert set(draws(row, 300, logit_bias={3: 100.0})) == {3}
    assert 1 not in draws(row, 300, logit_bias={1: -100.0})


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])  # EOS (0) is the argmax, stop id 2 next
    for n_out, expected in [(0, 1), (1, 1), (2, EOS)]:
        s = seq(output=[3] * n_out, temperature=0, min_tokens=2, stop_token_ids=[2])
        assert sample(logits, [s], [None], eos_token_ids=[EOS]).token_ids == [expected], n_out
    s = seq(temperature=0, min_tokens=1, ignore_eos=True)  # EOS does not stop it: nothing to mask
    assert sample(logits, [s], [None], eos_token_ids=[EOS]).token_ids == [EOS]


def test_penalties_match_a_hand_computed_example():
    # prompt [1, 1, 2], output [2, 3, 3]
    s = seq(prompt=[1, 1, 2], output=[2, 3, 3], repetition_penalty=2.0, frequency_penalty=0.5,
            presence_penalty=0.25)
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    out = apply_logits_processors(logits, [s])
    # repetition over prompt + output {1, 2, 3}: 2/2, -1*2, 0.5/2; then output counts {2: 1, 3: 2}:
    # token 2: -2 - 0.5*1 - 0.25 = -2.75; token 3: 0.25 - 0.5*2 - 0.25 = -1.0; token 1 is prompt-only.
    assert out.tolist() == [[1.0, 1.0, -2.75, -1.0, 3.0]]
    assert logits.tolist() == [[1.0, 2.0, -1.0, 0.5, 3.0]]  # the input is not modified


def test_penalties_apply_per_row():
    logits = torch.zeros(2, 4)
    out = apply_logits_processors(logits, [seq(output=[1]), seq(output=[1], frequency_penalty=1.0)])
    assert out.tolist() == [[0.0, 0.0, 0.0, 0.0], [0.0, -1.0, 0.0, 0.0]]


def test_negative_presence_penalty_encourages_repetition():
    assert sample(torch.tensor([[1.0, 0.5]]), [seq(output=[1], temperature=0, presence_penalty=-1.0)],
                  [None]).token_ids == [1]


# --- temperature, min_p, top_k, top_p ----------------------------------------------------


def test_sampling_follows_the_distribution():
    counts = draws(log_probs([0.5, 0.3, 0.2, 0.0]), 4000)
    assert counts[3] == 0
    for tok, p in enumerate([0.5, 0.3, 0.2]):
        assert abs(counts[tok] / 4000 - p) < 0.04, counts


def test_temperature_sharpens_and_flattens():
    row = log_probs([0.6, 0.4])
    cold, hot = draws(row, 2000, temperature=0.25), draws(row, 2000, temperature=4.0)
    # p(0) at T: 0.6^(1/T) / (0.6^(1/T) + 0.4^(1/T)): 0.835 at T=0.25, 0.525 at T=4
    assert abs(cold[0] / 2000 - 0.835) < 0.04 and abs(hot[0] / 2000 - 0.525) < 0.04


def test_top_k_keeps_exactly_k_tokens_even_with_ties():
    assert set(draws(log_probs([0.1, 0.4, 0.2, 0.3]), 1000, top_k=2)) == {1, 3}
    assert len(draws([0.0] * 10, 1000, top_k=3)) == 3  # all tied: still exactly three
    assert len(draws([0.0] * 10, 1000, top_k=0)) == 10 == len(draws([0.0] * 10, 1000, top_k=-1))


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    row = log_probs([0.15, 0.5, 0.05, 0.3])
    assert set(draws(row, 1000, top_p=0.8)) == {1, 3}  # 0.5 + 0.3 reaches 0.8
    assert set(draws(row, 1000, top_p=0.81)) == {1, 3, 0}
    assert set(draws(row, 1000, top_p=0.4)) == {1}


def test_top_p_nucleus_larger_than_the_first_window():
    # A nearly flat distribution over 1000 tokens: the nucleus of 0.5 is hundreds of tokens,
    # far past the first topk window the sampler looks in.
    row = [-0.001 * i for i in range(1000)]
    p = torch.tensor(row, dtype=torch.float64).softmax(0)
    nucleus = int((p.cumsum(0) < 0.5).sum()) + 1
    assert nucleus > 300
    counts = draws(row, 1000, top_p=0.5)
    assert max(counts) <= nucleus  # tokens 0 .. nucleus-1 (float32 may move the edge by one)
    assert len(counts) > 250


def test_top_p_is_renormalised_after_top_k():
    # top_k=2 keeps {1: 0.4, 3: 0.3} -> renormalised 0.57 / 0.43; top_p=0.5 then keeps only token 1
    assert set(draws(log_probs([0.1, 0.4, 0.2, 0.3]), 500, top_k=2, top_p=0.5)) == {1}


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    row = log_probs([0.5, 0.25, 0.15, 0.1])
    assert set(draws(row, 1000, min_p=0.4)) == {0, 1}  # threshold 0.2
    assert set(draws(row, 1000, min_p=0.25)) == {0, 1, 2}  # threshold 0.125


def test_min_p_is_applied_after_temperature():
    row = log_probs([0.5, 0.25, 0.15, 0.1])
    # at T=0.5 the probabilities are proportional to p^2: 0.25, 0.0625, ... -> token 1 is 1/4 of the top
    assert set(draws(row, 1000, min_p=0.3, temperature=0.5)) == {0}


# --- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_the_log_softmax_after_bias_and_penalties_before_temperature():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seqs = [seq(output=[7, 7], logprobs=True, top_logprobs=5, temperature=0.5, top_k=3, frequency_penalty=1.0),
            seq(temperature=0.0),
            seq(logprobs=True, temperature=0.0, logit_bias={9: 3.0})]
    out = sample(logits, seqs, [None] * 3)
    assert isinstance(out, SampleResult) and out.logprobs[1] is None
    expected = torch.log_softmax(apply_logits_processors(logits, seqs), dim=-1)
    for i in (0, 2):
        lp = out.logprobs[i]
        assert isinstance(lp, TokenLogprobs) and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(expected[i, lp.token_id].item(), abs=1e-6)
    top = out.logprobs[0].top
    assert [t for t, _ in top] == expected[0].topk(5).indices.tolist()
    assert [v for _, v in top] == pytest.approx(expected[0].topk(5).values.tolist(), abs=1e-6)
    assert out.logprobs[2].top == []  # logprobs without top_logprobs
    assert out.logprobs[2].token_id == expected[2].argmax().item()  # greedy = the top-1 logprob
    assert out.logprobs[0].to_wire() == [out.logprobs[0].logprob, [list(p) for p in top]]


def test_a_token_masked_by_min_tokens_has_logprob_minus_infinity():
    s = seq(temperature=0, min_tokens=1, logprobs=True, top_logprobs=3)
    out = sample(torch.tensor([[5.0, 1.0, 0.0]]), [s], [None], eos_token_ids=[EOS])
    assert out.token_ids == [1]
    assert [t for t, _ in out.logprobs[0].top] == [1, 2, 0] and out.logprobs[0].top[2][1] == float("-inf")


# --- seeds --------------------------------------------------------------------------------


def step_logits(step: int, vocab: int = 300) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step)) * 2


def generate(batch: list[tuple[Sequence, int | None]], steps: int = 12, target: int = 0) -> list[int]:
    """Decode ``steps`` tokens for every row (row r seeded with ``batch[r][1]``); return row ``target``'s.

    The target row's logits are the same wherever it sits; the other rows' differ from it and each other.
    """
    gens = [torch.Generator().manual_seed(s) if s is not None else None for _, s in batch]
    seqs = [s for s, _ in batch]
    for step in range(steps):
        logits = torch.stack([step_logits(step) + (0.0 if r == target else 0.1 * (r + 1)) for r in range(len(seqs))])
        for s, tok in zip(seqs, sample(logits, seqs, gens).token_ids):
            s.token_ids.append(tok)
    return seqs[target].output_token_ids


KNOBS = dict(temperature=0.9, top_p=0.95, top_k=100, min_p=0.01, frequency_penalty=0.3, repetition_penalty=1.1)


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_any_batch():
    alone = generate([(seq(**KNOBS), 42)])
    again = generate([(seq(**KNOBS), 42)])
    with_others = generate([(seq(temperature=1.0), None), (seq(temperature=0), None), (seq(**KNOBS), 42),
                            (seq(temperature=0.7, top_p=0.5), 7)], target=2)
    first_in_batch = generate([(seq(**KNOBS), 42), (seq(temperature=1.0, top_k=5), None)], target=0)
    assert alone == again == with_others == first_in_batch
    assert generate([(seq(**KNOBS), 43)]) != alone


def test_unseeded_rows_do_not_consume_a_seeded_rows_randomness():
    g = torch.Generator().manual_seed(5)
    expected = torch.Generator().manual_seed(5)
    logits = torch.zeros(3, 10)
    sample(logits, [seq(), seq(), seq()], [None, g, None])
    torch.rand(1, generator=expected)  # one draw per step for its row, nothing else
    assert torch.equal(g.get_state(), expected.get_state())


# --- the wire ------------------------------------------------------------------------------


def test_new_sampling_params_and_logprobs_survive_msgpack():
    sp = SamplingParams(top_k=5, min_p=0.1, presence_penalty=-1.5, frequency_penalty=2.0, repetition_penalty=1.3,
                        logit_bias={50256: -100.0, 7: 2.5}, min_tokens=3, logprobs=True, top_logprobs=4)
    req = unpack(pack(PrefillRequest("r", [1, 2], sp, "s")))
    assert unpack(pack(PrefillRequest("r", [1], SamplingParams(), "s"))).sampling.logit_bias == {}
    assert req.sampling == sp and req.sampling.logit_bias == {50256: -100.0, 7: 2.5}
    chunk = TokenChunk("r", [3], "decode", "w", logprobs=[[-0.5, [[3, -0.5], [9, -1.25]]]])
    assert unpack(pack(chunk)) == chunk
    assert unpack(pack(TokenChunk("r", [3], "decode", "w"))).logprobs is None
