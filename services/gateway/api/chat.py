"""POST /v1/chat/completions: validate, tokenize, submit, then stream SSE or collect JSON.

Everything that can be answered with an HTTP error (validation, tokenizer,
submit, prefill failure before the first token) happens before the response
starts, so SSE bytes are only sent once the first token is in hand. After
that, a failure is an SSE ``data: {"error": {...}}`` event and the stream ends.

``n`` > 1 fans out: n independent requests through the mesh (ids
``<id>-0`` .. ``<id>-<n-1>``, seeds ``seed + i`` when a seed is set), each
with its own ``RequestStream`` and ``OutputProcessor``; choice i is request
i. Every one must have its first token before the response starts; their
chunks are then merged as they arrive (a stream chunk carries its choice
``index``). Usage counts the prompt once and sums the completions. If any
choice fails, the whole request fails and the others are aborted.

Structured output (``response_format``, vLLM's ``guided_*`` / ``structured_outputs``) and
forced tool calls (``tool_choice`` "required" or a named function: the output is constrained
to calls of the declared tools) become ``SamplingParams.structured`` (``gateway.api.structured``),
checked before anything is dispatched: an unsupported spec is a 400 naming it. With tools and
``parallel_tool_calls: false`` but no forced call, a choice ends at its first tool call (finish
``tool_calls``; the worker is stopped there, as for a stop string).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from deepinfer.gateway.api import logprobs as lp
from deepinfer.gateway.api import openai_schema as oai
from deepinfer.gateway.api.common import encode_messages_images, output_budget, parse_body
from deepinfer.gateway.config import ModelInfo
from deepinfer.gateway.api.errors import OpenAIError, bad_request, error_body
from deepinfer.gateway.pipeline.generation import (Choice, Gateway, abort_all, chunks, failure, http_error, new_choices,
                                        open_choices, raise_if_failed, respond, start_request, usage_counts)
from deepinfer.gateway.stream.request_stream import ClientGone, StreamError, spawn
from deepinfer.gateway.api.structured import openai_spec, strict_tools_spec, tool_call_spec
from deepinfer.gateway.api.tools import ToolCallParser
from deepinfer.protocol import SamplingParams, TokenChunk
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

MAX_N = 128
MAX_TOP_LOGPROBS = 20
# NOTE: the engine samples in float32: a temperature (or penalty) past its range turns every weight
# into NaN, and the draw then picks a token the masks had ruled out (EOS under min_tokens, a token
# a grammar forbids)
FLOAT32_MAX = 3.4028234663852886e38
_FIELD_NAMES = oai.field_names()


@dataclass
class _Reply:
    """One request's response under construction."""

    request_id: str
    model: str
    req: oai.ChatCompletionRequest
    prompt_token_ids: list[int]
    choices: list[Choice]
    token_bytes: lp.TokenBytes
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return f"chatcmpl-{self.request_id}"

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.proc.token_ids) for c in self.choices)

    def usage(self) -> dict:
        return oai.usage(*usage_counts(self.choices, len(self.prompt_token_ids)))

    def logprobs(self, chunk: TokenChunk) -> list[dict] | None:
        """The chunk's logprobs content entries, or None when the request did not ask."""
        if not self.req.logprobs:
            return None
        return lp.content(self.token_bytes, chunk.token_ids, chunk.logprobs)


async def create_chat_completion(request: Request, gw: Gateway) -> Response:
    req = parse_request(await request.body())
    validate_request(req, gw.model)
    structured = structured_spec(req)
    request_id, traffic_class = start_request(request, gw, req)
    prompt_ids, images, embeddings_fp = await tokenize(gw, request_id, req)
    sampling = sampling_params(req, len(prompt_ids), gw.max_model_len)
    sampling.structured = structured

    n = req.n or 1
    choices = new_choices(gw, request_id, n, req.stop_strings, traffic_class, req.cache_salt,
                          images=images, embeddings_fingerprint=embeddings_fp)
    for c in choices:
        c.tool_parser = ToolCallParser(enabled=bool(req.tools) and req.tool_choice != "none",
                                       max_calls=1 if req.parallel_tool_calls is False else None)
    try:
        await open_choices(choices, prompt_ids, sampling, request.is_disconnected)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening any more

    reply = _Reply(request_id, gw.model.served_name, req, prompt_ids, choices, gw.token_bytes)
    log.info("request_started", prompt_tokens=len(prompt_ids), stream=bool(req.stream), n=n,
             worker=choices[0].stream.worker_id)
    return await respond(request, bool(req.stream), _sse(reply) if req.stream else None,
                         lambda r: _collect(reply, r), {"X-Request-Id": request_id})


