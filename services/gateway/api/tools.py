"""Tool calls parsed out of generated text (Hermes / Qwen / SmolLM2 format).

The model writes a call as JSON between tags, one object or a list of them::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolCallParser`` takes the text deltas as they are produced and splits them
into plain text (emitted as content) and completed calls. Text that could be
the start of ``<tool_call>`` is held back until it is decided, so no part of
a tag ever leaks into the content stream. A call's JSON is read by structure
(``json.JSONDecoder.raw_decode`` from the opening tag): the call ends at the
first ``</tool_call>`` after its JSON value, so a string value may hold any
text, the closing tag included. A call is released only when that closing tag
arrives (a stream then carries each call whole, in one delta, as vLLM's Hermes
parser does at the end of a call). A malformed call (bad JSON, or text between
the JSON and the closing tag) is returned as text, unchanged, up to the first
closing tag outside a JSON string. A call still open when the output was cut
at max_tokens is dropped: it is neither text nor a call. The same parser serves
the OpenAI chat and Responses APIs and Anthropic Messages, each rendering calls
its own way.

``tool_call_grammar`` is the same format as a grammar: when a request forces a
call (``tool_choice`` "required" or a named function), the output is
constrained to calls of the declared tools whose arguments are instances of
their ``parameters`` schemas, with exactly the declared properties (no others
unless the schema allows them with ``additionalProperties``). Where the
tokenizer has ``<tool_call>`` as one (added) token, llguidance matches the
tag's literal with that token, as the model was trained to write it.
``strict_tool_call_grammar`` is the grammar for tools some of which are
``strict`` and a call is not forced (``tool_choice`` "auto"): free text, and
from each ``<tool_call>`` the model writes on, a call in that format (a strict
tool's arguments an instance of its schema, another's any JSON object), after
which free text goes on.
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


_DECODER = json.JSONDecoder()


def _calls(data) -> list[ToolCall] | None:
    """The calls in one tag's decoded JSON (a call object or a list of them), or None when it is
    not call JSON."""
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


def _in_string(prefix: str) -> bool:
    """Whether JSON text ``prefix`` ends inside a string (it is valid up to an unterminated string)."""
    try:
        _DECODER.raw_decode(prefix, len(prefix) - len(prefix.lstrip()))
    except json.JSONDecodeError as e:
        return e.msg.startswith("Unterminated string")
    return False


def _call_end(body: str) -> tuple[int, list[ToolCall] | None] | None:
    """How the call whose text after ``<tool_call>`` is ``body`` ends: (length of ``body`` through
    its closing tag, its calls or None when malformed), or None while undecided (more text needed).

    The JSON value is decoded from the start; well-formed, it must be followed by whitespace and
    the closing tag. Otherwise the call is malformed and ends at the first closing tag that is not
    inside one of its JSON strings."""
    if CLOSE not in body:
        return None
    try:
        data, end = _DECODER.raw_decode(body, len(body) - len(body.lstrip()))
    except json.JSONDecodeError:
        data, end = None, None
    if end is not None:
        gap = len(body) - end - len(body[end:].lstrip())
        if body.startswith(CLOSE, end + gap):
            return end + gap + len(CLOSE), _calls(data)
    close = body.find(CLOSE, end or 0)
    while close >= 0 and end is None and _in_string(body[:close]):
        close = body.find(CLOSE, close + 1)
    return None if close < 0 else (close + len(CLOSE), None)


class ToolCallParser:
    """Incremental splitter of text and tool calls. ``enabled=False`` passes text through.

    Whitespace-only text after a call is held: dropped if another call or the end follows (the
    newlines between ``</tool_call>`` and ``<tool_call>`` are not content), emitted before any
    other text that follows. ``max_calls`` (None: any number): once that many calls are parsed the
    parser is ``done`` and the rest of the output is neither text nor calls (parallel tool calls
    turned off: the endpoint then ends the generation, as a model that made its one call would).
    """

    def __init__(self, enabled: bool = True, max_calls: int | None = None):
        self.enabled = enabled
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._buf = ""  # undecided text: a possible tag start, or an open call's body
        self._ws: str | None = None  # whitespace held since the last call (None: not right after one)

    @property
    def done(self) -> bool:
        """``max_calls`` calls were parsed: nothing after them is output."""
        return self.max_calls is not None and len(self.calls) >= self.max_calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add generated text; returns (text safe to emit now, calls completed now)."""
        if not self.enabled:
            return text, []
        if self.done:
            return "", []
        self._buf += text
        out, done = [], []
        while self._buf:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, OPEN)
                self._emit(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            self._emit(self._buf[:start], out)
            self._buf = self._buf[start:]
            found = _call_end(self._buf[len(OPEN):])
            if found is None:  # inside a call: wait for its end
                break
            end, calls = found[0] + len(OPEN), found[1]
            if calls is None:
                self._emit(self._buf[:end], out)
            else:
                done += calls
                self._ws = ""  # whitespace before this call (held) is dropped
            self._buf = self._buf[end:]
            if self.max_calls is not None and len(self.calls) + len(done) >= self.max_calls:
                del done[self.max_calls - len(self.calls):]  # (a list in one tag can hold more)
                self._buf = ""
        self.calls += done
        return "".join(out), done

    def flush(self, truncated: bool = False) -> str:
        """End of generation: whatever is still held is text, except that whitespace after the last
        call is dropped and, when ``truncated`` (the output was cut at max_tokens), a call still
        open, or the start of its tag (``<tool``), is dropped too (a cut call is not text). An open call at any other end (the model
        stopped inside it) is a malformed call: text, unchanged."""
        rest, self._buf = self._buf, ""
        if truncated and (rest.startswith(OPEN) or OPEN.startswith(rest)):  # a call, or its tag, cut
            rest = ""
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
    """A tool's parameters as a schema of JSON objects (the parser takes object arguments only).

    Declared ``properties`` are the arguments the function takes: unless the schema says otherwise
    with ``additionalProperties``, no other key is allowed (a forced call of a function declared
    with no properties has arguments ``{}``, and a model cannot invent keys until max_tokens)."""
    if parameters is None:
        return NO_PARAMETERS
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise StructuredOutputError(f"tool {name!r}: parameters must be a JSON schema of type 'object'")
    if "properties" in parameters:
        parameters = {"additionalProperties": False, **parameters}
    return {**parameters, "type": "object"}


def tool_call_grammar(tools: list[tuple[str, dict | None]], parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) for output made only of tool calls in this module's
    format: one call, or with ``parallel`` one or more separated by a newline, each
    ``<tool_call>\n{"name": N, "arguments": A}\n</tool_call>`` where N is one of ``tools``' names
    and A an instance of that tool's parameters schema (None = no parameters).

    Each tool's arguments are their own ``%json`` rule whose root is the tool's parameters schema,
    so every reference in it (``#``, ``#/properties/...``, ``#/$defs/...``) resolves as in the
    schema itself. Parameters ``{}`` (or without a ``type``) mean a JSON object; with ``properties``
    and no ``additionalProperties``, an object of those properties only. Raises
    StructuredOutputError (``engine.structured``) for parameters that are not an object schema.
    """
    return "\n".join([
        'start: call ("\\n" call)*' if parallel else "start: call",
        f'call: {lark_string(OPEN + chr(10))} body {lark_string(chr(10) + CLOSE)}',
        *_call_body_rules(tools),
    ])


def strict_tool_call_grammar(tools: list[tuple[str, dict | None, bool]]) -> str:
    """A Lark grammar (llguidance's dialect) for free text with tool calls in it, for a call that is
    not forced: any text; once the model has written ``<tool_call>`` (a lazy lexeme: the first
    occurrence ends the text), ``\n{"name": N, "arguments": A}\n</tool_call>`` with N one of
    ``tools``' names and A an instance of that tool's parameters schema where the tool is strict
    (``(name, parameters, strict)``), else any JSON object; then text again, and more calls.

    The trigger follows llguidance's structural tags (``llguidance.StructTag``). Raises
    StructuredOutputError for a strict tool's parameters that are not an object schema."""
    tools = [(name, parameters if strict else {}) for name, parameters, strict in tools]
    return "\n".join([
        "%llguidance {}",
        "start: call* TEXT",
        r"TEXT: /(.|\n)*/",
        f"open[lazy]: TEXT {lark_string(OPEN)}",
        f'call: open {lark_string(chr(10))} body {lark_string(chr(10) + CLOSE)}',
        *_call_body_rules(tools),
    ])


def _call_body_rules(tools: list[tuple[str, dict | None]]) -> list[str]:
    """``body``: the JSON of a call of one of ``tools``, each its own rule with its arguments' schema."""
    rules = ["body: " + " | ".join(f"tool{i}" for i in range(len(tools)))]
    for i, (name, parameters) in enumerate(tools):
        parameters = _object_schema(name, parameters)
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        rules.append(f"tool{i}: {lark_string(head)} args{i} {lark_string('}')}")
        rules.append(f"args{i}: {json_lark(parameters)}")
    return rules
