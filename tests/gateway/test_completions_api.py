"""/v1/completions as OpenAI and vLLM serve it, through the real mesh with the official ``openai``
client: a list of prompts (strings or token-id lists) with ``n`` choices each, in OpenAI's index
order, streamed and not; ``echo`` with ``logprobs`` (the prompt's logprobs first, computed by the
engine during prefill, also past a cached prefix) and ``max_tokens=0`` (score a text, generate
nothing: lm-evaluation-harness's loglikelihood requests). Outputs and logprobs are checked against
transformers in fp32 (logprobs within 1e-3).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model

MODEL = DEFAULT_MODEL_NAME
PROMPTS = ["The capital of France is", "One, two, three, four,", "def fibonacci(n):"]
PASSAGE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
           "combined movable metal type, oil-based ink and a screw press adapted from wine making.")
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_default_model(progress=False))


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_default_model(progress=False), dtype=torch.float32).eval()


def hf_greedy_text(hf_model, tok, ids: list[int], n: int) -> str:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def test_a_list_of_prompts_gets_n_choices_each_in_openai_order(openai_client, tok, hf_model):
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    want = [hf_greedy_text(hf_model, tok, i, 6) for i in ids]
    for prompt in (PROMPTS, ids):  # strings, then token-id lists
        r = openai_client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=6, **GREEDY)
        assert [c.index for c in r.choices] == list(range(6))
        assert [c.text for c in r.choices] == [w for w in want for _ in range(2)]  # index = prompt_i * n + j
        assert all(c.finish_reason == "length" for c in r.choices)
        assert r.usage.prompt_tokens == sum(map(len, ids))  # each prompt once, not once per choice
        assert r.usage.completion_tokens == 6 * 6 and r.usage.total_tokens == sum(map(len, ids)) + 36


def test_a_streamed_list_of_prompts_equals_the_collected_one(openai_client, tok):
    done = openai_client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=5, echo=True, **GREEDY)
    stream = openai_client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=5, echo=True,
                                              stream=True, stream_options={"include_usage": True}, **GREEDY)
    texts, reasons, usage = defaultdict(str), {}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
        usage = chunk.usage or usage
    assert dict(texts) == {c.index: c.text for c in done.choices}
    assert reasons == {c.index: "length" for c in done.choices}
    assert [c.text[:len(PROMPTS[c.index // 2])] for c in done.choices] == [p for p in PROMPTS[:2] for _ in range(2)]
    assert usage.prompt_tokens == done.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in PROMPTS[:2])
    assert usage.completion_tokens == done.usage.completion_tokens == 4 * 5


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 log-softmax at each prompt position: [P, V] (row p predicts token p + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_prompt_logprobs(logprobs, ids: list[int], text: str, ref: torch.Tensor, k: int) -> None:
    """The legacy ``logprobs`` object's first ``len(ids)`` entries: the prompt's tokens, as OpenAI shapes them."""
    n = len(ids)
    assert "".join(logprobs.tokens[:n]) == text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[:n] == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(n)]
    want = [ref[p - 1, ids[p]].item() for p in range(1, n)]
    assert logprobs.token_logprobs[1:n] == pytest.approx(want, abs=1e-3)
    for p in range(1, n):
        assert sorted(logprobs.top_logprobs[p].values(), reverse=True) == pytest.approx(
            ref[p - 1].topk(k).values.tolist(), abs=1e-3)


def test_echo_with_logprobs_puts_the_prompts_logprobs_first(openai_client, tok, hf_model):
    ids = tok(PASSAGE)["input_ids"]
    ref = hf_logprobs(hf_model, ids)
    r = openai_client.completions.create(model=MODEL, prompt=PASSAGE, echo=True, logprobs=2, max_tokens=4, **GREEDY)
    (c,) = r.choices
    assert c.text == PASSAGE + hf_greedy_text(hf_model, tok, ids, 4)
    assert len(c.logprobs.tokens) == len(ids) + 4 and c.logprobs.text_offset[len(ids)] == len(PASSAGE)
    assert_prompt_logprobs(c.logprobs, ids, PASSAGE, ref, 2)
    assert all(v is not None for v in c.logprobs.token_logprobs[len(ids):])  # then the completion's

    stream = openai_client.completions.create(model=MODEL, prompt=PASSAGE, echo=True, logprobs=2, max_tokens=4,
                                              stream=True, **GREEDY)
    text, tokens, values = "", [], []
    for chunk in stream:
        for sc in chunk.choices:
            text += sc.text
            tokens += sc.logprobs.tokens if sc.logprobs else []
            values += sc.logprobs.token_logprobs if sc.logprobs else []
    assert text == c.text and tokens == c.logprobs.tokens
    assert values[0] is None and values[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)


def test_max_tokens_zero_scores_prompts_without_generating_even_past_a_cached_prefix(openai_client, tok, hf_model):
    texts = [PASSAGE + " It spread across Europe within decades.", "Question: what is 2 + 2? Answer: 4"]
    ids = [tok(t)["input_ids"] for t in texts]
    openai_client.completions.create(model=MODEL, prompt=texts, max_tokens=1)  # their prefixes are cached now
    again = openai_client.completions.create(model=MODEL, prompt=texts[0], max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    r = openai_client.completions.create(model=MODEL, prompt=texts, echo=True, logprobs=1, max_tokens=0)
    assert [c.text for c in r.choices] == texts and [c.finish_reason for c in r.choices] == ["length"] * 2
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == sum(map(len, ids))
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # the whole prompt was computed: every position scored
    for c, i, t in zip(r.choices, ids, texts):
        assert len(c.logprobs.tokens) == len(i)
        assert_prompt_logprobs(c.logprobs, i, t, hf_logprobs(hf_model, i), 1)

    stream = openai_client.completions.create(model=MODEL, prompt=ids[1], echo=True, logprobs=1, max_tokens=0,
                                              stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    got = [sc for ch in chunks for sc in ch.choices]
    assert "".join(sc.text for sc in got) == tok.decode(ids[1]) and got[-1].finish_reason == "length"
    values = [v for sc in got if sc.logprobs for v in sc.logprobs.token_logprobs]
    assert values[0] is None and values[1:] == pytest.approx(r.choices[1].logprobs.token_logprobs[1:], abs=1e-4)
    assert next(ch.usage for ch in chunks if ch.usage).completion_tokens == 0
