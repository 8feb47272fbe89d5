"""POST /v1/responses, GET / DELETE /v1/responses/{id}: the OpenAI Responses API on the mesh.

Request: ``input`` (a string, or items: ``message`` with ``input_text`` / ``output_text`` /
``input_image`` content (``image_url``: a URL or a ``data:`` URL; vision-language models,
``gateway.api.images``; ``file_id`` is refused) or a plain string; ``function_call``;
``function_call_output``), ``instructions`` (a system message
first; not carried over by ``previous_response_id``, as OpenAI does), ``max_output_tokens``,
``temperature`` (0-2), ``top_p``, ``tools`` (``type: "function"`` only; with ``strict: true``,
under ``auto`` each call the model starts is constrained to the tool's ``parameters``; left out,
calls are parsed as written, as vLLM does, where OpenAI's default is strict) with ``tool_choice``
(``auto`` / ``none``; ``required`` and a named function force calls: the output is constrained to
calls of those tools, ``parallel_tool_calls: false`` = one; with ``auto`` and
``parallel_tool_calls: false`` the output ends at its first call and the worker is stopped there),
``text.format`` (``json_object``, or
``json_schema`` with ``schema``: the output is constrained to it; ``gateway.api.structured``), ``stream``,
``store`` (default true), ``previous_response_id``, ``metadata``, ``user``. Honoured as no-ops:
``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``, ``max_tool_calls`` (it
counts built-in tool calls; there are none here) and ``include`` values naming items this server
never outputs (``reasoning.encrypted_content``, web / file search, code interpreter, computer call
outputs). Refused with a 400 naming the field unless the value asks for what the server does anyway
(``gateway.api.unsupported``): ``background`` (false), ``truncation`` ("disabled"), ``reasoning``
(effort "none"), ``service_tier`` ("auto" / "default"), ``top_logprobs`` (0), ``stream_options``
(no obfuscation), ``text.verbosity``, ``prompt_cache_options`` (implicit), ``image``
(compression "auto" / "disabled"), ``context_management`` ([]), ``include`` of logprobs or input
image URLs, ``conversation``, ``prompt``, ``moderation``, ``background_options``,
``access_programs``; an undeclared field is a 400 too, nested ones included, and so are fields of
items an earlier output carries unless empty (``output_text.annotations`` / ``logprobs``) or
naming what is done anyway (``caller: {"type": "direct"}``) (docs/api_fields.md). Extensions:
``ignore_eos`` (vLLM's), ``traffic_class`` / ``cache_salt`` and the ``X-Traffic-Class`` header, as
on chat completions.

Items become OpenAI-shaped template messages for the tokenizer (roles as sent), a
``function_call`` joins the assistant message before it as a ``tool_calls`` entry, a
``function_call_output`` is a ``tool`` message. Tool calls are parsed from the output
(``ToolCallParser``) into ``function_call`` items (``fc_`` ids, ``call_`` call ids).

Response: ``status`` ``completed``, or ``incomplete`` with ``incomplete_details.reason =
"max_output_tokens"`` when the output limit cut it; ``output``: ``message`` items (one
``output_text`` part each) and ``function_call`` items in generation order (an output with no
text and no call still has one empty message); ``usage``: ``input_tokens``,
``input_tokens_details.cached_tokens``, ``output_tokens`` (EOS included, as chat completions
counts it), ``output_tokens_details.reasoning_tokens`` (0), ``total_tokens``.

Streaming (SSE with ``event:`` lines, every payload carrying ``sequence_number`` from 0):
``response.created``, ``response.in_progress``, then per item ``response.output_item.added``;
for a message ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``; for a call
``response.function_call_arguments.delta`` (the whole arguments: a call is only known once its
closing tag arrives) and ``.done``; then ``response.output_item.done``; last
``response.completed`` (or ``response.incomplete``). A failure after the stream started is an
``error`` event followed by ``response.failed``.

Stored responses (``response_store``): with ``store`` true the response and its conversation are
kept in Redis (7 days) before the final event / JSON is sent, so a follow-up with
``previous_response_id`` continues it. Unknown id -> 404; Redis down -> 503 for requests that
need it (``previous_response_id``, GET, DELETE), while plain requests still work (storing is
skipped and logged).

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400, 404 (model,
response id), 413 (body larger than ``max_body_bytes``, from ``limits``), 500, 503; before any SSE byte when
detectable.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from typing import Annotated, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from deepinfer.gateway.api.common import (Assembler, Block, Event, Run, encode_messages_images, field_names,
                                          log_finished, output_budget, parse_body, run, run_to_end)
from deepinfer.gateway.api.errors import OpenAIError, bad_request, unavailable
from deepinfer.gateway.pipeline.generation import Gateway, new_choices, open_choices, respond, start_request
from deepinfer.gateway.api.images import RESPONSES
from deepinfer.gateway.response_store import ResponseStore, StoreUnavailable
from deepinfer.gateway.stream.request_stream import ClientGone, spawn
from deepinfer.gateway.api.structured import checked, response_format_spec, strict_tools_spec, tool_call_spec
from deepinfer.gateway.api.unsupported import (CACHE_OPTIONS, IMAGE_DETAIL, MODERATION, OBFUSCATION, REASONING, TIER,
                                           VERBOSITY, implicit_cache, no_obfuscation, no_reasoning, openai_tier,
                                           refused)
from deepinfer.protocol import SamplingParams
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


# --- request models -------------------------------------------------------------------------


class _Strict(BaseModel):
    # a nested field this module does not declare is a 400 naming it, as at the top level
    model_config = ConfigDict(strict=True, extra="forbid")


def _empty(value) -> bool:
    """A list field sent back empty (as this server's own output items carry it): the field left out."""
    return value == []


DIRECT_CALLER = "only calls made by the model itself ({'type': 'direct'})"
NO_NAMESPACES = "tool namespaces are not supported"


class InputText(_Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict | None = None  # honoured as a no-op: every prompt's prefix is cached


class OutputText(_Strict):
    """Text of an earlier output (``response.output`` sent back as input): only its text is read."""

    type: Literal["output_text"]
    text: str
    annotations: refused("annotations (citations) are not supported; only []", takes=_empty) = None
    logprobs: refused("logprobs are not supported on this API; only []", takes=_empty) = None


class InputImage(_Strict):
    """An image (vision-language models; ``gateway.api.images``): ``image_url`` is a URL or a ``data:`` URL,
    as OpenAI's. ``file_id`` needs a Files API this server does not have."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: refused(IMAGE_DETAIL, takes=lambda v: v == "auto") = None
    prompt_cache_breakpoint: dict | None = None

    @model_validator(mode="after")
    def _url(self):
        if self.image_url is None:
            why = "; file_id is not supported (no Files API)" if self.file_id is not None else ""
            raise ValueError(f"an input_image needs an image_url (a URL or a data: URL){why}")
        return self


ContentPart = Annotated[Union[InputText, OutputText, InputImage], Discriminator("type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    phase: refused("message phases are not supported") = None

    def template_content(self, param: str) -> str | list[dict]:
        """The content for the chat template: text, or with images the parts in order
        (``{"type": "image_url", "url", "param"}`` for ``images.resolve_images``; ``param``: this
        item's path, for errors)."""
        if isinstance(self.content, str):
            return self.content
        if any(isinstance(p, InputImage) for p in self.content):
            return [{"type": "image_url", "url": p.image_url, "param": f"{param}.content[{j}]"}
                    if isinstance(p, InputImage) else {"type": "text", "text": p.text}
                    for j, p in enumerate(self.content)]
        return "\n".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as a string
    id: str | None = None
    status: str | None = None
    async_: refused("asynchronous function calls are not supported; only false",
                    takes=lambda v: v is False) = Field(default=None, alias="async")
    caller: refused(DIRECT_CALLER, takes=lambda v: v == {"type": "direct"}) = None
    namespace: refused(NO_NAMESPACES) = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None
    caller: refused(DIRECT_CALLER, takes=lambda v: v == {"type": "direct"}) = None
    name: refused("a function output is matched to its call by call_id; name is not taken") = None
    namespace: refused(NO_NAMESPACES) = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


def _item_type(value) -> str | None:
    """An item's tag: its ``type`` (a message may leave it out)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


Item = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
    Discriminator(_item_type),
]
_ITEMS = TypeAdapter(list[Item])


class FunctionTool(_Strict):
    type: Literal["function"]  # built-in tools (web_search, file_search, ...) are refused
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # true: calls are constrained to ``parameters`` also under tool_choice "auto"
    async_: refused("asynchronous function calls are not supported; only false",
                    takes=lambda v: v is False) = Field(default=None, alias="async")
    allowed_callers: refused("only the model calls tools (['direct'])", takes=lambda v: v == ["direct"]) = None
    defer_loading: refused("deferred tool loading (tool search) is not supported; only false",
                           takes=lambda v: v is False) = None
    output_schema: refused("function output schemas are not supported") = None

    def to_dict(self) -> dict:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema: a label; the schema alone constrains the output
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # json_schema: the output is an instance of the schema either way
    description: str | None = None  # json_schema: as ``strict``

    @field_validator("name", "schema_", "strict", "description")
    @classmethod
    def _with_json_schema(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("only taken with type 'json_schema'")
        return value


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: refused(VERBOSITY) = None


# ``include`` values about items this server never outputs (no reasoning, no built-in tools): what
# they ask to include is never there
NOTHING_TO_INCLUDE = ("reasoning.encrypted_content", "web_search_call.results", "web_search_call.action.sources",
                      "file_search_call.results", "code_interpreter_call.outputs",
                      "computer_call_output.output.image_url")


def _image_options(value) -> bool:
    return (isinstance(value, dict) and set(value) <= {"context_compression"}
            and value.get("context_compression", "auto") in ("auto", "disabled"))


class ResponsesRequest(_Strict):
    input: str | list[Item]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    # honoured as no-ops (the module docstring says why)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    max_tool_calls: int | None = None
    # refused unless the value asks for what the server does anyway
    include: refused("only values about items this server never outputs ("
                     + ", ".join(NOTHING_TO_INCLUDE) + "); logprobs and input image URLs are not supported",
                     takes=lambda v: isinstance(v, list) and all(x in NOTHING_TO_INCLUDE for x in v)) = None
    background: refused("background responses are not supported; only false", takes=lambda v: v is False) = None
    truncation: refused("only 'disabled' (a conversation over the context is a 400)",
                        takes=lambda v: v == "disabled") = None
    reasoning: refused(REASONING, takes=no_reasoning) = None
    service_tier: refused(TIER, takes=openai_tier) = None
    top_logprobs: refused("logprobs are not supported on this API; only 0",
                           takes=lambda v: type(v) is int and v == 0) = None
    stream_options: refused(OBFUSCATION, takes=no_obfuscation) = None
    prompt_cache_options: refused(CACHE_OPTIONS, takes=implicit_cache) = None
    image: refused("image context compression is not supported; only 'auto' or 'disabled'",
                   takes=_image_options) = None
    context_management: refused("context management (compaction) is not supported", takes=lambda v: v == []) = None
    conversation: refused("conversations are not supported; use previous_response_id") = None
    prompt: refused("prompt templates are not supported") = None
    moderation: refused(MODERATION) = None
    background_options: refused("background responses are not supported") = None
    access_programs: refused("access programs are not supported") = None
    # extensions (as on chat completions)
    ignore_eos: bool = False
    traffic_class: str | None = None
    cache_salt: str | None = None


_FIELDS = field_names(ResponsesRequest, MessageItem, InputText, OutputText, InputImage, FunctionCallItem,
                      FunctionCallOutputItem, FunctionTool, FunctionToolChoice, TextConfig, TextFormat) | {
                          "schema", "async"}


# --- validation and the prompt -------------------------------------------------------------


def validate(req: ResponsesRequest, gw: Gateway) -> None:
    """Checks beyond the types. Raises 404 (unknown model) or 400."""
    if req.model is not None and req.model != gw.model.served_name:
        raise OpenAIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
    if isinstance(req.input, list) and not req.input:
        raise bad_request("input must contain at least one item", param="input")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be at least 1, got {req.max_output_tokens}",
                          param="max_output_tokens")
    if req.temperature is not None and not (math.isfinite(req.temperature) and 0 <= req.temperature <= 2):
        raise bad_request(f"temperature must be between 0 and 2, got {req.temperature}", param="temperature")
    if req.top_p is not None and not (0 < req.top_p <= 1):
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if req.max_tool_calls is not None and req.max_tool_calls < 0:
        raise bad_request(f"max_tool_calls must be >= 0, got {req.max_tool_calls}", param="max_tool_calls")
    names = set()
    for tool in req.tools or []:
        if not TOOL_NAME.match(tool.name):
            raise bad_request(f"tool names must match {TOOL_NAME.pattern}, got {tool.name!r}", param="tools")
        if tool.name in names:
            raise bad_request(f"tool names must be unique, {tool.name!r} repeats", param="tools")
        names.add(tool.name)
    if (req.tool_choice == "required" or isinstance(req.tool_choice, FunctionToolChoice)) and not req.tools:
        raise bad_request("tool_choice forces a tool call but there are no tools", param="tool_choice")


def structured_spec(req: ResponsesRequest) -> dict | None:
    """``SamplingParams.structured`` for ``text.format``, a forcing ``tool_choice`` or strict tools
    under "auto" (``gateway.api.structured``); None = free text. Raises 400 naming the param."""
    fmt = req.text.format if req.text is not None else None
    choice, found = req.tool_choice, []
    if fmt is not None and fmt.type != "text":
        spec = response_format_spec(fmt.type, fmt.schema_, "text.format")
        found.append(("text", checked(spec, "text")))
    if req.tools and (choice == "required" or isinstance(choice, FunctionToolChoice)):
        name = choice.name if isinstance(choice, FunctionToolChoice) else None
        tools = [(t.name, t.parameters) for t in req.tools]
        found.append(("tool_choice", tool_call_spec(tools, name, parallel=req.parallel_tool_calls is not False)))
    if len(found) > 1:
        raise bad_request("text.format and a forced tool_choice cannot be combined", param="tool_choice")
    if not found and req.tools and choice in (None, "auto"):
        return strict_tools_spec([(t.name, t.parameters, bool(t.strict)) for t in req.tools])
    return found[0][1] if found else None


def input_items(req: ResponsesRequest) -> list:
    """The request's input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return list(req.input)


def check_call_outputs(items: list) -> None:
    """Every ``function_call_output`` must answer a ``function_call`` before it. Raises 400."""
    calls: set[str] = set()
    for item in items:
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
            raise bad_request(f"No tool call found for function call output with call_id {item.call_id}.",
                              param="input")


def tools_enabled(req: ResponsesRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def template_tools(req: ResponsesRequest) -> list[dict] | None:
    """Tool definitions in the chat template's (chat completions') shape; None when tools are off."""
    if not tools_enabled(req):
        return None
    out = []
    for t in req.tools:
        fn = {"name": t.name}
        if t.description is not None:
            fn["description"] = t.description
        if t.parameters is not None:
            fn["parameters"] = t.parameters
        out.append({"type": "function", "function": fn})
    return out


def template_messages(instructions: str | None, items: list, first_input: int = 0) -> list[dict]:
    """The conversation as OpenAI chat messages (text content, or parts with images) for the chat
    template. ``items[first_input:]`` are the request's ``input`` (earlier ones, a previous
    response's conversation): an image's errors name its ``input[i].content[j]``."""
    out: list[dict] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for k, item in enumerate(items):
        if isinstance(item, MessageItem):
            where = f"input[{k - first_input}]" if k >= first_input else "previous_response_id"
            out.append({"role": item.role, "content": item.template_content(where)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def dump_items(items: list) -> list[dict]:
    return [it.model_dump(mode="json", exclude_none=True) for it in items]


def load_items(data: list[dict]) -> list:
    """Stored items back into item models. Raises 500 when a stored record is unreadable."""
    try:
        return _ITEMS.validate_python(data, strict=False)
    except ValidationError as e:
        raise OpenAIError(500, f"a stored response is unreadable: {e}", "server_error", None,
                          "internal_error") from None


async def previous_context(store: ResponseStore, response_id: str) -> list:
    """The stored conversation of ``response_id``. Raises 404 (unknown or expired), 503 (Redis down)."""
    try:
        record = await store.get(response_id)
    except StoreUnavailable as e:
        raise unavailable(f"previous_response_id needs the response store: {e}", code="store_unavailable") from None
    if record is None:
        raise OpenAIError(404, f"Previous response with id '{response_id}' not found.",
                          param="previous_response_id", code="previous_response_not_found")
    return load_items(record["context"])


# --- the endpoints ----------------------------------------------------------------------------


def add_routes(app: FastAPI, gw: Gateway) -> None:
    """Register POST /v1/responses, GET and DELETE /v1/responses/{id}; the store (on
    ``app.state.responses_store``) is closed when the app's lifespan ends."""
    app.state.responses_store = ResponseStore(gw.config.redis_url)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            try:
                yield state
            finally:
                await a.state.responses_store.aclose()

    app.router.lifespan_context = lifespan

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await create_response(request, gw, request.app.state.responses_store)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        record = await _stored(request.app.state.responses_store, response_id)
        return JSONResponse(record["response"])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        store = request.app.state.responses_store
        try:
            deleted = await store.delete(response_id)
        except StoreUnavailable as e:
            raise unavailable(str(e), code="store_unavailable") from None
        if not deleted:
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


async def _stored(store: ResponseStore, response_id: str) -> dict:
    try:
        record = await store.get(response_id)
    except StoreUnavailable as e:
        raise unavailable(str(e), code="store_unavailable") from None
    if record is None:
        raise _not_found(response_id)
    return record


async def create_response(request: Request, gw: Gateway, store: ResponseStore) -> Response:
    """Run one Responses request: JSON ``response`` or an SSE stream. Raises ``OpenAIError`` for
    anything detectable before the first byte (the app renders it in OpenAI's shape)."""
    req = parse_body(ResponsesRequest, await request.body(), _FIELDS)
    validate(req, gw)
    structured = structured_spec(req)
    context = await previous_context(store, req.previous_response_id) if req.previous_response_id else []
    new_items = input_items(req)
    check_call_outputs(context + new_items)
    request_id, traffic_class = start_request(request, gw, req)
    prompt_ids, images, embeddings_fp = await encode_messages_images(
        gw, request_id, template_messages(req.instructions, context + new_items, len(context)), template_tools(req),
        param="input", terms=RESPONSES)
    max_tokens = output_budget(gw.max_model_len, len(prompt_ids), req.max_output_tokens, "input")
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tokens=max_tokens,
        ignore_eos=req.ignore_eos,
        structured=structured,
    )
    choices = new_choices(gw, request_id, 1, [], traffic_class, req.cache_salt, images=images,
                          embeddings_fingerprint=embeddings_fp)
    try:
        await open_choices(choices, prompt_ids, sampling, request.is_disconnected)
    except ClientGone:
        return Response(status_code=499)
    r = Run(request_id, choices[0], Assembler(parse_tools=tools_enabled(req), keep_empty=True,
                                              max_calls=1 if req.parallel_tool_calls is False else None),
            len(prompt_ids))
    reply = _Reply(r, req, gw.model.served_name, store, dump_items(context + new_items))
    log.info("request_started", api="responses", prompt_tokens=len(prompt_ids), stream=req.stream,
             previous_response_id=req.previous_response_id, worker=choices[0].stream.worker_id)
    return await respond(request, bool(req.stream), _sse(reply) if req.stream else None,
                         lambda r: _collect(reply, r), {"X-Request-Id": request_id})


class _Reply:
    """The response under construction: its items (from the run's assembler), status, usage, storage."""

    def __init__(self, r: Run, req: ResponsesRequest, model: str, store: ResponseStore, context: list[dict]):
        self.run = r
        self.req = req
        self.model = model
        self.store = store
        self.context = context  # conversation items before this response's output (JSON)
        self.id = f"resp_{r.request_id}"
        self.created_at = int(time.time())
        self.item_ids: dict[int, str] = {}

    def item_id(self, b: Block) -> str:
        prefix = "msg" if b.kind == "text" else "fc"
        return self.item_ids.setdefault(b.index, f"{prefix}_{uuid.uuid4().hex}")

    @property
    def truncated(self) -> bool:
        return self.run.proc.finish_reason == "length"

    def item(self, b: Block, status: str | None = None) -> dict:
        """Block ``b`` as an output item; ``status`` None: final (completed, or incomplete when cut)."""
        if b.kind == "text":
            if status is None:
                status = "incomplete" if self.truncated else "completed"
            content = [] if status == "in_progress" else [self.part(b.text)]
            return {"id": self.item_id(b), "type": "message", "status": status, "role": "assistant",
                    "content": content}
        return {"id": self.item_id(b), "type": "function_call", "status": status or "completed",
                "call_id": b.call.id, "name": b.call.name,
                "arguments": "" if status == "in_progress" else b.call.arguments}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def usage(self) -> dict:
        r = self.run
        return {"input_tokens": r.num_prompt_tokens, "input_tokens_details": {"cached_tokens": r.cached_tokens},
                "output_tokens": r.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": r.num_prompt_tokens + r.output_tokens}

    def response(self, status: str, output: list[dict] | None = None, usage: dict | None = None,
                 error: dict | None = None) -> dict:
        req = self.req
        tool_choice = req.tool_choice
        if isinstance(tool_choice, BaseModel):
            tool_choice = tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output or [], "parallel_tool_calls": True if req.parallel_tool_calls is None
            else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": _format_echo(req)}, "tool_choice": tool_choice or "auto",
            "tools": [t.to_dict() for t in req.tools or []], "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }

    def final(self) -> dict:
        output = [self.item(b) for b in self.run.assembler.blocks]
        return self.response("incomplete" if self.truncated else "completed", output, self.usage())

    async def save(self, response: dict) -> None:
        """Store ``response`` with its conversation when ``store`` is set; a failure is only logged."""
        if not self.req.store:
            return
        try:
            await self.store.put(response, self.context + response["output"])
        except StoreUnavailable as e:
            log.warning("response_not_stored", response_id=self.id, error=str(e))


async def _collect(reply: _Reply, request: Request) -> dict:
    r = reply.run
    await run_to_end(r, request.is_disconnected)
    body = reply.final()
    await reply.save(body)
    return body


class _Events:
    """SSE lines with ``sequence_number``s."""

    def __init__(self):
        self.seq = 0

    def __call__(self, kind: str, **data) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _item_events(reply: _Reply, ev: _Events, events: list[Event]):
    for e in events:
        b = e.block
        ids = {"item_id": reply.item_id(b), "output_index": b.index}
        if b.kind == "text":
            if e.kind == "start":
                yield ev("response.output_item.added", output_index=b.index, item=reply.item(b, "in_progress"))
                yield ev("response.content_part.added", **ids, content_index=0, part=reply.part(""))
            elif e.kind == "delta" and e.text:
                yield ev("response.output_text.delta", **ids, content_index=0, delta=e.text, logprobs=[])
            elif e.kind == "stop":
                yield ev("response.output_text.done", **ids, content_index=0, text=b.text, logprobs=[])
                yield ev("response.content_part.done", **ids, content_index=0, part=reply.part(b.text))
                yield ev("response.output_item.done", output_index=b.index, item=reply.item(b))
        elif e.kind == "start":
            yield ev("response.output_item.added", output_index=b.index, item=reply.item(b, "in_progress"))
            yield ev("response.function_call_arguments.delta", **ids, delta=b.call.arguments)
        elif e.kind == "stop":
            yield ev("response.function_call_arguments.done", **ids, name=b.call.name, arguments=b.call.arguments)
            yield ev("response.output_item.done", output_index=b.index, item=reply.item(b))


async def _sse(reply: _Reply):
    r = reply.run
    ev = _Events()
    clean = False
    try:
        yield ev("response.created", response=reply.response("in_progress"))
        yield ev("response.in_progress", response=reply.response("in_progress"))
        try:
            async with aclosing(run(r)) as arriving:
                async for events in arriving:
                    for line in _item_events(reply, ev, events):
                        yield line
        except OpenAIError as e:
            clean = True
            yield ev("error", code=e.code or e.type, message=e.message, param=None)
            output = [reply.item(b, "incomplete") for b in r.assembler.blocks]
            failed = reply.response("failed", output, reply.usage(), error={"code": "server_error",
                                                                               "message": e.message})
            yield ev("response.failed", response=failed)
            return
        body = reply.final()
        await reply.save(body)
        yield ev(f"response.{body['status']}", response=body)
        clean = True
    finally:
        # NOTE: when the client disconnects, Starlette cancels this generator and an
        # await here could be cancelled too, so the abort is its own task.
        spawn(r.choice.stream.abort())
        log_finished(r, disconnected=not clean)


def _format_echo(req: ResponsesRequest) -> dict:
    """``text.format`` as the response echoes it (``{"type": "text"}`` when none was given)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)
