"""OpenAI chat-completions wire shapes: the request model and the response builders.

The request is parsed strictly from JSON (``"10"`` is not an int, ``1`` is not
a bool). A field the request does not declare, at the top level or nested, is a 400 naming it
(OpenAI answers an unknown argument so too), and a declared field for a feature this server lacks is refused unless
its value asks for what the server does anyway (``gateway.api.unsupported``; docs/api_fields.md lists
every field: honoured, honoured as a no-op and why, refused). vLLM extensions:
``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (the response then carries
``prompt_token_ids`` at the top level and ``token_ids`` in each choice; in a
stream, ``prompt_token_ids`` rides on the first chunk and ``token_ids`` on
each chunk's choice, beside ``delta``, as vLLM does), and structured output
as vLLM takes it: ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar`` (llguidance's Lark) or ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``); see ``gateway.api.structured``.

``logprobs`` (with ``top_logprobs``) fills ``choices[].logprobs`` as
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...],
"refusal": null}``, in a stream with the entries of that chunk's tokens
(``deepinfer.gateway.api.logprobs``).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from deepinfer.gateway.api.unsupported import (CACHE_OPTIONS, IMAGE_DETAIL, MODERATION, OBFUSCATION, REASONING, TIER,
                                           VERBOSITY, implicit_cache, openai_tier, refused)


class _Strict(BaseModel):
    # a nested field this module does not declare is a 400 naming it, as at the top level
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict | None = None  # honoured as a no-op: every prompt's prefix is cached


class ImageURL(_Strict):
    url: str
    detail: refused(IMAGE_DETAIL, takes=lambda v: v == "auto") = None


class ImagePart(_Strict):
    """An image (vision-language models; ``gateway.api.images``)."""

    type: Literal["image_url"]
    image_url: ImageURL
    prompt_cache_breakpoint: dict | None = None


ContentPart = Annotated[Union[TextPart, ImagePart], Discriminator("type")]


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's wire form)


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant turn, sent back in ``messages``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # tool messages; refused on the others (no chat template here renders it)
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    # what an earlier response's message carries (a client may send ``message.model_dump()`` back):
    # null, or empty, is the field left out
    refusal: refused("an assistant refusal cannot be sent back; send its text as content") = None
    audio: refused("audio output is not supported") = None
    function_call: refused("the deprecated function_call is not supported; use tool_calls") = None
    annotations: refused("annotations (web search citations) are not supported; only []",
                         takes=lambda v: v == []) = None

    @field_validator("name")
    @classmethod
    def _tool_name_only(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("role") != "tool":
            raise PydanticCustomError("unsupported", "participant names are not supported (the chat template has "
                                                     "no place for them); only tool messages take a name")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_on_tool_messages(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("role") != "tool":
            raise ValueError("only tool messages carry a tool_call_id")
        return value

    @model_validator(mode="after")
    def _role_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def to_template(self) -> dict:
        """The message as the tokenizer's chat template takes it (OpenAI's shape, text content)."""
        if isinstance(self.content, list) and any(p.type == "image_url" for p in self.content):
            # images: the parts in order, for ``images.resolve_images`` then the template
            text = [{"type": "image_url", "url": p.image_url.url} if p.type == "image_url"
                    else {"type": "text", "text": p.text} for p in self.content]
        elif isinstance(self.content, list):
            text = "\n".join(p.text for p in self.content)
        else:
            text = self.content or ""
        # "developer" is OpenAI's new name for system instructions; templates know "system"
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionSpec(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None  # JSON Schema of the arguments
    strict: bool | None = None  # true: calls are constrained to ``parameters`` also under tool_choice "auto"


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec

    def to_template(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(_Strict):
    """``response_format.json_schema``: the output is an instance of ``schema``. ``name`` labels it;
    ``description`` and ``strict`` change nothing here, since the grammar makes the output an
    instance of the schema whatever they say."""

    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: refused(OBFUSCATION, takes=lambda v: v is False) = None


class Prediction(_Strict):
    """A Predicted Output: text the answer is expected to repeat. It only speeds OpenAI up; the
    output is the same with it or without, which is what this server gives (it is not used)."""

    type: Literal["content"]
    content: str | list[TextPart]


class SamplingRequest(_Strict):
    """Fields every OpenAI generation endpoint shares (chat and legacy completions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    cache_salt: str | None = None  # tenant key: prompts with other salts never share cached KV
    # DeepInfer: retention class of the prompt's KV in the storage tier (also the
    # X-Traffic-Class header); default "chat"
    traffic_class: str | None = None
    # DeepInfer: hybrid sliding-window models, how a cached prefix's window state is rebuilt when it
    # is not cached ("bounded" replay of the last window, approximate; "exact" recompute); None = the
    # worker's --swa-replay
    swa_replay: Literal["bounded", "exact"] | None = None
    # vLLM: structured output (``gateway.api.structured``)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # honoured as no-ops on a single-tenant server: end-user ids and tags nothing here reads (``user``
    # too), cache hints for a prefix cache that caches every prompt by itself, a latency hint
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prediction: Prediction | None = None
    # refused unless the value asks for what the server does anyway
    store: refused("chat completions are not stored (there is no API to read them back); only false",
                   takes=lambda v: v is False) = None
    service_tier: refused(TIER, takes=openai_tier) = None
    modalities: refused("only the text output modality is supported", takes=lambda v: v == ["text"]) = None
    reasoning_effort: refused(REASONING, takes=lambda v: v == "none") = None
    prompt_cache_options: refused(CACHE_OPTIONS, takes=implicit_cache) = None
    verbosity: refused(VERBOSITY) = None
    audio: refused("audio output is not supported") = None
    functions: refused("the deprecated functions are not supported; use tools") = None
    function_call: refused("the deprecated function_call is not supported; use tools and tool_choice") = None
    moderation: refused(MODERATION) = None
    web_search_options: refused("web search is not supported") = None


class CompletionRequest(SamplingRequest):
    """``/v1/completions`` (legacy): a raw prompt, no chat template."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token, 0-5
    suffix: str | None = None
    best_of: int | None = None


def field_names() -> set[str]:
    """Every field name of the request models (to name ``param`` in validation errors)."""
    names: set[str] = set()
    for model in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, ImagePart, ImageURL, StreamOptions,
                  ToolCallIn, FunctionCall, ToolSpec, FunctionSpec, NamedToolChoice, FunctionName, ResponseFormat,
                  JSONSchemaFormat, Prediction):
        names |= set(model.model_fields)
    return names | {"schema"}


# --- responses -----------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def tool_calls(calls: list, first_index: int = 0, stream: bool = False) -> list[dict]:
    """``ToolCall`` s in OpenAI's wire form (with ``index`` in a stream delta)."""
    out = []
    for i, c in enumerate(calls):
        item = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        out.append({"index": first_index + i, **item} if stream else item)
    return out


def choice(
    index: int,
    text: str,
    finish_reason: str,
    logprobs: list[dict] | None = None,
    token_ids: list[int] | None = None,
    calls: list | None = None,
) -> dict:
    """One ``choices[]`` entry of a non-streamed completion; ``logprobs``: content entries, or None;
    ``calls``: parsed tool calls (content is then null when no text came with them)."""
    message = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = tool_calls(calls)
    out = {
        "index": index,
        "message": message,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def chat_completion(
    completion_id: str,
    created: int,
    model: str,
    choices: list[dict],
    usage_block: dict,
    prompt_token_ids: list[int] | None = None,
) -> dict:
    out = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_block,
    }
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = prompt_token_ids
    return out


def chat_chunk(
    completion_id: str,
    created: int,
    model: str,
    delta: dict,
    index: int = 0,
    finish_reason: str | None = None,
    logprobs: list[dict] | None = None,
    token_ids: list[int] | None = None,
    with_usage_field: bool = False,
) -> dict:
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    out = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if with_usage_field:
        out["usage"] = None  # OpenAI sends null on every chunk but the last when include_usage is set
    return out


def usage_chunk(completion_id: str, created: int, model: str, usage_block: dict) -> dict:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_block,
    }


def completion(completion_id: str, created: int, model: str, choices: list[dict], usage_block: dict) -> dict:
    return {"id": completion_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_block}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def model_card(model_id: str, root: str, max_model_len: int, created: int | None = None) -> dict:
    return {
        "id": model_id,
        "object": "model",
        "created": created if created is not None else int(time.time()),
        "owned_by": "deepinfer",
        "root": root,
        "max_model_len": max_model_len,
    }
