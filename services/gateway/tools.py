"""Tool calls parsed out of generated text (Hermes / Qwen / SmolLM2 format).

The model writes a call as JSON between tags, one object or a list of them::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolCallParser`` takes the text deltas as they are produced and splits them
into plain text (emitted as content) and completed calls. Text that could be
the start of ``<tool_call>`` is held back until it is decided, so no part of
a tag ever leaks into the content stream; a call is released only when its
closing tag arrives (a stream then carries each call whole, in one delta, as
vLLM's Hermes parser does at the end of a call). Malformed JSON between the
tags is returned as text, unchanged. The same parser serves the OpenAI chat
and Responses APIs and Anthropic Messages, each rendering calls its own way.

``tool_call_grammar`` is the same format as a grammar: when a request forces a
call (``tool_choice`` "required" or a named function), the output is
constrained to calls of the declared tools whose arguments are instances of
their ``parameters`` schemas. Where the tokenizer has ``<tool_call>`` as one
(added) token, llguidance matches the tag's literal with that token, as the
model was trained to write it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from deepinfer.engine.structured import StructuredOutputError, json_lark, lark_string

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# a function declared without ``parameters`` takes none
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolCall:
    """name: the function; arguments: a JSON object as a string (OpenAI's wire form)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def arguments_obj(self) -> dict:
        return json.loads(self.arguments)


def _calls(body: str) -> list[ToolCall] | None:
    """The calls in one tag's body, or None when it is not valid call JSON."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


class ToolCallParser:
    """Incremental splitter of text and tool calls. ``enabled=False`` passes text through.

    Whitespace-only text after a call is held: dropped if another call or the end follows (the
    newlines between ``</tool_call>`` and ``<tool_call>`` are not content), emitted before any
    other text that follows.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.calls: list[ToolCall] = []
        self._buf = ""  # undecided text: a possible tag start, or an open call's body
        self._ws: str | None = None  # whitespace held since the last call (None: not right after one)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add generated text; returns (text safe to emit now, calls completed now)."""
        if not self.enabled:
            return text, []
        self._buf += text
        out, done = [], []
        while self._buf:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, OPEN)
                self._emit(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            end = self._buf.find(CLOSE, start)
            if end < 0:  # inside a call: wait for its end
                self._emit(self._buf[:start], out)
                self._buf = self._buf[start:]
                break
            self._emit(self._buf[:start], out)
            body = self._buf[start + len(OPEN): end]
            calls = _calls(body.strip())
            if calls is None:
                self._emit(self._buf[start: end + len(CLOSE)], out)
            else:
                done += calls
                self._ws = ""  # whitespace before this call (held) is dropped
            self._buf = self._buf[end + len(CLOSE):]
        self.calls += done
        return "".join(out), done

    def flush(self) -> str:
        """End of generation: whatever is still held (an unclosed tag) is text; whitespace
        after the last call is dropped."""
        rest, self._buf = self._buf, ""
        held, self._ws = self._ws or "", None
        return held + rest if rest.strip() else ("" if self.calls else held + rest)

    def _emit(self, text: str, out: list[str]) -> None:
        if self._ws is not None and not text.strip():
            self._ws += text
        elif text:
            out.append((self._ws or "") + text)
            self._ws = None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _object_schema(name: str, parameters: dict | None) -> dict:
    """A tool's parameters as a schema of JSON objects (the parser takes object arguments only)."""
    if parameters is None:
        return NO_PARAMETERS
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise StructuredOutputError(f"tool {name!r}: parameters must be a JSON schema of type 'object'")
    return {**parameters, "type": "object"}


def tool_call_grammar(tools: list[tuple[str, dict | None]], parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) for output made only of tool calls in this module's
    format: one call, or with ``parallel`` one or more separated by a newline, each
    ``<tool_call>\n{"name": N, "arguments": A}\n</tool_call>`` where N is one of ``tools``' names
    and A an instance of that tool's parameters schema (None = no parameters).

    Each tool's arguments are their own ``%json`` rule whose root is the tool's parameters schema,
    so every reference in it (``#``, ``#/properties/...``, ``#/$defs/...``) resolves as in the
    schema itself. Parameters ``{}`` (or without a ``type``) mean a JSON object. Raises
    StructuredOutputError (``engine.structured``) for parameters that are not an object schema.
    """
    rules = []
    for i, (name, parameters) in enumerate(tools):
        parameters = _object_schema(name, parameters)
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        rules.append(f"tool{i}: {lark_string(head)} args{i} {lark_string('}')}")
        rules.append(f"args{i}: {json_lark(parameters)}")
    return "\n".join([
        'start: call ("\\n" call)*' if parallel else "start: call",
        f'call: {lark_string(OPEN + chr(10))} body {lark_string(chr(10) + CLOSE)}',
        "body: " + " | ".join(f"tool{i}" for i in range(len(tools))),
        *rules,
    ])
