"""Tool-call parsing from generated text (``deepinfer.gateway.api.tools``), alone and through the
gateway on the fake mesh (``gateway_harness``: the workers script the model's text) with the
official ``openai`` client for chat completions, and the Responses and Anthropic Messages APIs."""

import json
import random

import openai
import pytest

from deepinfer.gateway.api.tools import ToolCallParser
from gateway_harness import client, gateway, nats_url, script, sse_events, workers  # noqa: F401

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def split_feed(text: str, cuts: list[int]):
    p = ToolCallParser()
    out, calls, last = [], [], 0
    for c in sorted(cuts) + [len(text)]:
        t, done = p.feed(text[last:c])
        out.append(t)
        calls += done
        last = c
    out.append(p.flush())
    return "".join(out), calls


@pytest.mark.parametrize("seed", range(20))
def test_any_split_gives_the_same_text_and_calls(seed):
    text = "Let me check. " + CALL + " And " + CALL.replace("Paris", "東京 🦙") + " done <tool_ca"
    rng = random.Random(seed)
    cuts = rng.sample(range(1, len(text)), 12)
    out, calls = split_feed(text, cuts)
    assert out == "Let me check.  And  done <tool_ca"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "東京 🦙"})]


def test_tags_never_leak_partially_and_list_form_and_bad_json():
    p = ToolCallParser()
    assert p.feed("abc <tool") == ("abc ", [])  # "<tool" may start a tag: held back
    text, calls = p.feed('_call>[{"name": "a", "arguments": "{\\"x\\": 1}"}, {"name": "b"}]</tool_call>')
    assert text == "" and [(c.name, c.arguments_obj) for c in calls] == [("a", {"x": 1}), ("b", {})]
    bad = "<tool_call>{not json}</tool_call>"
    assert ToolCallParser().feed(bad) == (bad, [])
    assert ToolCallParser(enabled=False).feed(CALL) == (CALL, [])
    assert len({c.id for c in calls}) == 2


def test_whitespace_between_and_after_calls_is_not_content_but_text_after_a_call_is():
    two = CALL + "\n" + CALL + "\n"
    for cuts in ([], [len(CALL) + 1], [len(CALL), len(CALL) + 1, len(two) - 1]):
        text, calls = split_feed(two, cuts)
        assert text == "" and len(calls) == 2
    assert split_feed(CALL + "\n Then more.", [len(CALL) + 1])[0] == "\n Then more."
    assert split_feed("  " + CALL, [])[0] == "  "  # before any call: text, as sent


# --- calls read by structure ---------------------------------------------------------

# a string value holding both tags, quotes and a backslash: only JSON structure tells where the call ends
TRICKY = {"text": 'say "</tool_call>" then <tool_call> \\ {"name": "x"}', "n": 1}


def call_text(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


@pytest.mark.parametrize("seed", range(20))
def test_a_string_value_may_hold_the_closing_tag_whatever_the_split(seed):
    text = "Sure. " + call_text("note", TRICKY) + "\n" + CALL + " after"
    out, calls = split_feed(text, random.Random(seed).sample(range(1, len(text)), 12))
    assert out == "Sure.  after"
    assert [(c.name, c.arguments_obj) for c in calls] == [("note", TRICKY), ("get_weather", {"city": "Paris"})]


def test_a_call_is_released_at_the_closing_tag_after_its_json_and_malformed_calls_stay_text():
    p = ToolCallParser()
    head = '<tool_call>\n{"name": "note", "arguments": {"text": "a </tool_call>'
    assert p.feed(head) == ("", [])  # the tag is inside a string: the call is still open
    text, calls = p.feed(' b"}}\n</tool_call>')
    assert text == "" and [(c.name, c.arguments_obj) for c in calls] == [("note", {"text": "a </tool_call> b"})]
    # text between the JSON and the closing tag: malformed, text through that tag; the next call parses
    junk = '<tool_call>{"name": "f", "arguments": {"x": "</tool_call>"}} junk</tool_call>'
    text, calls = ToolCallParser().feed(junk + CALL)
    assert text == junk and [c.name for c in calls] == ["get_weather"]
    # a structural error before a closing tag: malformed, text at once (no waiting for a later tag)
    bad = '<tool_call>{"name": oops "</tool_call>'
    assert ToolCallParser().feed(bad) == (bad, [])


def test_a_call_cut_at_max_tokens_is_dropped_but_a_call_the_model_left_open_is_text():
    cut = '<tool_call>\n{"name": "note", "arguments": {"text": "a </tool_call> b'
    for truncated, rest in ((True, ""), (False, "\n" + cut)):
        p = ToolCallParser()
        text, calls = p.feed("Hi " + CALL + "\n" + cut)
        assert text == "Hi " and [c.name for c in calls] == ["get_weather"]
        assert p.flush(truncated=truncated) == rest
    for cut_tag in ("<", "<tool_ca", "<tool_call"):  # the tag of a call cut before it was whole: no markup
        p = ToolCallParser()
        assert p.feed("Hi " + cut_tag) == ("Hi ", [])
        assert p.flush(truncated=True) == ""
    p = ToolCallParser()
    assert p.feed("Hi <tool_ca") == ("Hi ", [])
    assert p.flush() == "<tool_ca"  # the model stopped there itself: text


@pytest.mark.parametrize("seed", range(10))
def test_max_calls_keeps_the_first_calls_and_nothing_after_them_whatever_the_split(seed):
    listed = '<tool_call>\n[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]\n</tool_call>'
    for text, names, out in (("Sure. " + CALL + "\n" + CALL + " after", ["get_weather"], "Sure. "),
                             (listed + " after", ["a"], "")):  # a list in one tag counts call by call
        cuts = random.Random(seed).sample(range(1, len(text)), 8)
        p = ToolCallParser(max_calls=1)
        pieces = [text[i:j] for i, j in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)])]
        results = [p.feed(piece) for piece in pieces]
        assert "".join(t for t, _ in results) + p.flush() == out
        assert [c.name for _, cs in results for c in cs] == names and p.done
    p = ToolCallParser()
    p.feed(CALL + CALL)
    assert not p.done and len(p.calls) == 2  # no limit