# --- validation ----------------------------------------------------------------


def parse_request(body: bytes) -> oai.ChatCompletionRequest:
    return parse_body(oai.ChatCompletionRequest, body, _FIELD_NAMES)


def validate_request(req: oai.ChatCompletionRequest, model: ModelInfo) -> None:
    if not req.messages:
        raise bad_request("messages must contain at least one message", param="messages")
    validate_messages(req.messages)
    if req.top_logprobs is not None:
        if not (0 <= req.top_logprobs <= MAX_TOP_LOGPROBS):
            raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}",
                              param="top_logprobs")
        if req.top_logprobs > 0 and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    validate_sampling(req, model)
    if req.tool_choice is not None and not req.tools:
        raise bad_request("tool_choice is only allowed when tools are specified", param="tool_choice")
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", param="tools")


def validate_messages(messages: list[oai.ChatMessage]) -> None:
    """The conversation's own rules, as OpenAI checks them: content on every message but an
    assistant one that calls tools (and never an empty list of parts); tool calls' arguments a JSON
    object; a tool message answers a call of an earlier assistant message. Raises a 400 naming the
    field (``messages[i]...``)."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.content == [] or (m.content is None and not (m.role == "assistant" and m.tool_calls)):
            raise bad_request(f"messages[{i}].content: a {m.role} message needs content (a string or at least "
                              "one part)" + (", or tool_calls" if m.role == "assistant" else ""),
                              param=f"messages[{i}].content")
        for j, call in enumerate(m.tool_calls or []):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError as e:
                raise bad_request(f"{where}: not valid JSON ({e})", param=where) from None
            if not isinstance(arguments, dict):
                raise bad_request(f"{where}: must be a JSON object", param=where)
            calls.add(call.id)
        if m.role == "tool" and m.tool_call_id not in calls:
            raise bad_request(f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no tool call of an earlier "
                              "assistant message", param=f"messages[{i}].tool_call_id")


def structured_spec(req: oai.ChatCompletionRequest) -> dict | None:
    """``SamplingParams.structured`` for the request (``gateway.api.structured``): ``response_format``,
    vLLM's guided fields, strict tools under "auto", or, with ``tool_choice`` "required" or a named
    function, a grammar of
    calls to the declared tools. Raises a 400 naming the param for a bad or unsupported spec."""
    choice, forced = req.tool_choice, None
    if req.tools and (choice == "required" or isinstance(choice, oai.NamedToolChoice)):
        name = choice.function.name if isinstance(choice, oai.NamedToolChoice) else None
        tools = [(t.function.name, t.function.parameters) for t in req.tools]
        forced = tool_call_spec(tools, name, parallel=req.parallel_tool_calls is not False)
    spec = openai_spec(req, forced)
    if spec is None and req.tools and choice in (None, "auto"):
        spec = strict_tools_spec([(t.function.name, t.function.parameters, bool(t.function.strict))
                                  for t in req.tools])
    return spec


def validate_sampling(req: oai.SamplingRequest, model: ModelInfo) -> None:
    """Checks shared by the OpenAI endpoints; raises a 400 (404 for an unknown model) naming the param."""
    if req.model is not None and req.model != model.served_name:
        raise OpenAIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
    if any(not s for s in req.stop_strings):
        raise bad_request("stop: stop strings must be non-empty", param="stop")
    if req.n is not None and not (1 <= req.n <= MAX_N):
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(req, name, None)
        if value is not None and value <= 0:
            raise bad_request(f"{name} must be at least 1, got {value}", param=name)
    if req.temperature is not None and not (0 <= req.temperature < FLOAT32_MAX):
        raise bad_request(f"temperature must be >= 0 (and a float32), got {req.temperature}", param="temperature")
    if req.top_p is not None and not (0 < req.top_p <= 1):
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if req.seed is not None and not (-(2**63) <= req.seed < 2**63):
        raise bad_request("seed must fit in a signed 64-bit integer", param="seed")
    if any(not (0 <= t < 2**31) for t in req.stop_token_ids or []):
        raise bad_request("stop_token_ids must be token ids (0 <= id < 2**31)", param="stop_token_ids")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not (math.isfinite(value) and -2 <= value <= 2):
            raise bad_request(f"{name} must be between -2 and 2, got {value}", param=name)
    if req.repetition_penalty is not None and not (0 < req.repetition_penalty < FLOAT32_MAX):
        raise bad_request(f"repetition_penalty must be > 0 (and a float32), got {req.repetition_penalty}",
                          param="repetition_penalty")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (off) or at least 1, got {req.top_k}", param="top_k")
    if req.min_p is not None and not (0 <= req.min_p <= 1):
        raise bad_request(f"min_p must be in [0, 1], got {req.min_p}", param="min_p")
    if req.min_tokens < 0:
        raise bad_request(f"min_tokens must be >= 0, got {req.min_tokens}", param="min_tokens")
    logit_bias(req, model.vocab_size)


def logit_bias(req: oai.SamplingRequest, vocab_size: int | None) -> dict[int, float]:
    """``logit_bias`` with int keys; 400 for a key that is not a token id or a value outside [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or (vocab_size is not None and token >= vocab_size) or str(token) != key.strip():
            limit = f" (0 <= id < {vocab_size})" if vocab_size is not None else ""
            raise bad_request(f"logit_bias keys must be token ids{limit}, got {key!r}", param="logit_bias")
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise bad_request(f"logit_bias values must be between -100 and 100, got {value}", param="logit_bias")
        out[token] = float(value)
    return out


def sampling_params(req: oai.SamplingRequest, num_prompt_tokens: int, max_model_len: int,
                    logprobs: bool | None = None, top_logprobs: int = 0, prompt_field: str = "messages",
                    default_max_tokens: int | None = None) -> SamplingParams:
    """The request's ``SamplingParams``; raises a 400 ``context_length_exceeded`` when the prompt
    plus the requested tokens does not fit (``common.output_budget``; ``prompt_field``: the
    prompt's request field). ``logprobs``/``top_logprobs`` default to the chat request's fields;
    ``default_max_tokens`` None = all the room left."""
    if logprobs is None:
        logprobs, top_logprobs = bool(req.logprobs), (req.top_logprobs or 0) if req.logprobs else 0
    name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    max_tokens = output_budget(max_model_len, num_prompt_tokens, getattr(req, name), prompt_field, default_max_tokens)
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                          param="min_tokens")
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tokens=max_tokens,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias(req, None),
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        swa_replay=req.swa_replay,
    )


