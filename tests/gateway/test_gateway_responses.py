"""POST /v1/responses (OpenAI Responses) on the fake mesh, through the official ``openai`` client;
stored responses and ``previous_response_id`` on the session's real redis-server.

The fake workers (``test_gateway``) answer with scripted text, so statuses, tool calls
(``<tool_call>`` JSON in the text), usage and failures are exact.
"""

from __future__ import annotations

import asyncio
import json
import random

import openai
import pytest
import pytest_asyncio

from deepinfer.gateway.api.common import Assembler
from deepinfer.gateway.response_store import ResponseStore
from deepinfer.launcher import free_port
from gateway_harness import SMALL_BODY_LIMIT, client, gateway, nats_url, script, sse_events, workers  # noqa: F401
from test_gateway import UNICODE_TEXT, assert_openai_error, encode, render

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest_asyncio.fixture
async def sdk(gateway):
    c = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=20)
    yield c
    await c.close()


def body(model: str, **kw) -> dict:
    return {"model": model, "input": "Say hello", "max_output_tokens": 100, **kw}


def streamed_text(events) -> str:
    return "".join(d["delta"] for name, d in events if name == "response.output_text.delta")


TEXT_ITEM_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                    "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def collapse(names: list[str]) -> list[str]:
    """Event names with runs of the same name collapsed (the deltas)."""
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


# --- the output assembler -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_assembler_blocks_do_not_depend_on_how_text_is_split(seed):
    text = "Let me check.\n" + CALL + "\n\n" + CALL.replace("Paris", "東京") + "\nDone. "
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 15)) + [len(text)]
    a, last, events = Assembler(parse_tools=True), 0, []
    for i, c in enumerate(cuts):
        events += a.add(text[last:c], final=i == len(cuts) - 1)
        last = c
    assert [(b.kind, b.text if b.kind == "text" else b.call.arguments_obj) for b in a.blocks] == [
        ("text", "Let me check."), ("tool", {"city": "Paris"}), ("tool", {"city": "東京"}), ("text", "Done. ")]
    starts = [e.block.index for e in events if e.kind == "start"]
    stops = [e.block.index for e in events if e.kind == "stop"]
    assert starts == stops == [0, 1, 2, 3]
    assert "".join(e.text for e in events if e.kind == "delta" and e.block.index == 3) == "Done. "


def test_assembler_without_tools_keeps_text_exactly_and_empty_output_gets_a_block():
    a = Assembler(parse_tools=False)
    out = a.add(" Hi " + CALL + " \n") + a.add("", final=True)
    assert "".join(e.text for e in out if e.kind == "delta") == " Hi " + CALL + " \n"
    empty = Assembler(parse_tools=True, keep_empty=True)
    assert [e.kind for e in empty.add("", final=True)] == ["start", "stop"]
    assert Assembler(parse_tools=True).add("", final=True) == []


# --- text, usage, status ---------------------------------------------------------------------


async def test_response_with_instructions_and_usage_through_the_sdk(sdk, gateway, workers, script):
    script(text=UNICODE_TEXT, cached_tokens=3)
    resp = await sdk.responses.create(model=gateway.model, input="Say hello", instructions="Be brief",
                                      max_output_tokens=100, temperature=0.5, top_p=0.9)
    template = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say hello"}]
    assert workers.tokenizer_requests[-1].messages == template
    s = workers.prefill_requests[-1].sampling
    assert (s.temperature, s.top_p, s.max_tokens) == (0.5, 0.9, 100)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.status == "completed"
    assert resp.model == gateway.model and resp.instructions == "Be brief" and resp.store is True
    assert resp.output_text == UNICODE_TEXT
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and [p.type for p in item.content] == ["output_text"]
    n_prompt, n_out = len(encode(render(template))), len(encode(UNICODE_TEXT)) + 1
    assert resp.usage.input_tokens == n_prompt and resp.usage.input_tokens_details.cached_tokens == 3
    assert resp.usage.output_tokens == n_out and resp.usage.total_tokens == n_prompt + n_out
    assert resp.usage.output_tokens_details.reasoning_tokens == 0


