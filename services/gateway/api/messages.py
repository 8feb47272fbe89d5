"""POST /v1/messages: the Anthropic Messages API on the mesh (and POST /v1/messages/count_tokens).

Request: ``model`` (must be the served model, else 404), ``max_tokens`` (required, >= 1),
``messages`` (user / assistant; content a string or blocks: ``text``, ``tool_use`` in assistant
turns, ``tool_result`` in user turns), ``system`` (string or text blocks), ``stop_sequences``,
``temperature`` (0-1), ``top_p``, ``top_k``, ``tools`` (name, description, input_schema, ``strict``:
under ``auto`` each call the model starts is constrained to the input_schema) with
``tool_choice`` (``auto`` / ``none``; ``any`` and ``tool`` force calls: the output is constrained
to calls of those tools with ``input_schema``-valid inputs, ``disable_parallel_tool_use`` = one;
``gateway.api.structured``; with ``auto`` and ``disable_parallel_tool_use`` the output ends at its first
call and the worker is stopped there), ``output_config.format`` (``{"type": "json_schema", "schema"}``: the
text is constrained to the schema, as chat's ``response_format``; not with tools in use, since a
call could not be written then), ``stream``. Honoured as no-ops on a single-tenant server:
``metadata`` (``user_id``), ``service_tier`` (one tier: standard), ``cache_control`` (the prefix
cache caches every prompt by itself), and the ``anthropic-version``, ``x-api-key``,
``anthropic-workspace-id`` and ``anthropic-user-profile-id`` headers. Refused with a 400 naming
the field (``gateway.api.unsupported``): ``thinking`` (unless ``{"type": "disabled"}``), ``speed``
(unless "standard"), ``output_config.effort``, ``container``, ``diagnostics``, ``inference_geo``,
and any field the request does not declare, nested ones included (block ``citations`` unless [],
``toolset_name``, tool ``input_examples``...: docs/api_fields.md). Extensions, as on chat
completions: ``ignore_eos`` (vLLM's), ``traffic_class`` / ``cache_salt`` body fields and the
``X-Traffic-Class`` header.

The conversation becomes OpenAI-shaped template messages for the tokenizer: ``system`` first, a
``tool_use`` block becomes an assistant ``tool_calls`` entry, a ``tool_result`` block a ``tool``
message (prefixed ``Error: `` when ``is_error``). Tool calls are parsed from the output
(``ToolCallParser``) into ``tool_use`` blocks (ids ``toolu_...``).

Response: a ``message`` with content blocks, ``stop_reason`` = ``max_tokens`` (the output limit,
calls before it or not: a call it cut is dropped), ``tool_use`` (a call was parsed),
``stop_sequence`` (with ``stop_sequence`` set), else ``end_turn``; ``usage``: ``input_tokens`` =
prompt tokens not read from cache (Anthropic's meaning), ``cache_read_input_tokens`` = prompt
tokens found in the prefix cache, ``cache_creation_input_tokens`` = 0 (caching is automatic,
nothing is billed as a write), ``output_tokens`` (the EOS token included, as chat completions
counts it).

Streaming: ``message_start``, ``ping``, then per block ``content_block_start`` /
``content_block_delta`` (``text_delta``; one ``input_json_delta`` with a call's whole input, as
the call is only known once its closing tag arrives) / ``content_block_stop``, then
``message_delta`` (stop_reason, stop_sequence, usage.output_tokens) and ``message_stop``.

Errors: ``{"type": "error", "error": {"type", "message"}}``: 400 ``invalid_request_error``,
404 ``not_found_error``, 413 ``request_too_large``, 429 ``rate_limit_error`` (admission, with
``Retry-After``), 500 ``api_error``, 504 ``timeout_error`` (a worker or the tokenizer timed
out), 529 ``overloaded_error`` (no live worker took the request, or its worker was lost). A prompt
over the context is Anthropic's ``prompt is too long: N tokens > M maximum`` (prompt plus
``max_tokens`` over it: ``input length and `max_tokens` exceed context limit: ...``). All of
them come before any SSE byte when detectable; after the stream started, a failure is an
``error`` event and the stream ends.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from contextlib import aclosing
from typing import Annotated, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Discriminator, Field, ValidationInfo, field_validator

from deepinfer.gateway.api.common import (Assembler, Event, Run, encode_messages_images, field_names, log_finished,
                                          matched_stop, output_budget, parse_body, run, run_to_end)
from deepinfer.gateway.api.errors import ContextLengthExceeded, OpenAIError, bad_request
from deepinfer.gateway.api.images import ANTHROPIC
from deepinfer.gateway.api.structured import checked, response_format_spec, strict_tools_spec, tool_call_spec
from deepinfer.gateway.api.unsupported import refused
from deepinfer.gateway.pipeline.generation import Gateway, check_workers, new_choices, open_choices, respond, start_request
from deepinfer.gateway.api.limits import BodyTooLarge
from deepinfer.gateway.stream.request_stream import ClientGone, spawn
from deepinfer.protocol import SamplingParams
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


# --- request models -----------------------------------------------------------------------


class _Strict(BaseModel):
    # a nested field this module does not declare is a 400 naming it, as at the top level
    model_config = ConfigDict(strict=True, extra="forbid")


class CacheControl(_Strict):
    """A cache breakpoint: honoured as a no-op, the prefix cache caches every prompt by itself."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


