"""OpenAI chat-completions wire shapes: the request model and the response builders.

The request is parsed strictly from JSON (``"10"`` is not an int, ``1`` is not
a bool) and unknown fields are ignored, as OpenAI does. vLLM extensions:
``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (the response then carries
``prompt_token_ids`` at the top level and ``token_ids`` in each choice; in a
stream, ``prompt_token_ids`` rides on the first chunk and ``token_ids`` on
each chunk's choice, beside ``delta``, as vLLM does).

``logprobs`` (with ``top_logprobs``) fills ``choices[].logprobs`` as
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...],
"refusal": null}``, in a stream with the entries of that chunk's tokens
(``deepinfer.gateway.logprobs``).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(_Strict):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text'")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' field")
        return self


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict:
        """The ``{"role", "content"}`` map the tokenizer's chat template expects."""
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list):
            text = "\n".join(p.text or "" for p in self.content)
        else:
            text = self.content or ""
        return {"role": role, "content": text}


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
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
    logprobs: bool | None = None
    top_logprobs: int | None = None
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

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def field_names() -> set[str]:
    """Every field name of the request models (to name ``param`` in validation errors)."""
    names: set[str] = set()
    for model in (ChatCompletionRequest, ChatMessage, ContentPart, StreamOptions):
        names |= set(model.model_fields)
    return names


# --- responses -----------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choice(
    index: int,
    text: str,
    finish_reason: str,
    logprobs: list[dict] | None = None,
    token_ids: list[int] | None = None,
) -> dict:
    """One ``choices[]`` entry of a non-streamed completion; ``logprobs``: content entries, or None."""
    out = {
        "index": index,
        "message": {"role": "assistant", "content": text},
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


def model_card(model_id: str, root: str, max_model_len: int, created: int | None = None) -> dict:
    return {
        "id": model_id,
        "object": "model",
        "created": created if created is not None else int(time.time()),
        "owned_by": "deepinfer",
        "root": root,
        "max_model_len": max_model_len,
    }