async def test_input_items_become_template_messages(sdk, gateway, workers, script):
    script(text="ok")
    await sdk.responses.create(model=gateway.model, input=[
        {"role": "developer", "content": "Rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one"},
                                                        {"type": "input_text", "text": "two"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hi", "annotations": []}]},
        {"role": "user", "content": "three"}])
    assert workers.tokenizer_requests[-1].messages == [
        {"role": "developer", "content": "Rules"}, {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "three"}]
    s = workers.prefill_requests[-1].sampling
    assert s.max_tokens == 256 - len(workers.prefill_requests[-1].prompt_token_ids)  # no limit: the room left


@pytest.mark.parametrize("per_chunk", [1, 3])
async def test_stream_event_sequence_and_text_equal_the_non_streamed_response(client, gateway, script, per_chunk):
    script(text=UNICODE_TEXT, tokens_per_chunk=per_chunk, cached_tokens=2)
    done = (await client.post("/v1/responses", json=body(gateway.model))).json()
    events = await sse_events(client, "/v1/responses", body(gateway.model, stream=True))
    names = [n for n, _ in events]
    assert collapse(names) == ["response.created", "response.in_progress", *TEXT_ITEM_EVENTS, "response.completed"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == name for name, d in events)
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert created["id"] == events[-1][1]["response"]["id"]
    deltas = [d["delta"] for n, d in events if n == "response.output_text.delta"]
    assert all("\ufffd" not in t for t in deltas)
    text = done["output"][0]["content"][0]["text"]
    assert streamed_text(events) == text == UNICODE_TEXT
    by_name = {n: d for n, d in events}
    assert by_name["response.output_text.done"]["text"] == text
    assert by_name["response.content_part.done"]["part"]["text"] == text
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == text
    assert by_name["response.output_item.done"]["item"] == final["output"][0]
    assert final["usage"] == {**done["usage"]}


async def test_sdk_stream_helper_and_raw_stream(sdk, gateway, script):
    script(text=UNICODE_TEXT)
    done = await sdk.responses.create(model=gateway.model, input="hi")
    async with sdk.responses.stream(model=gateway.model, input="hi") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == done.output_text == UNICODE_TEXT
    assert final.usage.output_tokens == done.usage.output_tokens
    raw = await sdk.responses.create(model=gateway.model, input="hi", stream=True)
    types = [e.type async for e in raw]
    assert types[0] == "response.created" and types[-1] == "response.completed"


async def test_max_output_tokens_makes_the_response_incomplete(client, sdk, gateway, script):
    script(text="cut short", eos=False)
    resp = await sdk.responses.create(model=gateway.model, input="hi", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "cut short" and resp.output[0].status == "incomplete"
    events = await sse_events(client, "/v1/responses", body(gateway.model, max_output_tokens=3, stream=True))
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert streamed_text(events) == "cut short"


# --- tools ------------------------------------------------------------------------------------------


async def test_function_calls_streamed_and_not(client, sdk, gateway, workers, script):
    script(text="Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "東京 🦙"), tokens_per_chunk=2)
    resp = await sdk.responses.create(model=gateway.model, input="Weather?", tools=[WEATHER])
    assert workers.tokenizer_requests[-1].tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER["parameters"]}}]
    assert [o.type for o in resp.output] == ["message", "function_call", "function_call"]
    assert resp.output_text == "Let me check."
    calls = resp.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                 ("get_weather", {"city": "東京 🦙"})]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed" for c in calls)
    assert resp.status == "completed" and resp.tools[0].name == "get_weather"

    events = await sse_events(client, "/v1/responses", body(gateway.model, input="Weather?", tools=[WEATHER],
                                                           stream=True))
    call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert collapse([n for n, _ in events]) == ["response.created", "response.in_progress", *TEXT_ITEM_EVENTS,
                                                *call_events, *call_events, "response.completed"]
    added = [d for n, d in events if n == "response.output_item.added"]
    assert [(a["output_index"], a["item"]["type"], a["item"]["status"]) for a in added] == [
        (0, "message", "in_progress"), (1, "function_call", "in_progress"), (2, "function_call", "in_progress")]
    assert added[1]["item"]["arguments"] == ""
    args_done = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert [(d["output_index"], d["name"], json.loads(d["arguments"])) for d in args_done] == [
        (1, "get_weather", {"city": "Paris"}), (2, "get_weather", {"city": "東京 🦙"})]
    assert all(d["item_id"] == a["item"]["id"] for d, a in zip(args_done, added[1:]))

    async with sdk.responses.stream(model=gateway.model, input="Weather?", tools=[WEATHER]) as s:
        final = await s.get_final_response()
    assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == [
        (o.type, getattr(o, "arguments", None)) for o in resp.output]