# --- mesh calls ----------------------------------------------------------------


async def tokenize(gw: Gateway, request_id: str, req: oai.ChatCompletionRequest
                   ) -> tuple[list[int], list[list], str]:
    """The chat prompt's token ids from the tokenizer service, its images' [offset, length, hash]
    and their embeddings fingerprint (``common.encode_messages_images``)."""
    tools = [t.to_template() for t in req.tools] if req.tools and req.tool_choice != "none" else None
    return await encode_messages_images(gw, request_id, [m.to_template() for m in req.messages], tools)


# --- responses -------------------------------------------------------------------


async def _collect(reply: _Reply, request: Request) -> dict:
    clean = False
    try:
        async with aclosing(chunks(reply.choices, request.is_disconnected)) as arriving:
            async for c, chunk in arriving:
                raise_if_failed(chunk)
                delta = c.proc.process(chunk)
                text, _ = c.tool_parser.feed(delta.text)
                _end_after_the_one_call(c, delta)
                c.parts.append(text)
                if delta.finish_reason:
                    c.parts.append(c.tool_parser.flush(truncated=delta.finish_reason == "length"))
                c.logprobs += reply.logprobs(chunk) or []
                if delta.finish_reason:
                    await c.stream.abort()  # ended by a stop string, the worker still runs; else a no-op
        clean = True
    except StreamError as e:
        clean = True
        raise http_error(e) from None
    except (OpenAIError, ClientGone):
        clean = True
        raise
    finally:
        if clean:
            await abort_all(reply.choices)
        else:
            for c in reply.choices:
                spawn(c.stream.abort())
        _log_finished(reply)
    want_ids = reply.req.return_token_ids
    choices = [
        oai.choice(c.index, "".join(c.parts), _finish_reason(c),
                   logprobs=c.logprobs if reply.req.logprobs else None,
                   token_ids=c.proc.token_ids if want_ids else None, calls=c.tool_parser.calls)
        for c in reply.choices
    ]
    return oai.chat_completion(reply.id, reply.created, reply.model, choices, reply.usage(),
                               prompt_token_ids=reply.prompt_token_ids if want_ids else None)


