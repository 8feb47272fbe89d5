"""The walking skeleton end to end: the official openai client against a real mesh.

Every request crosses gateway -> tokenizer -> prefill -> (storage tier) -> decode
-> gateway, each a separate process started by the launcher.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch

from deepinfer.mesh import MeshClient
from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model
from deepinfer.protocol import LoadReport, subjects, unpack

MODEL = DEFAULT_MODEL_NAME
PASSAGE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
           "combined movable metal type, oil-based ink and a screw press adapted from wine making. ")
# User messages whose chat prompts span ~30 to ~500 tokens.
VARIED = [
    "What is 2 + 2?",
    "Name three animals that live in the ocean and say one fact about each.",
    "Read this and summarise it in one sentence: " + PASSAGE * 3,
    "Here is a text:\n" + PASSAGE * 8 + "\nWhat invention does it describe?",
    "Context:\n" + PASSAGE * 13 + "\nQuestion: who is mentioned in the context? Answer briefly.",
]


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 32)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_capital_of_france_non_streaming(openai_client):
    resp = chat(openai_client, "What is the capital of France?")
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens > 10 and resp.usage.completion_tokens > 0


def test_capital_of_france_streaming(openai_client):
    stream = chat(openai_client, "What is the capital of France?", stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in text


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_default_model(progress=False)).eval()


def test_greedy_matches_transformers_token_for_token(openai_client, hf_model):
    lengths = []
    for content in VARIED:
        resp = chat(openai_client, content, max_tokens=24, extra_body={"return_token_ids": True}).to_dict()
        prompt_ids, out_ids = resp["prompt_token_ids"], resp["choices"][0]["token_ids"]
        lengths.append(len(prompt_ids))
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)
        assert out_ids == ref[0, len(prompt_ids):].tolist(), f"prompt of {len(prompt_ids)} tokens"
    assert min(lengths) >= 20 and max(lengths) <= 500 and max(lengths) > 400, lengths


def test_completions_greedy_matches_transformers_and_streams_the_same_text(openai_client, hf_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_default_model(progress=False))
    prompt = "The three primary colors are"
    ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    done = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 16
    assert done.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    stream = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == done.choices[0].text


def test_responses_and_anthropic_messages_give_the_chat_answer_through_the_real_mesh(mesh, openai_client):
    """Same conversation, same template, greedy: the three chat-style APIs agree, streaming and not."""
    import anthropic

    question = "Name the largest planet in the solar system."
    want = chat(openai_client, question, max_tokens=12, extra_body={"ignore_eos": True}).choices[0].message.content
    r = openai_client.responses.create(model=MODEL, input=question, max_output_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}, store=False)
    assert r.output_text == want
    with anthropic.Anthropic(base_url=mesh.gateway_url, api_key="unused", max_retries=0) as client:
        msg = client.messages.create(model=MODEL, max_tokens=12, extra_body={"ignore_eos": True, "temperature": 0},
                                     messages=[{"role": "user", "content": question}])
        assert msg.content[0].text == want and msg.stop_reason == "max_tokens"
        with client.messages.stream(model=MODEL, max_tokens=12, extra_body={"ignore_eos": True, "temperature": 0},
                                    messages=[{"role": "user", "content": question}]) as stream:
            assert "".join(stream.text_stream) == want


def test_streamed_deltas_concatenate_to_the_non_streamed_text(openai_client):
    content = "Write two sentences about the moon, with an emoji."
    full = chat(openai_client, content, max_tokens=48).choices[0].message.content
    stream = chat(openai_client, content, max_tokens=48, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full


def test_eight_concurrent_requests_are_correct_and_batched_in_decode(mesh):
    prompts = [f"Count from {i} to {i + 5}, separated by commas." for i in range(8)]
    sync = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key="t", max_retries=0, timeout=300)
    expected = [chat(sync, p, max_tokens=24).choices[0].message.content for p in prompts]

    async def run():
        client = openai.AsyncOpenAI(base_url=mesh.gateway_url + "/v1", api_key="t", max_retries=0, timeout=300)
        mc = await MeshClient.connect(mesh.nats_url, "test-observer")
        peaks: list[int] = []

        async def on_load(msg):
            r = unpack(msg.data)
            if isinstance(r, LoadReport) and r.role == "decode":
                peaks.append(r.peak_batch_size)

        await mc.nc.subscribe(subjects.LOAD_ALL, cb=on_load)
        outs = await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=24, temperature=0) for p in prompts))
        deadline = time.monotonic() + 10  # the decode worker's next load reports carry the peak
        while max(peaks, default=0) <= 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await mc.close()
        await client.close()
        return [o.choices[0].message.content for o in outs], max(peaks, default=0)

    got, peak = asyncio.run(run())
    assert got == expected
    assert peak > 1, "decode never ran two sequences in one step"


def _post(mesh, body, raw=None):
    data = raw if raw is not None else json.dumps(body)
    return httpx.post(mesh.gateway_url + "/v1/chat/completions", content=data,
                      headers={"content-type": "application/json"}, timeout=30)


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("case,body,raw,status,param", [
    ("invalid json", None, "{not json", 400, None),
    ("missing messages", {"model": MODEL}, None, 400, "messages"),
    ("messages wrong type", {"model": MODEL, "messages": "hi"}, None, 400, "messages"),
    ("max_tokens wrong type", {"model": MODEL, "messages": MSG, "max_tokens": "ten"}, None, 400, "max_tokens"),
    ("unknown model", {"model": "no-such-model", "messages": MSG}, None, 404, "model"),
    ("max_tokens zero", {"model": MODEL, "messages": MSG, "max_tokens": 0}, None, 400, "max_tokens"),
    ("max_tokens negative", {"model": MODEL, "messages": MSG, "max_tokens": -5}, None, 400, "max_tokens"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_gets_openai_error_before_any_sse_bytes(mesh, case, body, raw, status, param, stream):
    if body is not None:
        body = dict(body, stream=stream)
    r = _post(mesh, body, raw)
    assert r.status_code == status, (case, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param


def test_official_client_raises_typed_errors(openai_client):
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=0)


def test_cached_tokens_are_reported_and_never_shared_across_cache_salts(openai_client):
    """usage.prompt_tokens_details.cached_tokens reports reused KV; another tenant's salt hits nothing;
    the traffic class comes from the field or the X-Traffic-Class header and is validated."""
    content = "Context:\n" + PASSAGE * 6 + "\nSay one word about the context."
    first = chat(openai_client, content, max_tokens=4, extra_body={"cache_salt": "tenant-a"})
    again = chat(openai_client, content, max_tokens=4, extra_body={"cache_salt": "tenant-a"},
                 extra_headers={"X-Traffic-Class": "agent"})
    other = chat(openai_client, content, max_tokens=4, extra_body={"cache_salt": "tenant-b", "traffic_class": "agent"})
    assert first.usage.prompt_tokens > 200
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == other.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="traffic class"):
        chat(openai_client, content, max_tokens=4, extra_headers={"X-Traffic-Class": "batch"})


def test_models_and_health(mesh):
    models = httpx.get(mesh.gateway_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    health = httpx.get(mesh.gateway_url + "/health")
    assert health.status_code == 200 and health.json()["workers"]["decode"] >= 1
    assert health.json()["kv_index"]["redis_ok"] is True


def test_the_gateway_kvindex_and_balancer_run_without_torch(mesh):
    """Only the engines (and the tokenizer, through transformers' ``AutoTokenizer``) load torch: the
    gateway, kvindex and balancer start in a fraction of the time and memory (a dense model's
    balancer imports its EPLB tracker only when an MoE model reports; the kvindex reads block
    headers and checks payloads without tensors)."""
    from pathlib import Path

    for service in ("gateway", "kvindex", "balancer"):
        for proc in mesh.processes[service]:
            assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text(), service
    assert any("libtorch" in Path(f"/proc/{p.pid}/maps").read_text() for p in mesh.processes["decode"])


# Killing the decode worker mid-stream: tests/reliability/test_failover.py's
# test_only_decode_worker_killed_ends_the_stream_with_a_clear_error_event (mock workers: the gateway's
# path is the same, and a real engine here cost a private mesh of ~50 s).
