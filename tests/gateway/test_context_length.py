"""A prompt (or prompt + requested completion) over the context: every API answers 400 in its own
error shape with the same numbers, written by ``errors.context_length_exceeded``.

Through the real mesh with the official clients (``openai``: chat, completions, responses;
``anthropic``: messages), the prompt's token count checked against transformers' tokenizer; and,
on the fake mesh, the context shrinks to what a live worker reports it runs.
"""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest

from deepinfer.mesh import MeshClient
from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model
from deepinfer.protocol import LoadReport, subjects
from gateway_harness import client, gateway, nats_url, workers  # noqa: F401 - fixtures
from test_gateway import assert_openai_error

MODEL = DEFAULT_MODEL_NAME
CONTEXT = 8192  # SmolLM2-135M-Instruct's max_position_embeddings
LONG = "word " * 9000  # ~9000 tokens


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_default_model(progress=False))


def chat_tokens(tok, content: str) -> int:
    return len(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"])


def openai_message(prompt: int, completion: int, field: str) -> str:
    return (f"This model's maximum context length is {CONTEXT} tokens. However, you requested {prompt + completion} "
            f"tokens ({prompt} in the {field}, {completion} in the completion). Please reduce the length of the "
            f"{field} or completion.")


def assert_context_error(e: openai.BadRequestError, prompt: int, completion: int, field: str) -> None:
    assert e.status_code == 400
    assert e.body == {"message": openai_message(prompt, completion, field), "type": "invalid_request_error",
                      "param": field, "code": "context_length_exceeded"}
    assert e.code == "context_length_exceeded" and e.param == field


def test_chat_prompt_over_the_context(openai_client, tok):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}])
    assert_context_error(info.value, chat_tokens(tok, LONG), 1, "messages")  # at least one token to generate
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}],
                                              max_tokens=10, stream=True)
    assert_context_error(info.value, chat_tokens(tok, LONG), 10, "messages")


def test_chat_prompt_plus_max_tokens_over_the_context(openai_client, tok):
    n = chat_tokens(tok, "Hello")
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                              max_completion_tokens=CONTEXT - n + 1)
    assert_context_error(info.value, n, CONTEXT - n + 1, "messages")
    ok = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=CONTEXT - n, temperature=0, stop=["\n", "."])
    assert ok.choices[0].finish_reason == "stop"  # exactly the room left is allowed


def test_completions_prompt_over_the_context(openai_client, tok):
    n = len(tok(LONG)["input_ids"])
    assert n > CONTEXT
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=MODEL, prompt=LONG, max_tokens=5)
    assert_context_error(info.value, n, 5, "prompt")
    with pytest.raises(openai.BadRequestError) as info:  # token ids, no room left for even one token
        openai_client.completions.create(model=MODEL, prompt=[1] * CONTEXT)
    assert_context_error(info.value, CONTEXT, 1, "prompt")
    huge = "ab " * 1_000_000  # more characters than any prompt that fits: refused before tokenizing
    assert len(huge) > CONTEXT * max(map(len, tok.get_vocab())) * 4
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=MODEL, prompt=huge, max_tokens=7)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert info.value.body["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested more than {CONTEXT + 7} "
        f"tokens (more than {CONTEXT} in the prompt, 7 in the completion). Please reduce the length of the prompt "
        "or completion.")


def test_responses_input_over_the_context(openai_client, tok):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(model=MODEL, input=LONG, store=False)
    assert_context_error(info.value, chat_tokens(tok, LONG), 1, "input")
    n = chat_tokens(tok, "Hello")
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(model=MODEL, input="Hello", max_output_tokens=CONTEXT, store=False)
    assert_context_error(info.value, n, CONTEXT, "input")


def test_anthropic_messages_over_the_context(mesh, tok):
    with anthropic.Anthropic(base_url=mesh.gateway_url, api_key="unused", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": LONG}])
        n = chat_tokens(tok, LONG)
        assert info.value.status_code == 400
        assert info.value.body == {"type": "error", "error": {
            "type": "invalid_request_error", "message": f"prompt is too long: {n} tokens > {CONTEXT} maximum"}}
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model=MODEL, max_tokens=CONTEXT, messages=[{"role": "user", "content": "Hello"}])
        n = chat_tokens(tok, "Hello")
        assert info.value.body["error"] == {
            "type": "invalid_request_error",
            "message": f"input length and `max_tokens` exceed context limit: {n} + {CONTEXT} > {CONTEXT}, "
                       "decrease input length or `max_tokens` and try again"}


async def test_the_context_is_the_smallest_a_live_worker_runs(gateway, client, workers):  # noqa: F811
    """A worker whose engine runs shorter sequences than the model (its --max-model-len, or a small KV
    cache) says so in its load report: requests are held to it, and /v1/models shows it."""
    small = 100
    mesh = await MeshClient.connect(gateway.config.nats_url, name="small-decode")

    async def beat():
        while True:
            await mesh.publish(subjects.load("decode", "decode-small"),
                               LoadReport(role="decode", worker_id="decode-small", interval_s=0.2, max_model_len=small))
            await asyncio.sleep(0.2)

    beating = asyncio.create_task(beat())
    try:
        deadline = time.monotonic() + 5
        while (await client.get("/v1/models")).json()["data"][0]["max_model_len"] != small:
            assert time.monotonic() < deadline, "the gateway never took the worker's limit"
            await asyncio.sleep(0.05)
        r = await client.post("/v1/completions", json={"model": gateway.model, "prompt": [5] * 90, "max_tokens": 20})
        err = assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")
        assert err["message"] == openai_message(90, 20, "prompt").replace(str(CONTEXT), str(small))
    finally:
        beating.cancel()
        await mesh.close()


def test_models_endpoint_reports_the_context(mesh):
    card = httpx.get(mesh.gateway_url + "/v1/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] == CONTEXT
