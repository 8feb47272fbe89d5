"""/v1/completions as OpenAI and vLLM serve it, through the real mesh with the official ``openai``
client: a list of prompts (strings or token-id lists) with ``n`` choices each, in OpenAI's index
order, streamed and not; outputs checked token for token against transformers in fp32.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model

MODEL = DEFAULT_MODEL_NAME
PROMPTS = ["The capital of France is", "One, two, three, four,", "def fibonacci(n):"]
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
