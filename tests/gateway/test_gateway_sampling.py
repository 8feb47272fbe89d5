"""Gateway sampling surface: the new knobs, logprobs in OpenAI's shape, and n > 1 choices.

Same fake mesh as ``test_gateway`` (real nats-server, scripted workers), with
a worker that answers each request by its seed (the text ends in ``#<seed>``)
and, when asked, attaches made-up logprobs: token i of a request has logprob
``-0.25 * i``, its top list is ``[token, -0.25 * i], [EOS, -1.5], [7, -inf]``
cut to ``top_logprobs``.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import pytest_asyncio

from deepinfer.mesh import MeshClient
from deepinfer.protocol import PrefillRequest, TokenChunk
from test_gateway import (
    DECODE_ID,
    EOS,
    PREFILL_ID,
    UNICODE_TEXT,
    FakeWorkers,
    InProcessGateway,
    Script,
    assert_openai_error,
    chat_body,
    encode,
    render,
    start_nats_server,
    stream_events,
)
from waiting import eventually

EOS_TEXT = "<|im_end|>"


def fake_logprobs(i: int, token: int, k: int) -> list:
    return [-0.25 * i, [[token, -0.25 * i], [EOS, -1.5], [7, float("-inf")]][:k]]


class SeededWorkers(FakeWorkers):
    async def generate(self, req: PrefillRequest, s: Script) -> None:
        sp = req.sampling
        ids = encode(s.text if sp.seed is None else f"{s.text} #{sp.seed}") + [EOS]

        def chunk(i, toks, role, worker, finish=None, error=None):
            logprobs = [fake_logprobs(i + j, t, sp.top_logprobs) for j, t in enumerate(toks)] if sp.logprobs else None
            return TokenChunk(req.request_id, toks, role, worker, finish, error, len(req.prompt_token_ids),
                              s.cached_tokens, logprobs=logprobs)

        if s.first_error and req.request_id.endswith("-1"):  # only choice 1 of an n > 1 request fails
            await self.mesh.publish(req.stream_subject, chunk(0, [], "prefill", PREFILL_ID, "error", s.first_error))
            return
        await self.mesh.publish(req.stream_subject, chunk(0, ids[:1], "prefill", PREFILL_ID))
        for i in range(1, len(ids), s.tokens_per_chunk):
            await asyncio.sleep(s.delay_s)
            part = ids[i : i + s.tokens_per_chunk]
            finish = "stop" if i + len(part) == len(ids) else None
            await self.mesh.publish(req.stream_subject, chunk(i, part, "decode", DECODE_ID, finish))


@pytest.fixture(scope="module")
def nats_url():
    proc, url = start_nats_server()
    yield url
    proc.stop()


@pytest_asyncio.fixture(scope="module")
async def workers(nats_url):
    mesh = await MeshClient.connect(nats_url, name="fake-workers")
    fakes = SeededWorkers(mesh)
    await fakes.start()
    yield fakes
    await fakes.stop()
    await mesh.close()


@pytest_asyncio.fixture(scope="module")
async def gateway(nats_url, workers):
    async with InProcessGateway(nats_url) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            for _ in range(250):  # until the first heartbeats are in
                if (await client.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("gateway never saw the fake workers")
        yield gw


@pytest_asyncio.fixture
async def client(gateway):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=15) as c:
        yield c


@pytest.fixture
def script(workers):
    def set_script(**kw) -> Script:
        workers.script = Script(**kw)
        return workers.script

    yield set_script
    workers.script = Script()


@pytest_asyncio.fixture
async def oai_client(gateway):
    c = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


def expected_bytes(text: str) -> bytes:
    return text.encode() + EOS_TEXT.encode()


# --- sampling parameters reach prefill ------------------------------------------------


async def test_every_sampling_knob_reaches_prefill(client, gateway, workers, script):
    script(text="ok")
    body = chat_body(gateway.model, "Hi", top_k=40, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                     frequency_penalty=-0.5, logit_bias={"15": 5, "2": -100}, min_tokens=3, logprobs=True,
                     top_logprobs=4, max_tokens=20)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    s = workers.prefill_requests[-1].sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (40, 0.05, 1.2, 0.5,
                                                                                                  -0.5)
    assert s.logit_bias == {15: 5.0, 2: -100.0}
    assert (s.min_tokens, s.logprobs, s.top_logprobs, s.max_tokens) == (3, True, 4, 20)


async def test_defaults_leave_the_new_knobs_off(client, gateway, workers, script):
    script(text="ok")
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, top_k=-1))
    assert r.status_code == 200, r.text
    s = workers.prefill_requests[-1].sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (-1, 0.0, 1.0, 0, 0)
    assert (s.logit_bias, s.min_tokens, s.logprobs, s.top_logprobs) == ({}, 0, False, 0)
    assert r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # the vocabulary has 49152 tokens
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "up"}}, "logit_bias"),
        ({"logit_bias": [5, 1]}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
async def test_invalid_sampling_fields_are_400_naming_the_param(client, gateway, workers, extra, param):
    before = len(workers.prefill_requests)
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, stream=stream, **extra))
        assert_openai_error(r, 400, param=param)
    assert len(workers.prefill_requests) == before


async def test_the_openai_client_reports_a_bad_sampling_field(oai_client, gateway):
    with pytest.raises(openai.BadRequestError) as e:
        await oai_client.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": "hi"}],
                                                 presence_penalty=3)
    assert e.value.body["param"] == "presence_penalty"


# --- logprobs -----------------------------------------------------------------------------


async def test_logprobs_have_openais_exact_shape(client, gateway, script):
    script(text="Hi there")
    ids = encode("Hi there") + [EOS]
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, logprobs=True, top_logprobs=3))
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None
    assert len(lp["content"]) == len(ids)
    for i, entry in enumerate(lp["content"]):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] == -0.25 * i
        assert [set(t) for t in entry["top_logprobs"]] == [{"token", "logprob", "bytes"}] * 3
        assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.25 * i, -1.5, -9999.0]  # -inf clamped
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][1] == {"token": EOS_TEXT, "logprob": -1.5, "bytes": list(EOS_TEXT.encode())}
    assert "".join(e["token"] for e in lp["content"]) == "Hi there" + EOS_TEXT

    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, logprobs=True))
    assert all(e["top_logprobs"] == [] for e in r.json()["choices"][0]["logprobs"]["content"])


async def test_logprobs_through_the_openai_client_streaming_and_not(oai_client, gateway, script):
    script(text=UNICODE_TEXT, tokens_per_chunk=2)
    messages = [{"role": "user", "content": "hi"}]
    done = await oai_client.chat.completions.create(model=gateway.model, messages=messages, logprobs=True,
                                                    top_logprobs=2)
    content = done.choices[0].logprobs.content
    assert done.choices[0].message.content == UNICODE_TEXT
    # a token can split a character: its text is U+FFFD, its bytes are exact
    assert any("\ufffd" in c.token for c in content)
    assert b"".join(bytes(c.bytes) for c in content) == expected_bytes(UNICODE_TEXT)
    assert [c.logprob for c in content] == [-0.25 * i for i in range(len(content))]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[1].logprob == -1.5 for c in content)

    stream = await oai_client.chat.completions.create(model=gateway.model, messages=messages, logprobs=True,
                                                      top_logprobs=2, stream=True)
    streamed = [e async for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


async def test_streamed_chunks_carry_the_logprobs_of_their_own_tokens(client, gateway, script):
    s = script(text="one two three", tokens_per_chunk=2)
    events = await stream_events(client, chat_body(gateway.model, logprobs=True, return_token_ids=True))
    chunks = [e["choices"][0] for e in events[1:-1]]
    assert all(len(c["logprobs"]["content"]) == len(c["token_ids"]) for c in chunks)
    assert sum(len(c["token_ids"]) for c in chunks) == len(s.token_ids)
    assert events[0]["choices"][0]["logprobs"] is None  # the role chunk has no token


# --- n > 1 --------------------------------------------------------------------------------


async def test_n_choices_are_independent_requests_with_derived_seeds(client, gateway, workers, script):
    script(text="Answer", cached_tokens=4)
    before = len(workers.prefill_requests)
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, n=3, seed=10, logprobs=True))
    assert r.status_code == 200, r.text
    body = r.json()
    reqs = workers.prefill_requests[before:]
    assert sorted(q.sampling.seed for q in reqs) == [10, 11, 12]
    assert len({q.request_id for q in reqs}) == 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["Answer #10", "Answer #11", "Answer #12"]
    assert all(c["finish_reason"] == "stop" for c in body["choices"])
    assert all(len(c["logprobs"]["content"]) == len(encode(c["message"]["content"])) + 1 for c in body["choices"])
    completion = sum(len(encode(f"Answer #{s}")) + 1 for s in (10, 11, 12))
    prompt = len(encode(render([{"role": "user", "content": "Say hello"}])))
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": 4}}


async def test_n_without_a_seed_leaves_every_choice_unseeded(client, gateway, workers, script):
    script(text="free")
    before = len(workers.prefill_requests)
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, n=2))
    assert [c["message"]["content"] for c in r.json()["choices"]] == ["free", "free"]
    assert [q.sampling.seed for q in workers.prefill_requests[before:]] == [None, None]


async def test_n_choices_stream_through_the_openai_client(oai_client, gateway, script):
    script(text="Streamed", delay_s=0.005)
    stream = await oai_client.chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "hi"}], n=2, seed=5, stream=True,
        stream_options={"include_usage": True}, stop=["#6"])
    texts, finish = {0: "", 1: ""}, {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {0: "Streamed #5", 1: "Streamed "}  # choice 1 (seed 6) was cut by its stop string
    assert finish == {0: "stop", 1: "stop"}
    assert usage.completion_tokens >= len(encode("Streamed #5")) + 1


async def test_a_failing_choice_fails_the_request_and_aborts_the_others(client, gateway, workers, script):
    script(text="word " * 40, first_error="out of KV blocks", delay_s=0.02)
    before = len(workers.prefill_requests)
    r = await client.post("/v1/chat/completions", json=chat_body(gateway.model, n=2))
    err = assert_openai_error(r, 500)
    assert "out of KV blocks" in err["message"]
    survivor = next(q.request_id for q in workers.prefill_requests[before:] if q.request_id.endswith("-0"))
    await eventually(lambda: any(rid == survivor for _, rid in workers.aborts))


async def test_completions_logprobs_have_the_legacy_shape(oai_client, gateway, script):
    script(text="Hi there")
    ids = encode("Hi there") + [EOS]
    r = await oai_client.completions.create(model=gateway.model, prompt="Say hi", logprobs=2, max_tokens=20)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "Hi there"
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == "Hi there" + EOS_TEXT
    assert lp.token_logprobs == [-0.25 * i for i in range(len(ids))]
    # (the last token is EOS itself: a dict keyed by token text holds it once)
    assert [list(t.values()) for t in lp.top_logprobs[:-1]] == [[-0.25 * i, -1.5] for i in range(len(ids) - 1)]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    stream = await oai_client.completions.create(model=gateway.model, prompt="Say hi", logprobs=2, max_tokens=20,
                                                 stream=True)
    streamed = [t async for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert streamed == lp.tokens


def test_swa_replay_passes_from_the_request_to_the_workers_sampling_params():
    """A request chooses bounded replay or exact recompute for a hybrid model's prefix."""
    import pydantic

    from deepinfer.gateway.api import openai_schema as oai
    from deepinfer.gateway.api.chat import sampling_params

    msgs = [{"role": "user", "content": "hi"}]
    for mode in ("bounded", "exact", None):
        req = oai.ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, "swa_replay": mode})
        assert sampling_params(req, 10, 100).swa_replay == mode
    with pytest.raises(pydantic.ValidationError):
        oai.ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, "swa_replay": "fast"})