def _empty(value) -> bool:
    """A list field sent back empty: the field left out."""
    return value == []


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: refused("citations are not supported (there are no documents to cite); only []", takes=_empty) = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None
    # a call the model made itself ("direct") is the only kind there is here
    caller: refused("only calls made by the model itself ({'type': 'direct'})",
                    takes=lambda v: v == {"type": "direct"}) = None
    toolset_name: refused("toolsets are not supported") = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: refused("toolsets are not supported") = None

    def text(self) -> str:
        if isinstance(self.content, list):
            body = "\n".join(b.text for b in self.content)
        else:
            body = self.content or ""
        return f"Error: {body}" if self.is_error else body


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]  # Anthropic's set
    data: str


class URLSource(_Strict):
    type: Literal["url"]
    url: str


class ImageBlock(_Strict):
    """An image (vision-language models): base64 data, or a URL the gateway fetches (``gateway.api.images``)."""

    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource], Discriminator("type")]
    cache_control: CacheControl | None = None
    transformations: refused("image transformations are not supported") = None

    def url(self) -> str:
        s = self.source
        return f"data:{s.media_type};base64,{s.data}" if s.type == "base64" else s.url


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ImageBlock], Discriminator("type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None  # server tools (web_search_...) are refused
    strict: bool | None = None  # true: calls are constrained to ``input_schema`` also under tool_choice "auto"
    cache_control: CacheControl | None = None
    allowed_callers: refused("only the model calls tools (['direct'])", takes=lambda v: v == ["direct"]) = None
    defer_loading: refused("deferred tool loading (tool search) is not supported; only false",
                           takes=lambda v: v is False) = None
    eager_input_streaming: refused("a call's input is streamed whole once the call is parsed; only false",
                                   takes=lambda v: v is False) = None
    input_examples: refused("tool input examples are not supported; only []", takes=_empty) = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None  # not with type "none"

    @field_validator("name")
    @classmethod
    def _name_with_tool(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("type") != "tool":
            raise ValueError("only taken with type 'tool'")
        return value

    @field_validator("disable_parallel_tool_use")
    @classmethod
    def _not_with_none(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("type") == "none":
            raise ValueError("not taken with type 'none'")
        return value


class Metadata(_Strict):
    user_id: str | None = None  # an end-user id: honoured as a no-op (one tenant)


class OutputFormat(_Strict):
    """Structured outputs: the text is an instance of ``schema`` (a JSON schema)."""

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: refused("effort levels are not supported (the model gives no reasoning)") = None


class MessagesRequest(_Strict):
    model: str
    messages: list[InputMessage]
    max_tokens: int
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    # honoured as no-ops (the module docstring says why)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: CacheControl | None = None
    # refused unless the value asks for what the server does anyway
    thinking: refused("extended thinking is not supported; only type 'disabled'",
                      takes=lambda v: v == {"type": "disabled"}) = None
    speed: refused("only the 'standard' speed", takes=lambda v: v == "standard") = None
    container: refused("containers (code execution) are not supported") = None
    diagnostics: refused("diagnostics are not supported") = None
    inference_geo: refused("choosing an inference region is not supported") = None
    # extensions (as on chat completions)
    ignore_eos: bool = False
    traffic_class: str | None = None
    cache_salt: str | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


_FIELDS = field_names(MessagesRequest, InputMessage, TextBlock, ToolUseBlock, ToolResultBlock, ImageBlock, Base64Source,
                      URLSource, Tool, ToolChoice, OutputConfig, OutputFormat, CacheControl, Metadata) | {"schema"}


# --- errors -----------------------------------------------------------------------------


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                504: "timeout_error", 529: "overloaded_error"}


def error_status(e: OpenAIError) -> int:
    """The HTTP status Anthropic would answer for ``e``: 503 becomes 529 (overloaded) or, for a
    timeout, 504; every other status is kept."""
    if e.status == 503:
        return 504 if e.code == "timeout" else 529
    return e.status


def error_body(e: OpenAIError) -> dict:
    status = error_status(e)
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    message = e.anthropic_message if isinstance(e, ContextLengthExceeded) else e.message
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=error_status(e), headers=e.headers)


# --- validation and the prompt --------------------------------------------------------------


def validate(req: MessagesRequest | CountTokensRequest, gw: Gateway) -> None:
    """Checks beyond the types. Raises 404 (unknown model) or 400 (``invalid_request_error``)."""
    if req.model != gw.model.served_name:
        raise OpenAIError(404, f"model: {req.model}", param="model", code="model_not_found")
    if not req.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    if isinstance(req, MessagesRequest):
        if req.max_tokens < 1:
            raise bad_request(f"max_tokens: must be at least 1, got {req.max_tokens}", param="max_tokens")
        if req.temperature is not None and not (math.isfinite(req.temperature) and 0 <= req.temperature <= 1):
            raise bad_request(f"temperature: must be between 0 and 1, got {req.temperature}", param="temperature")
        if req.top_p is not None and not (0 < req.top_p <= 1):
            raise bad_request(f"top_p: must be in (0, 1], got {req.top_p}", param="top_p")
        if req.top_k is not None and req.top_k < 0:
            raise bad_request(f"top_k: must be >= 0, got {req.top_k}", param="top_k")
        if any(not s for s in req.stop_sequences or []):
            raise bad_request("stop_sequences: each stop sequence must be a non-empty string", param="stop_sequences")
    names = set()
    for i, tool in enumerate(req.tools or []):
        if not TOOL_NAME.match(tool.name):
            raise bad_request(f"tools.{i}.name: must match {TOOL_NAME.pattern}", param="tools")
        if tool.name in names:
            raise bad_request(f"tools: tool names must be unique, {tool.name!r} repeats", param="tools")
        names.add(tool.name)
    choice = req.tool_choice
    if choice is not None and choice.type in ("any", "tool") and not req.tools:
        raise bad_request(f"tool_choice: {choice.type!r} forces a tool call but there are no tools",
                          param="tool_choice")
    if choice is not None and choice.type == "tool" and not choice.name:
        raise bad_request("tool_choice.name: required when type is 'tool'", param="tool_choice")
    if isinstance(req.system, list) and any(not b.text for b in req.system):
        raise bad_request("system: text content blocks must be non-empty", param="system")
    seen_tool_uses: set[str] = set()
    for i, m in enumerate(req.messages):
        blocks = m.content if isinstance(m.content, list) else []
        for j, b in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            if isinstance(b, TextBlock) and not b.text:
                raise bad_request(f"{where}: text content blocks must be non-empty", param="messages")
            if isinstance(b, ToolUseBlock):
                if m.role != "assistant":
                    raise bad_request(f"{where}: tool_use blocks belong to assistant messages", param="messages")
                if b.id in seen_tool_uses:
                    raise bad_request(f"{where}: tool_use ids must be unique, {b.id!r} repeats", param="messages")
                seen_tool_uses.add(b.id)
            if isinstance(b, ToolResultBlock):
                if m.role != "user":
                    raise bad_request(f"{where}: tool_result blocks belong to user messages", param="messages")
                if b.tool_use_id not in seen_tool_uses:
                    raise bad_request(f"{where}: tool_result for unknown tool_use_id {b.tool_use_id!r}; it must "
                                      "answer a tool_use block of an earlier assistant message", param="messages")
    if req.messages[-1].role == "assistant":
        raise bad_request("messages: the last message must be a user message (continuing a partial assistant "
                          "turn is not supported)", param="messages")


def structured_spec(req: MessagesRequest) -> dict | None:
    """``SamplingParams.structured`` for ``output_config.format`` (the schema, as chat's
    ``response_format``), a forcing ``tool_choice`` ("any" / "tool") or strict tools under "auto", else None. Raises 400 for a
    format with tools in use (param ``output_config``), a schema or an input_schema llguidance cannot
    enforce (``output_config.format``, ``tools``)."""
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        if tools_enabled(req):
            raise bad_request("output_config.format cannot be combined with tools (unless tool_choice is "
                              "'none'): the output is constrained to the schema, so no tool could be called",
                              param="output_config")
        param = "output_config.format"
        return checked(response_format_spec("json_schema", fmt.schema_, param), param)
    choice = req.tool_choice
    if tools_enabled(req) and (choice is None or choice.type == "auto"):
        return strict_tools_spec([(t.name, t.input_schema, bool(t.strict)) for t in req.tools])
    if not req.tools or choice is None or choice.type not in ("any", "tool"):
        return None
    tools = [(t.name, t.input_schema) for t in req.tools]
    return tool_call_spec(tools, choice.name if choice.type == "tool" else None,
                          parallel=not choice.disable_parallel_tool_use)


def tools_enabled(req: MessagesRequest | CountTokensRequest) -> bool:
    return bool(req.tools) and not (req.tool_choice is not None and req.tool_choice.type == "none")


def template_tools(req: MessagesRequest | CountTokensRequest) -> list[dict] | None:
    """Tool definitions in the OpenAI shape the chat template takes; None when tools are off."""
    if not tools_enabled(req):
        return None
    out = []
    for t in req.tools:
        fn = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def template_messages(req: MessagesRequest | CountTokensRequest) -> list[dict]:
    """The conversation as OpenAI chat messages (text content) for the chat template."""
    out: list[dict] = []
    if isinstance(req.system, str) and req.system:
        out.append({"role": "system", "content": req.system})
    elif isinstance(req.system, list) and req.system:
        out.append({"role": "system", "content": "\n".join(b.text for b in req.system)})
    for k, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "user" and any(isinstance(b, ImageBlock) for b in m.content):
            parts = []  # images: the parts in order (tool results are not mixed with images here)
            for j, b in enumerate(m.content):
                if isinstance(b, ImageBlock):
                    at = f"messages.{k}.content.{j}"
                    part = {"type": "image_url", "url": b.url(), "param": at,
                            "url_param": f"{at}.source.{'data' if b.source.type == 'base64' else 'url'}"}
                    if b.source.type == "base64":  # checked against the image's actual format
                        part |= {"media_type": b.source.media_type, "media_param": f"{at}.source.media_type"}
                    parts.append(part)
                elif isinstance(b, TextBlock):
                    parts.append({"type": "text", "text": b.text})
                else:
                    raise bad_request("a user turn with images may hold only text and image blocks",
                                      param="messages")
            out.append({"role": "user", "content": parts})
            continue
        if m.role == "assistant":
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            msg = {"role": "assistant", "content": text}
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        texts: list[str] = []  # a user turn: tool results become tool messages, in order
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            else:
                texts.append(b.text)
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


# --- the endpoint -----------------------------------------------------------------------------


def add_routes(app: FastAPI, gw: Gateway) -> None:
    """Register POST /v1/messages and POST /v1/messages/count_tokens on ``app``."""

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await _guarded(create_message(request, gw))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await _guarded(count_message_tokens(request, gw))


async def _guarded(coro) -> Response:
    """Every failure in Anthropic's error shape (FastAPI's handlers answer OpenAI's)."""
    try:
        return await coro
    except OpenAIError as e:
        return error_response(e)
    except BodyTooLarge:
        raise  # the body-limit middleware answers 413 in this API's shape
    except Exception as e:  # noqa: BLE001 - an unexpected bug still answers in this API's shape
        log.exception("unhandled_error", error=str(e))
        return error_response(OpenAIError(500, f"{type(e).__name__}: {e}", "server_error"))


async def count_message_tokens(request: Request, gw: Gateway) -> Response:
    """``{"input_tokens": n}``: the prompt's tokens as /v1/messages would render it (no generation)."""
    req = parse_body(CountTokensRequest, await request.body(), _FIELDS, dotted=True)
    validate(req, gw)
    check_workers(gw.registry, gw.required_roles)
    ids, _, _ = await encode_messages_images(gw, uuid.uuid4().hex, template_messages(req), template_tools(req),
                                             terms=ANTHROPIC)
    return JSONResponse({"input_tokens": len(ids)})


async def create_message(request: Request, gw: Gateway) -> Response:
    """Run one Messages request: JSON ``message`` or an SSE stream. Raises ``OpenAIError`` (rendered
    by ``_guarded``) for anything detectable before the first byte."""
    req = parse_body(MessagesRequest, await request.body(), _FIELDS, dotted=True)
    validate(req, gw)
    structured = structured_spec(req)
    request_id, traffic_class = start_request(request, gw, req)
    prompt_ids, images, embeddings_fp = await encode_messages_images(gw, request_id, template_messages(req),
                                                                     template_tools(req), terms=ANTHROPIC)
    max_tokens = output_budget(gw.max_model_len, len(prompt_ids), req.max_tokens, "messages")
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        max_tokens=max_tokens,
        ignore_eos=req.ignore_eos,
        structured=structured,
    )
    choices = new_choices(gw, request_id, 1, list(req.stop_sequences or []), traffic_class, req.cache_salt,
                          images=images, embeddings_fingerprint=embeddings_fp)
    try:
        await open_choices(choices, prompt_ids, sampling, request.is_disconnected)
    except ClientGone:
        return Response(status_code=499)
    one_call = req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use
    r = Run(request_id, choices[0], Assembler(parse_tools=tools_enabled(req), max_calls=1 if one_call else None),
            len(prompt_ids))
    reply = _Reply(r, gw.model.served_name)
    log.info("request_started", api="anthropic", prompt_tokens=len(prompt_ids), stream=req.stream,
             worker=choices[0].stream.worker_id)
    return await respond(request, bool(req.stream), _sse(reply) if req.stream else None,
                         lambda r: _collect(reply, r), {"X-Request-Id": request_id, "request-id": f"req_{request_id}"})


