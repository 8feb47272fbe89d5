"""POST /tokenize and POST /detokenize, as vLLM serves them (no generation, no engine worker).

``/tokenize`` takes either a raw prompt::

    {"model"?, "prompt": str, "add_special_tokens": true, "return_token_strs": false}

encoded here with the model's tokenizer, as ``/v1/completions`` encodes a text prompt; or chat
messages (OpenAI's chat shape)::

    {"model"?, "messages": [...], "add_generation_prompt": true, "tools"?: [...],
     "add_special_tokens": false, "return_token_strs": false}

rendered with the chat template by the tokenizer service, exactly as ``/v1/chat/completions``
renders them (images included, through the vision service). Either way the answer is
``{"count": int, "max_model_len": int, "tokens": [int, ...]}`` (``max_model_len``: the context
requests are held to, ``Gateway.max_model_len``), plus ``"token_strs": [str, ...]`` (the
vocabulary's pieces) when ``return_token_strs`` is true.

``/detokenize`` takes ``{"model"?, "tokens": [int, ...]}`` and answers ``{"prompt": str}``: the ids
decoded with their special tokens, as vLLM (transformers' ``decode``) does.

Errors have OpenAI's shape: 400 for a malformed body, an empty prompt, token ids outside the
vocabulary, or what this gateway does not do (``continue_final_message``, a ``chat_template`` of
the request's own, ``add_special_tokens`` with messages: the template places the special tokens);
404 for another ``model``; 503 when no tokenizer worker is alive (messages only).
"""

from __future__ import annotations

import asyncio
import json
import uuid

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, RootModel

from deepinfer.gateway.api import openai_schema as oai
from deepinfer.gateway.api.common import encode_messages_images, field_names, parse_body
from deepinfer.gateway.api.errors import OpenAIError, bad_request
from deepinfer.gateway.pipeline.generation import Gateway, check_workers


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[oai.ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[oai.ToolSpec] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


class TokenizeRequest(RootModel[TokenizeChatRequest | TokenizeCompletionRequest]):
    """A /tokenize body, chat messages or a raw prompt, as the OpenAPI spec describes it (a body is
    parsed as the one its fields name: ``request_model``)."""


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


_FIELDS = field_names(TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest) | oai.field_names()


def add_routes(app: FastAPI, gw: Gateway) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenize_body(await request.body(), gw)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_body(DetokenizeRequest, await request.body(), _FIELDS)
        check_model(req.model, gw)
        vocab = gw.model.vocab_size or 2**31
        if any(not 0 <= t < vocab for t in req.tokens):
            raise bad_request(f"tokens must be token ids in [0, {vocab})", param="tokens")
        return {"prompt": gw.model.tokenizer.decode(req.tokens, skip_special_tokens=False)}


async def tokenize_body(body: bytes, gw: Gateway) -> dict:
    """The /tokenize answer for a JSON body (see the module docstring). Raises ``OpenAIError``."""
    req = parse_body(request_model(body), body, _FIELDS)
    check_model(req.model, gw)
    if isinstance(req, TokenizeChatRequest):
        ids = await chat_ids(req, gw)
    else:  # a ``tokenizers.Tokenizer`` returns an Encoding; a transformers tokenizer, a list of ids
        enc = await asyncio.to_thread(gw.model.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        ids = list(enc.ids) if hasattr(enc, "ids") else list(enc)
    out = {"count": len(ids), "max_model_len": gw.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = token_strs(gw.model.tokenizer, ids)
    return out


def request_model(body: bytes) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    """Which /tokenize body this is: chat with a ``messages`` field, else a raw prompt (so an error
    names the field of the body the client meant)."""
    try:
        raw = json.loads(body or b"")
    except ValueError:
        raw = None
    return TokenizeChatRequest if isinstance(raw, dict) and "messages" in raw else TokenizeCompletionRequest


async def chat_ids(req: TokenizeChatRequest, gw: Gateway) -> list[int]:
    """The messages' prompt ids, rendered by the tokenizer service as the chat endpoint renders them."""
    if not req.messages:
        raise bad_request("messages must contain at least one message", param="messages")
    for name in ("continue_final_message", "chat_template", "chat_template_kwargs"):
        if getattr(req, name):
            raise bad_request(f"{name} is not supported: messages are rendered with the model's own chat template",
                              param=name)
    if req.add_special_tokens:
        raise bad_request("add_special_tokens is not supported with messages: the chat template places the "
                          "model's special tokens", param="add_special_tokens")
    check_workers(gw.registry, ("tokenizer",))
    tools = [t.to_template() for t in req.tools] if req.tools else None
    ids, _, _ = await encode_messages_images(gw, uuid.uuid4().hex, [m.to_template() for m in req.messages], tools,
                                             add_generation_prompt=req.add_generation_prompt)
    return ids


def token_strs(tokenizer, ids: list[int]) -> list[str]:
    """The vocabulary's piece for each id (``convert_ids_to_tokens``, as vLLM returns them)."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return list(tokenizer.convert_ids_to_tokens(ids))
    return [tokenizer.id_to_token(i) for i in ids]


def check_model(model: str | None, gw: Gateway) -> None:
    if model is not None and model != gw.model.served_name:
        raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