# --- through the gateway (fake workers scripting the model's text) ---------------------

NOTE = {"type": "function", "function": {"name": "note", "description": "Write a note",
                                         "parameters": {"type": "object", "properties": {"text": {"type": "string"},
                                                                                         "n": {"type": "integer"}}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Note this, then the weather in Paris and London."}]
# a complete call, then a second one cut by max_tokens (the fakes end it with finish "length")
CUT_SECOND = call_text("note", TRICKY) + "\n" + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lon'


async def openai_chat(url: str, model: str, stream: bool) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, [(name, arguments)], finish_reason) of one chat completion via the official client."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as sdk:
        kw = dict(model=model, messages=ASK, tools=[NOTE, WEATHER])
        if not stream:
            c = (await sdk.chat.completions.create(**kw)).choices[0]
            calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
            return c.message.content or "", calls, c.finish_reason
        content, deltas, finish = "", [], None
        async for chunk in await sdk.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                deltas += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        assert [d.index for d in deltas] == list(range(len(deltas)))
        return content, [(d.function.name, json.loads(d.function.arguments)) for d in deltas], finish


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_argument_holding_the_closing_tag_is_a_call(gateway, script, stream):
    script(text="Noting." + call_text("note", TRICKY), tokens_per_chunk=2)
    assert await openai_chat(gateway.url, gateway.model, stream) == ("Noting.", [("note", TRICKY)], "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_call_cut_by_max_tokens_is_length_without_markup(gateway, script, stream):
    script(text=CUT_SECOND, eos=False)
    assert await openai_chat(gateway.url, gateway.model, stream) == ("", [("note", TRICKY)], "length")


async def test_responses_and_anthropic_drop_a_cut_call_and_read_calls_by_structure(client, gateway, script):
    script(text=CUT_SECOND, eos=False)
    fn = NOTE["function"]
    r = await client.post("/v1/responses", json={"model": gateway.model, "input": "Note this.", "tools": [
        {"type": "function", "name": fn["name"], "parameters": fn["parameters"]}]})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "incomplete", body
    assert [(o["type"], o["name"], json.loads(o["arguments"])) for o in body["output"]] == [
        ("function_call", "note", TRICKY)]

    for stream in (False, True):
        script(text=CUT_SECOND, eos=False)
        req = {"model": gateway.model, "max_tokens": 100, "messages": [{"role": "user", "content": "Note this."}],
               "tools": [{"name": fn["name"], "input_schema": fn["parameters"]}], "stream": stream}
        if not stream:
            r = await client.post("/v1/messages", json=req)
            body = r.json()
            assert r.status_code == 200 and body["stop_reason"] == "max_tokens", body
            assert [(b["type"], b["name"], b["input"]) for b in body["content"]] == [("tool_use", "note", TRICKY)]
            continue
        events = await sse_events(client, "/v1/messages", req)
        starts = [d["content_block"]["type"] for name, d in events if name == "content_block_start"]
        inputs = [json.loads(d["delta"]["partial_json"]) for name, d in events
                  if name == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
        stop = [d["delta"]["stop_reason"] for name, d in events if name == "message_delta"]
        assert (starts, inputs, stop) == (["tool_use"], [TRICKY], ["max_tokens"])
