"""Tool-call parsing from generated text (``deepinfer.gateway.tools``)."""

import json
import random

import pytest

from deepinfer.gateway.tools import ToolCallParser

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