async def test_function_call_outputs_go_back_as_tool_messages(sdk, gateway, workers, script):
    script(text=CALL)
    first = await sdk.responses.create(model=gateway.model, input="Weather?", tools=[WEATHER], store=False)
    (call,) = [o for o in first.output if o.type == "function_call"]
    script(text="It is sunny.")
    items = [{"role": "user", "content": "Weather?"}, *[o.model_dump(exclude_none=True) for o in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    resp = await sdk.responses.create(model=gateway.model, input=items, tools=[WEATHER])
    assert resp.output_text == "It is sunny."
    assert workers.tokenizer_requests[-1].messages == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]


async def test_tool_choice_none_sends_no_tools_and_parses_nothing(sdk, gateway, workers, script):
    script(text=CALL)
    resp = await sdk.responses.create(model=gateway.model, input="hi", tools=[WEATHER], tool_choice="none")
    assert workers.tokenizer_requests[-1].tools is None
    assert resp.output_text == CALL and [o.type for o in resp.output] == ["message"]


# --- stored responses --------------------------------------------------------------------------------


async def test_previous_response_id_continues_the_conversation(sdk, gateway, workers, script):
    script(text="Paris.")
    first = await sdk.responses.create(model=gateway.model, input="Capital of France?", instructions="Be brief")
    stored = await sdk.responses.retrieve(first.id)
    assert stored.model_dump() == first.model_dump()

    script(text="About 2 million.")
    second = await sdk.responses.create(model=gateway.model, input="Population?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert workers.tokenizer_requests[-1].messages == [  # instructions are not carried over
        {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Population?"}]

    script(text="Yes.")
    async with sdk.responses.stream(model=gateway.model, input="Sure?", instructions="Be kind",
                                    previous_response_id=second.id) as s:
        third = await s.get_final_response()
    assert workers.tokenizer_requests[-1].messages == [
        {"role": "system", "content": "Be kind"},
        {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Population?"}, {"role": "assistant", "content": "About 2 million."},
        {"role": "user", "content": "Sure?"}]
    assert (await sdk.responses.retrieve(third.id)).output_text == "Yes."  # a streamed response is stored too


async def test_previous_response_with_a_function_call_takes_its_output(sdk, gateway, workers, script):
    script(text=CALL)
    first = await sdk.responses.create(model=gateway.model, input="Weather?", tools=[WEATHER])
    (call,) = first.output
    script(text="Sunny.")
    resp = await sdk.responses.create(model=gateway.model, previous_response_id=first.id, tools=[WEATHER],
                                      input=[{"type": "function_call_output", "call_id": call.call_id,
                                              "output": "sunny"}])
    assert resp.output_text == "Sunny."
    assert workers.tokenizer_requests[-1].messages[-1] == {"role": "tool", "tool_call_id": call.call_id,
                                                           "content": "sunny"}


async def test_unstored_unknown_and_deleted_responses_are_404(client, sdk, gateway, script):
    script(text="not kept")
    resp = await sdk.responses.create(model=gateway.model, input="hi", store=False)
    assert resp.store is False
    for missing in (resp.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(missing)
        r = await client.post("/v1/responses", json=body(gateway.model, previous_response_id=missing))
        assert_openai_error(r, 404, param="previous_response_id", code="previous_response_not_found")
    kept = await sdk.responses.create(model=gateway.model, input="hi")
    await sdk.responses.delete(kept.id)
    r = await client.get(f"/v1/responses/{kept.id}")
    assert_openai_error(r, 404)
    assert_openai_error(await client.delete(f"/v1/responses/{kept.id}"), 404)


async def test_redis_down_fails_only_requests_that_need_the_store(client, sdk, gateway, script):
    script(text="still works")
    kept = await sdk.responses.create(model=gateway.model, input="hi")
    state = gateway.app.state
    healthy, state.responses_store = state.responses_store, ResponseStore(f"redis://127.0.0.1:{free_port()}")
    try:
        resp = await sdk.responses.create(model=gateway.model, input="hi")  # store=True: storing is skipped
        assert resp.output_text == "still works"
        events = await sse_events(client, "/v1/responses", body(gateway.model, stream=True))
        assert events[-1][0] == "response.completed"
        r = await client.post("/v1/responses", json=body(gateway.model, previous_response_id=kept.id))
        assert_openai_error(r, 503, code="store_unavailable")
        assert_openai_error(await client.get(f"/v1/responses/{kept.id}"), 503)
    finally:
        await state.responses_store.aclose()
        state.responses_store = healthy
    r = await client.post("/v1/responses", json=body(gateway.model, previous_response_id=kept.id))
    assert r.status_code == 200, r.text


# --- failures ----------------------------------------------------------------------------------------


async def test_worker_failures(client, sdk, gateway, script):
    script(first_error="out of KV blocks")
    r = await client.post("/v1/responses", json=body(gateway.model))
    assert "out of KV blocks" in assert_openai_error(r, 500)["message"]
    r = await client.post("/v1/responses", json=body(gateway.model, stream=True))
    assert_openai_error(r, 500)

    script(text="a b c d e f", error_after=2)
    events = await sse_events(client, "/v1/responses", body(gateway.model, stream=True))
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    assert "CUDA on fire" in events[-2][1]["message"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and "CUDA on fire" in failed["error"]["message"]
    assert streamed_text(events) and [d["sequence_number"] for _, d in events] == list(range(len(events)))
    stream = await sdk.responses.create(model=gateway.model, input="hi", stream=True)
    types = [e.type async for e in stream]
    assert types[-2:] == ["error", "response.failed"]


MALFORMED = [
    # (name, raw body or builder, status, param)
    ("invalid json", b'{"input": ', 400, None),
    ("not an object", b'"hello"', 400, None),
    ("missing input", lambda m: {"model": m}, 400, "input"),
    ("input a number", lambda m: body(m, input=42), 400, "input"),
    ("empty input list", lambda m: body(m, input=[]), 400, "input"),
    ("unknown item type", lambda m: body(m, input=[{"type": "item_reference", "id": "x"}]), 400, "input[0]"),
    ("image content", lambda m: body(m, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]), 400, "input[0].content[0]"),
    ("bad role", lambda m: body(m, input=[{"role": "tool", "content": "x"}]), 400, "input[0].role"),
    ("function_call_output without call_id", lambda m: body(m, input=[
        {"type": "function_call_output", "output": "x"}]), 400, "input[0].call_id"),
    ("function_call_output for an unknown call", lambda m: body(m, input=[
        {"type": "function_call_output", "call_id": "call_nope", "output": "x"}]), 400, "input"),
    ("temperature above 2", lambda m: body(m, temperature=2.5), 400, "temperature"),
    ("top_p zero", lambda m: body(m, top_p=0), 400, "top_p"),
    ("max_output_tokens zero", lambda m: body(m, max_output_tokens=0), 400, "max_output_tokens"),
    ("stream a string", lambda m: body(m, stream="yes"), 400, "stream"),
    ("web_search tool", lambda m: body(m, tools=[{"type": "web_search"}]), 400, "tools[0].type"),
    ("function tool without a name", lambda m: body(m, tools=[{"type": "function"}]), 400, "tools[0].name"),
    ("tool_choice required without tools", lambda m: body(m, tool_choice="required"), 400, "tool_choice"),
    ("named tool_choice of an unknown tool", lambda m: body(m, tools=[WEATHER], tool_choice={
        "type": "function", "name": "nope"}), 400, "tool_choice"),
    ("json_schema text format with an unsupported keyword", lambda m: body(m, text={"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "array", "uniqueItems": True}}}), 400, "text"),
    ("prompt + max_output_tokens over the context", lambda m: body(m, max_output_tokens=100_000), 400,
     "input"),  # (OpenAI's context_length_exceeded names the prompt's field)
    ("template refuses the content", lambda m: body(m, input="TRIGGER_BAD_REQUEST"), 400, "input"),
    ("unknown model", lambda m: body("gpt-nope"), 404, "model"),
    ("unknown previous_response_id", lambda m: body(m, previous_response_id="resp_unknown"), 404,
     "previous_response_id"),
    ("body too large", lambda m: body(m, instructions="x" * (SMALL_BODY_LIMIT + 1)), 413, None),
]


@pytest.mark.parametrize("name, make, status, param", MALFORMED, ids=[c[0] for c in MALFORMED])
async def test_malformed_requests_get_openai_errors(client, gateway, name, make, status, param):
    for stream in (False, True):
        raw = make if isinstance(make, bytes) else json.dumps({**make(gateway.model), "stream": stream}
                                                              if name != "stream a string" else make(gateway.model))
        r = await client.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
        assert not r.headers["content-type"].startswith("text/event-stream")
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
        if param is not None:
            assert err["param"] == param, err


async def test_server_is_healthy_after_the_malformed_suite(client, sdk, gateway, script):
    await asyncio.gather(*(client.post("/v1/responses", content=b"{nope") for _ in range(5)))
    assert (await client.get("/health")).status_code == 200
    script(text="still here")
    assert (await sdk.responses.create(model=gateway.model, input="hi")).output_text == "still here"
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.responses.create(model=gateway.model, input="hi", temperature=9)
    assert e.value.body["param"] == "temperature"
