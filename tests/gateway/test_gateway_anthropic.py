"""POST /v1/messages (Anthropic Messages) on the fake mesh, through the official ``anthropic`` client.

The fake workers (``test_gateway``) answer with scripted text, so stop reasons, tool calls
(``<tool_call>`` JSON in the text), usage and failures are exact.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
import pytest_asyncio

from deepinfer.protocol import subjects
from gateway_harness import SMALL_BODY_LIMIT, client, gateway, nats_url, script, sse_events, workers  # noqa: F401
from test_gateway import UNICODE_TEXT, encode, render
from waiting import eventually

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HELLO = [{"role": "user", "content": "Say hello"}]


@pytest_asyncio.fixture
async def sdk(gateway):
    c = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=20)
    yield c
    await c.close()


def body(model: str, **kw) -> dict:
    return {"model": model, "max_tokens": 100, "messages": HELLO, **kw}


def prompt_len(messages: list[dict]) -> int:
    return len(encode(render(messages)))


def event_names(events) -> list[str]:
    return [name for name, _ in events]


def streamed_text(events) -> str:
    return "".join(d["delta"]["text"] for name, d in events
                   if name == "content_block_delta" and d["delta"]["type"] == "text_delta")


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    data = r.json()
    assert set(data) == {"type", "error"} and data["type"] == "error"
    assert set(data["error"]) == {"type", "message"}
    assert data["error"]["type"] == kind
    assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    return data["error"]


# --- text, usage, stop reasons ----------------------------------------------------------------


async def test_message_with_system_and_usage_through_the_sdk(sdk, gateway, workers, script):
    script(text=UNICODE_TEXT, cached_tokens=3)
    msg = await sdk.messages.create(model=gateway.model, max_tokens=100, system="Be brief", messages=HELLO,
                                    extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20})
    template = [{"role": "system", "content": "Be brief"}, *HELLO]
    assert workers.tokenizer_requests[-1].messages == template
    s = workers.prefill_requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.5, 0.9, 20, 100)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == gateway.model
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == UNICODE_TEXT
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)
    n_prompt = prompt_len(template)
    assert msg.usage.input_tokens == n_prompt - 3  # Anthropic: prompt tokens not read from cache
    assert msg.usage.cache_read_input_tokens == 3 and msg.usage.cache_creation_input_tokens == 0
    assert msg.usage.output_tokens == len(encode(UNICODE_TEXT)) + 1  # + EOS


async def test_system_blocks_and_content_blocks_become_text(sdk, gateway, workers, script):
    script(text="ok")
    await sdk.messages.create(
        model=gateway.model, max_tokens=10, system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                  {"role": "assistant", "content": "hi"}, {"role": "user", "content": "three"}])
    assert workers.tokenizer_requests[-1].messages == [
        {"role": "system", "content": "A\nB"}, {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "three"}]


@pytest.mark.parametrize("per_chunk", [1, 2, 3])
async def test_stream_event_sequence_and_text_equal_the_non_streamed_message(client, gateway, script, per_chunk):
    script(text=UNICODE_TEXT, tokens_per_chunk=per_chunk, cached_tokens=2)
    done = (await client.post("/v1/messages", json=body(gateway.model))).json()
    events = await sse_events(client, "/v1/messages", body(gateway.model, stream=True),
                              headers={"anthropic-version": "2023-06-01", "x-api-key": "whatever"})
    names = event_names(events)
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(d["type"] == name for name, d in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"]["input_tokens"] == done["usage"]["input_tokens"]
    assert start["usage"]["cache_read_input_tokens"] == 2
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [d["delta"]["text"] for name, d in events if name == "content_block_delta"]
    assert all("\ufffd" not in t for t in deltas)
    assert streamed_text(events) == done["content"][0]["text"] == UNICODE_TEXT
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == done["usage"]["output_tokens"]


async def test_sdk_stream_helper_accumulates_the_same_message(sdk, gateway, script):
    script(text=UNICODE_TEXT, cached_tokens=4)
    done = await sdk.messages.create(model=gateway.model, max_tokens=100, messages=HELLO)
    async with sdk.messages.stream(model=gateway.model, max_tokens=100, messages=HELLO) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == final.content[0].text == done.content[0].text
    assert final.stop_reason == done.stop_reason == "end_turn"
    assert final.usage.output_tokens == done.usage.output_tokens
    assert final.usage.input_tokens == done.usage.input_tokens
    assert final.usage.cache_read_input_tokens == 4

    raw = await sdk.messages.create(model=gateway.model, max_tokens=100, messages=HELLO, stream=True)
    types = [event.type async for event in raw]
    assert types[0] == "message_start" and types[-1] == "message_stop"


async def test_max_tokens_stop_reason(client, sdk, gateway, script):
    script(text="cut short", eos=False)
    msg = await sdk.messages.create(model=gateway.model, max_tokens=3, messages=HELLO)
    assert msg.stop_reason == "max_tokens" and msg.content[0].text == "cut short"
    events = await sse_events(client, "/v1/messages", body(gateway.model, max_tokens=3, stream=True))
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


async def test_stop_sequence_cuts_the_text_reports_it_and_aborts_the_worker(client, sdk, gateway, workers, script):
    script(text="The answer is 42. It is final.", delay_s=0.005)
    msg = await sdk.messages.create(model=gateway.model, max_tokens=100, messages=HELLO,
                                    stop_sequences=["final", "swer is 4"])
    assert msg.content[0].text == "The an"
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "swer is 4")
    events = await sse_events(client, "/v1/messages", body(gateway.model, stream=True, stop_sequences=["42."]))
    assert streamed_text(events) == "The answer is "
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "42."}
    rid = workers.prefill_requests[-1].request_id
    await eventually(lambda: (subjects.DECODE_ABORT_ANY, rid) in workers.aborts)


# --- tools -------------------------------------------------------------------------------------


async def test_tool_use_blocks_streamed_and_not(client, sdk, gateway, workers, script):
    script(text="Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "東京 🦙"), tokens_per_chunk=2)
    msg = await sdk.messages.create(model=gateway.model, max_tokens=100, messages=HELLO, tools=[WEATHER])
    assert workers.tokenizer_requests[-1].tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"], "description": "Weather of a city"}}]
    assert [b.type for b in msg.content] == ["text", "tool_use", "tool_use"]
    assert msg.content[0].text == "Let me check."
    assert [(b.name, b.input) for b in msg.content[1:]] == [("get_weather", {"city": "Paris"}),
                                                           ("get_weather", {"city": "東京 🦙"})]
    assert all(b.id.startswith("toolu_") for b in msg.content[1:]) and msg.content[1].id != msg.content[2].id
    assert msg.stop_reason == "tool_use"

    events = await sse_events(client, "/v1/messages", body(gateway.model, stream=True, tools=[WEATHER]))
    starts = [d for name, d in events if name == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "text"), (1, "tool_use"),
                                                                          (2, "tool_use")]
    assert starts[1]["content_block"]["input"] == {} and starts[1]["content_block"]["name"] == "get_weather"
    json_deltas = [d for name, d in events if name == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert [(d["index"], json.loads(d["delta"]["partial_json"])) for d in json_deltas] == [
        (1, {"city": "Paris"}), (2, {"city": "東京 🦙"})]
    stops = [d["index"] for name, d in events if name == "content_block_stop"]
    assert stops == [0, 1, 2]
    assert streamed_text(events) == "Let me check."
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"

    async with sdk.messages.stream(model=gateway.model, max_tokens=100, messages=HELLO, tools=[WEATHER]) as s:
        final = await s.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [(b.type, getattr(b, "input", None))
                                                                            for b in msg.content]


async def test_tool_results_go_back_as_tool_messages(sdk, gateway, workers, script):
    script(text=CALL)
    first = await sdk.messages.create(model=gateway.model, max_tokens=100, messages=HELLO, tools=[WEATHER])
    (call,) = first.content
    script(text="It is sunny.")
    history = [*HELLO, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"},
                                            {"type": "text", "text": "Thanks"}]}]
    msg = await sdk.messages.create(model=gateway.model, max_tokens=100, messages=history, tools=[WEATHER])
    assert msg.content[0].text == "It is sunny." and msg.stop_reason == "end_turn"
    assert workers.tokenizer_requests[-1].messages == [
        *HELLO,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ]
    history[-1]["content"] = [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                               "content": [{"type": "text", "text": "no network"}]}]
    await sdk.messages.create(model=gateway.model, max_tokens=100, messages=history, tools=[WEATHER])
    assert workers.tokenizer_requests[-1].messages[-1] == {"role": "tool", "tool_call_id": call.id,
                                                           "content": "Error: no network"}


async def test_tool_choice_none_sends_no_tools_and_parses_nothing(sdk, gateway, workers, script):
    script(text=CALL)
    msg = await sdk.messages.create(model=gateway.model, max_tokens=100, messages=HELLO, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    assert workers.tokenizer_requests[-1].tools is None
    assert msg.content[0].text == CALL and msg.stop_reason == "end_turn"


async def test_count_tokens(sdk, gateway, script):
    count = await sdk.messages.count_tokens(model=gateway.model, messages=HELLO, system="Be brief")
    assert count.input_tokens == prompt_len([{"role": "system", "content": "Be brief"}, *HELLO])


# --- failures ------------------------------------------------------------------------------------


async def test_worker_failures_in_anthropic_shape(client, sdk, gateway, script):
    script(first_error="out of KV blocks")
    r = await client.post("/v1/messages", json=body(gateway.model))
    assert "out of KV blocks" in assert_anthropic_error(r, 500, "api_error")["message"]
    r = await client.post("/v1/messages", json=body(gateway.model, stream=True))
    assert_anthropic_error(r, 500, "api_error")

    script(prefill_worker="prefill-doomed-a", prefill_silent=True)
    r = await client.post("/v1/messages", json=body(gateway.model))
    assert "prefill-doomed-a" in assert_anthropic_error(r, 529, "overloaded_error")["message"]

    script(text="a b c d e f", error_after=2)
    events = await sse_events(client, "/v1/messages", body(gateway.model, stream=True))
    name, data = events[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "api_error"
    assert "CUDA on fire" in data["error"]["message"]
    assert "message_stop" not in event_names(events) and streamed_text(events)
    with pytest.raises(anthropic.APIStatusError, match="CUDA on fire"):
        async with sdk.messages.stream(model=gateway.model, max_tokens=100, messages=HELLO) as s:
            async for _ in s:
                pass




MALFORMED = [
    # (name, raw body or dict builder, status, error type)
    ("invalid json", b'{"model": ', 400, "invalid_request_error"),
    ("not an object", b"[1, 2]", 400, "invalid_request_error"),
    ("missing max_tokens", lambda m: {"model": m, "messages": HELLO}, 400, "invalid_request_error"),
    ("missing model", lambda m: {"max_tokens": 5, "messages": HELLO}, 400, "invalid_request_error"),
    ("max_tokens zero", lambda m: body(m, max_tokens=0), 400, "invalid_request_error"),
    ("max_tokens a string", lambda m: body(m, max_tokens="5"), 400, "invalid_request_error"),
    ("no messages", lambda m: body(m, messages=[]), 400, "invalid_request_error"),
    ("system role in messages", lambda m: body(m, messages=[{"role": "system", "content": "x"}]), 400,
     "invalid_request_error"),
    ("image block", lambda m: body(m, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), 400,
     "invalid_request_error"),
    ("empty text block", lambda m: body(m, messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]),
     400, "invalid_request_error"),
    ("temperature above 1", lambda m: body(m, temperature=1.5), 400, "invalid_request_error"),
    ("negative top_k", lambda m: body(m, top_k=-1), 400, "invalid_request_error"),
    ("stop_sequences a string", lambda m: body(m, stop_sequences="END"), 400, "invalid_request_error"),
    ("empty stop sequence", lambda m: body(m, stop_sequences=[""]), 400, "invalid_request_error"),
    ("tool without input_schema", lambda m: body(m, tools=[{"name": "f"}]), 400, "invalid_request_error"),
    ("bad tool name", lambda m: body(m, tools=[{**WEATHER, "name": "get weather"}]), 400, "invalid_request_error"),
    ("server tool", lambda m: body(m, tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400,
     "invalid_request_error"),
    ("tool_choice any without tools", lambda m: body(m, tool_choice={"type": "any"}), 400,
     "invalid_request_error"),
    ("tool_choice tool of an unknown tool", lambda m: body(m, tools=[WEATHER], tool_choice={
        "type": "tool", "name": "nope"}), 400, "invalid_request_error"),
    ("tool_result for an unknown id", lambda m: body(m, messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]), 400, "invalid_request_error"),
    ("tool_use in a user turn", lambda m: body(m, messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]), 400, "invalid_request_error"),
    ("assistant prefill", lambda m: body(m, messages=[*HELLO, {"role": "assistant", "content": "Sure"}]), 400,
     "invalid_request_error"),
    ("prompt + max_tokens over the context", lambda m: body(m, max_tokens=100_000), 400, "invalid_request_error"),
    ("template refuses the content", lambda m: body(m, messages=[{"role": "user", "content": "TRIGGER_BAD_REQUEST"}]),
     400, "invalid_request_error"),
    ("unknown model", lambda m: body("claude-nope"), 404, "not_found_error"),
    ("body too large", lambda m: body(m, system="x" * (SMALL_BODY_LIMIT + 1)), 413, "request_too_large"),
]


@pytest.mark.parametrize("name, make, status, kind", MALFORMED, ids=[c[0] for c in MALFORMED])
async def test_malformed_requests_get_anthropic_errors(client, gateway, name, make, status, kind):
    raw = make if isinstance(make, bytes) else json.dumps(make(gateway.model)).encode()
    for stream in (False, True):
        if stream and not isinstance(make, bytes):
            raw = json.dumps({**make(gateway.model), "stream": True}).encode()
        r = await client.post("/v1/messages", content=raw, headers={"content-type": "application/json"})
        assert_anthropic_error(r, status, kind)
        assert not r.headers["content-type"].startswith("text/event-stream")


async def test_server_is_healthy_after_the_malformed_suite(client, sdk, gateway, script):
    await asyncio.gather(*(client.post("/v1/messages", content=b"{nope") for _ in range(5)))
    assert (await client.get("/health")).status_code == 200
    script(text="still here")
    msg = await sdk.messages.create(model=gateway.model, max_tokens=20, messages=HELLO)
    assert msg.content[0].text == "still here"
    with pytest.raises(anthropic.NotFoundError):
        await sdk.messages.create(model="claude-nope", max_tokens=20, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as e:
        await sdk.messages.create(model=gateway.model, max_tokens=20, messages=HELLO,
                                    extra_body={"temperature": 3})
    assert e.value.body["error"]["type"] == "invalid_request_error"