class _Reply:
    """The message under construction: ids, blocks (from the run's assembler), stop reason, usage."""

    def __init__(self, r: Run, model: str):
        self.run = r
        self.model = model
        self.id = f"msg_{r.request_id}"
        self.tool_ids: dict[int, str] = {}  # block index -> toolu_ id

    def tool_id(self, index: int) -> str:
        return self.tool_ids.setdefault(index, f"toolu_{uuid.uuid4().hex[:24]}")

    def block(self, b, streaming: bool = False) -> dict:
        if b.kind == "text":
            return {"type": "text", "text": "" if streaming else b.text}
        return {"type": "tool_use", "id": self.tool_id(b.index), "name": b.call.name,
                "input": {} if streaming else b.call.arguments_obj}

    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        proc = self.run.proc
        if proc.finish_reason == "length":
            return "max_tokens", None
        if self.run.assembler.calls:
            return "tool_use", None
        if proc.stopped_by_string:
            return "stop_sequence", matched_stop(proc)
        return "end_turn", None

    def usage(self, output_tokens: int | None = None) -> dict:
        cached = self.run.cached_tokens
        return {
            "input_tokens": self.run.num_prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": self.run.output_tokens if output_tokens is None else output_tokens,
        }

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None,
                usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


async def _collect(reply: _Reply, request: Request) -> dict:
    r = reply.run
    await run_to_end(r, request.is_disconnected)
    stop_reason, stop_sequence = reply.stop()
    return reply.message([reply.block(b) for b in r.assembler.blocks], stop_reason, stop_sequence, reply.usage())