async def _sse(reply: _Reply):
    want_ids = reply.req.return_token_ids
    usage_field = reply.req.include_usage
    clean = False
    try:
        for c in reply.choices:
            first = oai.chat_chunk(reply.id, reply.created, reply.model, {"role": "assistant", "content": ""},
                                   index=c.index, with_usage_field=usage_field)
            if want_ids and c.index == 0:
                first["prompt_token_ids"] = reply.prompt_token_ids
            yield _event(first)
        try:
            async with aclosing(chunks(reply.choices)) as arriving:
                async for c, chunk in arriving:
                    failed = failure(chunk)
                    if failed is not None:
                        clean = True
                        yield _event(error_body(failed.message, failed.type, None, failed.code))
                        return
                    delta = c.proc.process(chunk)
                    logprobs = reply.logprobs(chunk)
                    before = len(c.tool_parser.calls)
                    text, calls = c.tool_parser.feed(delta.text)
                    _end_after_the_one_call(c, delta)
                    if delta.finish_reason:
                        text += c.tool_parser.flush(truncated=delta.finish_reason == "length")
                    message = {"content": text} if text else {}
                    if calls:
                        message["tool_calls"] = oai.tool_calls(calls, before, stream=True)
                    if message or delta.finish_reason or (want_ids and delta.token_ids) or logprobs:
                        yield _event(oai.chat_chunk(
                            reply.id, reply.created, reply.model,
                            message,
                            index=c.index,
                            finish_reason=_finish_reason(c) if delta.finish_reason else None,
                            logprobs=logprobs,
                            token_ids=delta.token_ids if want_ids else None,
                            with_usage_field=usage_field,
                        ))
                    if delta.finish_reason:
                        await c.stream.abort()  # ended by a stop string, the worker still runs; else a no-op
        except StreamError as e:
            clean = True
            yield _event(error_body(str(e), "server_error", None, e.code))
            return
        if usage_field:
            yield _event(oai.usage_chunk(reply.id, reply.created, reply.model, reply.usage()))
        clean = True
        yield "data: [DONE]\n\n"
    finally:
        # NOTE: when the client disconnects, Starlette cancels this generator and an
        # await here could be cancelled too, so the abort (or unsubscribe) is its own task.
        for c in reply.choices:
            spawn(c.stream.abort())
        _log_finished(reply, disconnected=not clean)


def _end_after_the_one_call(c: Choice, delta) -> None:
    """``parallel_tool_calls: false``: once the parser has the one call, the choice ends there
    (finish "stop", so ``tool_calls``); the caller then aborts the worker, as for a stop string."""
    if c.tool_parser.done and not delta.finish_reason:
        c.proc.finish_reason = delta.finish_reason = "stop"


def _finish_reason(c: Choice) -> str | None:
    """``tool_calls`` when the model ended its turn after calling tools, else the choice's reason."""
    if c.tool_parser.calls and c.proc.finish_reason == "stop":
        return "tool_calls"
    return c.proc.finish_reason


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _log_finished(reply: _Reply, disconnected: bool = False) -> None:
    log.info(
        "request_finished",
        request_id=reply.request_id,
        prompt_tokens=len(reply.prompt_token_ids),
        completion_tokens=reply.completion_tokens,
        cached_tokens=min(c.proc.num_cached_tokens for c in reply.choices),
        finish_reason=",".join(str(c.proc.finish_reason) for c in reply.choices),
        n=len(reply.choices),
        client_disconnected=disconnected,
        seconds=round(time.monotonic() - reply.started, 3),
    )
