"""Structured output requested over HTTP -> ``SamplingParams.structured``, checked before dispatch.

Where a request can ask for it (at most one source per request, else 400):

    response_format (chat)      {"type": "json_object"}               -> {"type": "json_object"}
                                {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                                      -> {"type": "json_schema", "schema"}
                                (no "schema": any JSON object). ``strict`` is accepted either way and
                                the schema is always enforced, as vLLM does (OpenAI's strict mode adds
                                its own subset rules; every feature llguidance supports is allowed here).
    text.format (Responses)     the same, flat: {"type": "json_schema", "name", "schema", "strict"}
    guided_json / guided_regex / guided_choice / guided_grammar (vLLM, chat and completions)
    structured_outputs (vLLM)   {"json": schema | str} | {"regex"} | {"choice"} | {"grammar"} | {"json_object": true}
    tool_choice                 "required" or a named function (chat, Responses; Anthropic "any" / "tool"):
                                a grammar of tool calls in the format the tool parser reads
                                (``tools.tool_call_grammar``), arguments constrained by each tool's
                                ``parameters``; ``parallel_tool_calls: false`` = exactly one call
    strict tools, not forced    tools with ``strict: true`` (chat, Responses, Anthropic) under
                                "auto": free text, each call the model
                                starts constrained (``tools.strict_tool_call_grammar``); not with
                                another source, whose output could hold no call

Grammars (``guided_grammar``, ``structured_outputs.grammar``) are llguidance's Lark dialect.
Every spec is compiled by llguidance without a tokenizer (``engine.structured.compile_grammar``,
an LRU cache by the spec's canonical JSON): a malformed spec or an unsupported feature (e.g. a
JSON-schema keyword llguidance does not implement) is a 400 in OpenAI's shape whose message names
it and whose ``param`` names the field. Nothing is ever silently left unenforced.
"""

from __future__ import annotations

import json

from deepinfer.engine.structured import StructuredOutputError, compile_grammar
from deepinfer.gateway.api.errors import bad_request
from deepinfer.gateway.api.tools import strict_tool_call_grammar, tool_call_grammar

_VLLM_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def checked(spec: dict, param: str) -> dict:
    """``spec`` once llguidance compiled it (cached). Raises a 400 naming ``param`` and the problem."""
    try:
        compile_grammar(spec)
    except StructuredOutputError as e:
        raise bad_request(f"{param}: {e}", param=param) from None
    return spec


def openai_spec(req, tools_forced: dict | None = None) -> dict | None:
    """The structured-output spec of an OpenAI chat or completions request (``openai_schema``
    models; ``response_format`` only on chat), or ``tools_forced`` (a tool-call spec) — checked.
    None = free text. Raises 400 for two sources at once, a malformed or unsupported spec."""
    found: list[tuple[str, dict]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        found.append(("response_format", response_format_spec(
            fmt.type, fmt.json_schema.schema_ if fmt.json_schema else None, "response_format")))
    for name in _VLLM_FIELDS:
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, _vllm_spec(name, value)))
    if tools_forced is not None:
        found.append(("tool_choice", tools_forced))
    if len(found) > 1:
        names = " and ".join(n for n, _ in found)
        raise bad_request(f"only one kind of structured output per request, got {names}", param=found[1][0])
    return checked(found[0][1], found[0][0]) if found else None


def response_format_spec(kind: str, schema: dict | None, param: str) -> dict:
    """``json_object`` / ``json_schema`` (with the JSON schema ``schema``; None = any object) -> a spec."""
    if kind == "json_object":
        return {"type": "json_object"}
    if schema is None:
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: json_schema.schema must be a JSON schema object", param=param)
    return {"type": "json_schema", "schema": schema}


def _vllm_spec(name: str, value) -> dict:
    if name == "structured_outputs":
        keys = [k for k in _STRUCTURED_OUTPUTS_KEYS if value.get(k) not in (None, False)]
        unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_KEYS) - {"disable_any_whitespace",
                                                                     "disable_additional_properties"})
        if unknown:
            raise bad_request(f"structured_outputs: unsupported key(s) {', '.join(unknown)}; expected one of "
                              f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)}", param=name)
        if value.get("disable_additional_properties"):  # (disable_any_whitespace: our JSON never has free space)
            raise bad_request("structured_outputs: disable_additional_properties is not supported; set "
                              "\"additionalProperties\": false in the schema instead", param=name)
        if len(keys) != 1:
            raise bad_request(f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_OUTPUTS_KEYS)}",
                              param=name)
        name, value = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                       "grammar": "guided_grammar", "json_object": "json_object"}[keys[0]], value[keys[0]]
        param = f"structured_outputs.{keys[0]}"
    else:
        param = name
    if name == "json_object":
        return {"type": "json_object"}
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"{param} must be a JSON schema (an object, or its JSON text)", param=param) from None
        if not isinstance(value, dict):
            raise bad_request(f"{param} must be a JSON schema object", param=param)
        return {"type": "json_schema", "schema": value}
    if name == "guided_regex":
        return {"type": "regex", "pattern": _string(value, param)}
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{param} must be a non-empty list of strings", param=param)
        return {"type": "choice", "choices": value}
    return {"type": "grammar", "lark": _string(value, param)}


def _string(value, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param=param)
    return value


def tool_call_spec(tools: list[tuple[str, dict | None]], forced_name: str | None, parallel: bool,
                   param: str = "tool_choice") -> dict:
    """The spec forcing tool calls: of any of ``tools`` ((name, parameters schema) pairs), or only of
    ``forced_name``; one call unless ``parallel``. Checked; raises 400 for a name not among the
    tools (``param``) or parameters llguidance cannot enforce (param ``tools``)."""
    if forced_name is not None:
        tools = [t for t in tools if t[0] == forced_name]
        if not tools:
            raise bad_request(f"{param}: no tool named {forced_name!r} among the tools", param=param)
    return _tools_grammar_spec(tool_call_grammar, tools, parallel)


def strict_tools_spec(tools: list[tuple[str, dict | None, bool]]) -> dict | None:
    """The spec for tools offered but not forced (``tool_choice`` "auto"): free text, and each call the
    model starts is a call of one of ``tools`` ((name, parameters schema, strict)) whose arguments
    are an instance of the schema where the tool is strict. None when no tool is strict (free text,
    calls parsed as written). Checked; raises 400 (param ``tools``) for parameters llguidance
    cannot enforce."""
    if not any(strict for _, _, strict in tools):
        return None
    return _tools_grammar_spec(strict_tool_call_grammar, tools)


def _tools_grammar_spec(grammar, *args) -> dict:
    """``grammar(*args)`` (a tools grammar of ``gateway.api.tools``) as a checked spec; a tool's
    parameters llguidance cannot enforce are a 400 naming ``tools``."""
    try:
        spec = {"type": "grammar", "lark": grammar(*args)}
    except StructuredOutputError as e:
        raise bad_request(f"tools: {e}", param="tools") from None
    return checked(spec, "tools")