def _sse_event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _block_events(reply: _Reply, events: list[Event]):
    for e in events:
        index = e.block.index
        if e.kind == "start":
            yield _sse_event("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": reply.block(e.block, streaming=True)})
            if e.block.kind == "tool":
                delta = {"type": "input_json_delta", "partial_json": e.block.call.arguments}
                yield _sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                         "delta": delta})
        elif e.kind == "delta" and e.text:
            yield _sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                     "delta": {"type": "text_delta", "text": e.text}})
        elif e.kind == "stop":
            yield _sse_event("content_block_stop", {"type": "content_block_stop", "index": index})


async def _sse(reply: _Reply):
    r = reply.run
    clean = False
    try:
        yield _sse_event("message_start", {"type": "message_start", "message": reply.message(
            [], None, None, reply.usage(output_tokens=0))})
        yield _sse_event("ping", {"type": "ping"})
        try:
            async with aclosing(run(r)) as arriving:
                async for events in arriving:
                    for line in _block_events(reply, events):
                        yield line
        except OpenAIError as e:
            clean = True
            yield _sse_event("error", error_body(e))
            return
        stop_reason, stop_sequence = reply.stop()
        yield _sse_event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                           "usage": {"output_tokens": r.output_tokens}})
        yield _sse_event("message_stop", {"type": "message_stop"})
        clean = True
    finally:
        # NOTE: when the client disconnects, Starlette cancels this generator and an
        # await here could be cancelled too, so the abort is its own task.
        spawn(r.choice.stream.abort())
        log_finished(r, disconnected=not clean)

