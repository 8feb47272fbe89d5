"""POST /v1/completions (OpenAI legacy completions): a raw prompt, no chat template.

The prompt is a string (encoded here with the model's tokenizer, as
``tokenizer(prompt)`` would: its special tokens are parsed, since a raw prompt
is the caller's own template) or a list of token ids. One prompt per request:
a list of prompts is refused (400) rather than half-supported. ``echo``
prepends the prompt's text; ``logprobs`` (0-5) fills the legacy ``logprobs``
object (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``);
``echo`` with ``logprobs`` would need prompt logprobs and is refused, as are
``suffix`` (no fill-in-the-middle) and ``best_of`` other than ``n``. A
vision-language model's image placeholder token in a prompt (as an id, or as
its text, which a raw prompt parses as the special token) is refused too: only
an image may put it there, and this endpoint takes none.
Generation, n > 1, stop strings and errors are the chat endpoint's
(``generate.py``); responses have OpenAI's ``text_completion`` shape.
vLLM's structured-output fields (``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``, ``structured_outputs``) constrain the
text (``gateway.structured``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing

import structlog
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from deepinfer.gateway import logprobs as lp
from deepinfer.gateway import openai_schema as oai
from deepinfer.gateway.chat import (TRAFFIC_CLASS_HEADER, request_traffic_class, sampling_params,
                                    validate_sampling)
from deepinfer.gateway.errors import OpenAIError, bad_request, context_length_exceeded, error_body, validation_error
from deepinfer.gateway.generate import (Choice, Gateway, abort_all, check_workers, chunks, failure, http_error,
                                        new_choices, open_choices, raise_if_failed, usage_counts)
from deepinfer.gateway.stream import ClientGone, StreamError, spawn
from deepinfer.gateway.structured import openai_spec
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

MAX_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
_FIELD_NAMES = oai.field_names()


async def create_completion(request: Request, gw: Gateway) -> Response:
    try:
        req = oai.CompletionRequest.model_validate_json(await request.body() or b"")
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False), _FIELD_NAMES) from None
    validate(req, gw)
    structured = openai_spec(req)
    request_id = uuid.uuid4().hex
    structlog.contextvars.bind_contextvars(request_id=request_id)
    check_workers(gw.registry, gw.required_roles)
    traffic_class = request_traffic_class(req, request.headers.get(TRAFFIC_CLASS_HEADER), gw.config.traffic_classes)
    prompt_ids = await prompt_token_ids(req, gw)
    want_logprobs = req.logprobs is not None
    sampling = sampling_params(req, len(prompt_ids), gw.max_model_len, logprobs=want_logprobs,
                               top_logprobs=req.logprobs or 0, prompt_field="prompt",
                               default_max_tokens=DEFAULT_MAX_TOKENS)
    sampling.structured = structured
    choices = new_choices(gw, request_id, req.n or 1, req.stop_strings, traffic_class, req.cache_salt)
    try:
        await open_choices(choices, prompt_ids, sampling, request.is_disconnected)
    except ClientGone:
        return Response(status_code=499)
    reply = _Completion(f"cmpl-{request_id}", int(time.time()), gw.model.served_name, req, prompt_ids, choices, gw,
                        gw.model.tokenizer.decode(prompt_ids) if req.echo else "")
    if req.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id}
        return StreamingResponse(reply.sse(), media_type="text/event-stream", headers=headers)
    try:
        return JSONResponse(await reply.collect(request), headers={"X-Request-Id": request_id})
    except ClientGone:
        return Response(status_code=499)


def validate(req: oai.CompletionRequest, gw: Gateway) -> None:
    """400 for what this endpoint does not do or takes out of range (404 for an unknown model)."""
    if req.suffix is not None:
        raise bad_request("suffix (fill-in-the-middle) is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of is not supported (only best_of == n)", param="best_of")
    if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
        raise bad_request("one prompt per request: send a string or a list of token ids", param="prompt")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}", param="logprobs")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported", param="echo")
    vocab = gw.model.vocab_size
    if isinstance(req.prompt, list) and any(not 0 <= t < (vocab or 2**31) for t in req.prompt):
        raise bad_request(f"prompt token ids must be in [0, {vocab or 2**31})", param="prompt")
    validate_sampling(req, gw.model)


async def prompt_token_ids(req: oai.CompletionRequest, gw: Gateway) -> list[int]:
    """The prompt's ids: given, or a text prompt tokenized here, off the event loop (a long prompt
    there stalled every other request for as long as it took: minutes for 30 MiB). A text longer
    than any prompt that fits can be (``max_model_len`` tokens of the vocabulary's longest token,
    with room for normalisation) is refused without tokenizing it."""
    if isinstance(req.prompt, list):
        ids = list(req.prompt)
    else:  # a ``tokenizers.Tokenizer`` returns an Encoding; a transformers tokenizer, a list of ids
        limit = gw.max_model_len * longest_token_chars(gw.model.tokenizer) * 4
        if len(req.prompt) > limit:
            raise context_length_exceeded(gw.max_model_len, gw.max_model_len, max(req.max_tokens or 0, 1), "prompt",
                                          exact=False)
        enc = await asyncio.to_thread(gw.model.tokenizer.encode, req.prompt)
        ids = list(enc.ids) if hasattr(enc, "ids") else list(enc)
    if not ids:
        raise bad_request("the prompt is empty", param="prompt")
    image_token = gw.model.image_token_id
    if image_token is not None and image_token in ids:
        # NOTE: its rows would be fed the token's own embedding instead of an image's: garbage, silently
        raise bad_request(f"the prompt holds the image placeholder token (id {image_token}) but this endpoint "
                          "takes no images: send images as image_url parts to /v1/chat/completions",
                          param="prompt", code="image_token_without_image")
    return ids


_LONGEST: dict[int, int] = {}  # id(tokenizer) -> its longest token, in characters of its vocabulary


def longest_token_chars(tokenizer) -> int:
    """The most characters one token stands for (byte-level vocabularies: bytes, so at least as many)."""
    key = id(tokenizer)
    if key not in _LONGEST:
        _LONGEST[key] = max(map(len, tokenizer.get_vocab()), default=1) or 1
    return _LONGEST[key]


class _Completion:
    """One completions response under construction (JSON or SSE)."""

    def __init__(self, cid: str, created: int, model: str, req: oai.CompletionRequest, prompt_ids: list[int],
                 choices: list[Choice], gw: Gateway, echo: str):
        self.id, self.created, self.model, self.req = cid, created, model, req
        self.prompt_ids, self.choices, self.gw, self.echo = prompt_ids, choices, gw, echo
        self.offsets = {c.index: len(echo) for c in choices}  # text_offset of the next token

    def usage(self) -> dict:
        return oai.usage(*usage_counts(self.choices, len(self.prompt_ids)))

    def logprobs(self, c: Choice, chunk) -> dict | None:
        """Legacy logprobs of the chunk's tokens (None when not asked)."""
        if self.req.logprobs is None:
            return None
        entries = lp.content(self.gw.token_bytes, chunk.token_ids, chunk.logprobs) or []
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e["token"])
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append({t["token"]: t["logprob"] for t in e["top_logprobs"]})
            out["text_offset"].append(self.offsets[c.index])
            self.offsets[c.index] += len(e["token"])
        return out

    async def collect(self, request: Request) -> dict:
        merged = {c.index: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                  for c in self.choices}
        try:
            async with aclosing(chunks(self.choices, request.is_disconnected)) as arriving:
                async for c, chunk in arriving:
                    raise_if_failed(chunk)
                    delta = c.proc.process(chunk)
                    c.parts.append(delta.text)
                    for k, v in (self.logprobs(c, chunk) or {}).items():
                        merged[c.index][k] += v
                    if delta.finish_reason:
                        await c.stream.abort()  # a stop string ended it: the worker still runs
        except StreamError as e:
            raise http_error(e) from None
        finally:
            await abort_all(self.choices)
        out = [oai.completion_choice(c.index, self.echo + "".join(c.parts), c.proc.finish_reason,
                                     merged[c.index] if self.req.logprobs is not None else None)
               for c in self.choices]
        return oai.completion(self.id, self.created, self.model, out, self.usage())

    async def sse(self):
        try:
            if self.echo:
                for c in self.choices:
                    yield _event(self._chunk(c.index, self.echo, None, None))
            try:
                async with aclosing(chunks(self.choices)) as arriving:
                    async for c, chunk in arriving:
                        failed = failure(chunk)
                        if failed is not None:
                            yield _event(error_body(failed.message, failed.type, None, failed.code))
                            return
                        delta = c.proc.process(chunk)
                        logprobs = self.logprobs(c, chunk)
                        if delta.text or delta.finish_reason or logprobs:
                            yield _event(self._chunk(c.index, delta.text, delta.finish_reason, logprobs))
                        if delta.finish_reason:
                            await c.stream.abort()
            except StreamError as e:
                yield _event(error_body(str(e), "server_error", None, e.code))
                return
            if self.req.include_usage:
                yield _event({**oai.completion(self.id, self.created, self.model, [], self.usage())})
            yield "data: [DONE]\n\n"
        finally:
            for c in self.choices:
                spawn(c.stream.abort())

    def _chunk(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        body = oai.completion(self.id, self.created, self.model,
                              [oai.completion_choice(index, text, finish_reason, logprobs)], None)
        if not self.req.include_usage:
            del body["usage"]
        return body


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


__all__ = ["create_completion", "OpenAIError"]
