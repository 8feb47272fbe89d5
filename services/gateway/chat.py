"""POST /v1/chat/completions: validate, tokenize, submit, then stream SSE or collect JSON.

Everything that can be answered with an HTTP error (validation, tokenizer,
submit, prefill failure before the first token) happens before the response
starts, so SSE bytes are only sent once the first token is in hand. After
that, a failure is an SSE ``data: {"error": {...}}`` event and the stream ends.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

import structlog
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from pydantic import ValidationError

from deepinfer.gateway import openai_schema as oai
from deepinfer.gateway.config import GatewayConfig, ModelInfo
from deepinfer.gateway.errors import OpenAIError, bad_request, error_body, internal, unavailable, validation_error
from deepinfer.gateway.output import OutputProcessor
from deepinfer.gateway.registry import WorkerRegistry
from deepinfer.gateway.stream import ClientGone, RequestStream, StreamError, spawn
from deepinfer.mesh import MeshClient, NoResponders, RemoteError, RequestTimeout
from deepinfer.protocol import EncodeChatReply, EncodeChatRequest, ProtocolError, SamplingParams, TokenChunk, subjects
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

REQUIRED_ROLES = ("tokenizer", "prefill", "decode")
_FIELD_NAMES = oai.field_names()


@dataclass
class Gateway:
    """What a request handler needs: settings, the model, the mesh and the worker registry."""

    config: GatewayConfig
    model: ModelInfo
    registry: WorkerRegistry
    mesh: MeshClient | None = None


@dataclass
class _Reply:
    """One request's response under construction."""

    request_id: str
    model: str
    req: oai.ChatCompletionRequest
    prompt_token_ids: list[int]
    proc: OutputProcessor
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return f"chatcmpl-{self.request_id}"

    def usage(self) -> dict:
        return oai.usage(len(self.prompt_token_ids), len(self.proc.token_ids), self.proc.num_cached_tokens)


async def create_chat_completion(request: Request, gw: Gateway) -> Response:
    req = parse_request(await request.body())
    validate_request(req, gw.model)
    request_id = uuid.uuid4().hex
    structlog.contextvars.bind_contextvars(request_id=request_id)
    trace.get_current_span().set_attribute("deepinfer.request_id", request_id)
    check_workers(gw.registry)
    prompt_ids = await tokenize(gw, request_id, req)
    sampling = sampling_params(req, len(prompt_ids), gw.model.max_model_len)

    stream = RequestStream(gw.mesh, gw.registry, request_id, gw.config.timeouts)
    try:
        await stream.open(prompt_ids, sampling)
        first = await stream.next_chunk(request.is_disconnected)
        _raise_if_failed(first)
    except StreamError as e:
        raise _http_error(e) from None
    except ClientGone:
        return Response(status_code=499)  # nobody is listening any more
    except OpenAIError:
        await stream.abort()
        raise
    except BaseException:
        spawn(stream.abort())
        raise

    proc = OutputProcessor(gw.model.tokenizer, req.stop_strings)
    reply = _Reply(request_id, gw.model.served_name, req, prompt_ids, proc)
    log.info("request_started", prompt_tokens=len(prompt_ids), stream=bool(req.stream), worker=stream.worker_id)
    if req.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id}
        return StreamingResponse(_sse(reply, stream, first), media_type="text/event-stream", headers=headers)
    try:
        body = await _collect(reply, stream, first, request)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(body, headers={"X-Request-Id": request_id})


# --- validation ----------------------------------------------------------------


def parse_request(body: bytes) -> oai.ChatCompletionRequest:
    try:
        return oai.ChatCompletionRequest.model_validate_json(body or b"")
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False), _FIELD_NAMES) from None


def validate_request(req: oai.ChatCompletionRequest, model: ModelInfo) -> None:
    if req.model is not None and req.model != model.served_name:
        raise OpenAIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
    if not req.messages:
        raise bad_request("messages must contain at least one message", param="messages")
    if req.n is not None and req.n != 1:
        raise bad_request("only n=1 is supported", param="n")
    if req.logprobs:
        raise bad_request("logprobs are not supported yet", param="logprobs")
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(req, name)
        if value is not None and value <= 0:
            raise bad_request(f"{name} must be at least 1, got {value}", param=name)
    if req.temperature is not None and not (math.isfinite(req.temperature) and req.temperature >= 0):
        raise bad_request(f"temperature must be >= 0, got {req.temperature}", param="temperature")
    if req.top_p is not None and not (0 < req.top_p <= 1):
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if req.seed is not None and not (-(2**63) <= req.seed < 2**63):
        raise bad_request("seed must fit in a signed 64-bit integer", param="seed")
    if any(not (0 <= t < 2**31) for t in req.stop_token_ids or []):
        raise bad_request("stop_token_ids must be token ids (0 <= id < 2**31)", param="stop_token_ids")


def check_workers(registry: WorkerRegistry) -> None:
    """503 at once when no tokenizer, prefill or decode worker is alive (once the registry has listened long enough)."""
    if not registry.warm:
        return
    counts = registry.counts()
    missing = [role for role in REQUIRED_ROLES if not counts.get(role)]
    if missing:
        raise unavailable(f"no live {' / '.join(missing)} worker")


def sampling_params(req: oai.ChatCompletionRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, "
            f"but the messages have {num_prompt_tokens} tokens.",
            param="messages",
            code="context_length_exceeded",
        )
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = getattr(req, name)
    if requested is not None and requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, {requested} in the "
            "completion). Reduce the length of the messages or the completion.",
            param=name,
            code="context_length_exceeded",
        )
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tokens=room if requested is None else requested,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
    )


# --- mesh calls ----------------------------------------------------------------


async def tokenize(gw: Gateway, request_id: str, req: oai.ChatCompletionRequest) -> list[int]:
    msg = EncodeChatRequest(request_id, [m.to_template() for m in req.messages])
    timeout = gw.config.tokenizer_timeout_s
    try:
        reply = await gw.mesh.request(subjects.TOKENIZER_ENCODE_CHAT, msg, timeout=timeout, expect=EncodeChatReply)
    except NoResponders:
        raise unavailable("no tokenizer worker is running") from None
    except RequestTimeout:
        raise unavailable(f"the tokenizer did not answer within {timeout:.0f}s", code="timeout") from None
    except RemoteError as e:
        if e.kind == "bad_request":
            raise bad_request(str(e), param="messages") from None
        raise internal(f"tokenizer failed: {e}") from None
    except ProtocolError as e:
        raise internal(f"bad reply from the tokenizer: {e}") from None
    if not reply.token_ids:
        raise bad_request("the rendered prompt is empty", param="messages")
    return list(reply.token_ids)


# --- responses -------------------------------------------------------------------


async def _collect(reply: _Reply, stream: RequestStream, chunk: TokenChunk, request: Request) -> dict:
    parts: list[str] = []
    clean = False
    try:
        while True:
            _raise_if_failed(chunk)
            delta = reply.proc.process(chunk)
            parts.append(delta.text)
            if delta.finish_reason:
                await stream.abort()  # ended by a stop string, the worker still runs; else a no-op
                break
            chunk = await stream.next_chunk(request.is_disconnected)
        clean = True
    except StreamError as e:
        clean = True
        raise _http_error(e) from None
    except (OpenAIError, ClientGone):
        clean = True
        raise
    finally:
        if clean:
            await stream.abort()
        else:
            spawn(stream.abort())
        _log_finished(reply)
    return oai.chat_completion(
        reply.id,
        reply.created,
        reply.model,
        "".join(parts),
        reply.proc.finish_reason,
        reply.usage(),
        prompt_token_ids=reply.prompt_token_ids if reply.req.return_token_ids else None,
        token_ids=reply.proc.token_ids if reply.req.return_token_ids else None,
    )


async def _sse(reply: _Reply, stream: RequestStream, chunk: TokenChunk):
    want_ids = reply.req.return_token_ids
    usage_field = reply.req.include_usage
    clean = False
    try:
        first = oai.chat_chunk(reply.id, reply.created, reply.model, {"role": "assistant", "content": ""},
                               with_usage_field=usage_field)
        if want_ids:
            first["prompt_token_ids"] = reply.prompt_token_ids
        yield _event(first)
        while True:
            failure = _failure(chunk)
            if failure is not None:
                clean = True
                yield _event(error_body(failure.message, failure.type, None, failure.code))
                return
            delta = reply.proc.process(chunk)
            if delta.text or delta.finish_reason or (want_ids and delta.token_ids):
                yield _event(oai.chat_chunk(
                    reply.id, reply.created, reply.model,
                    {"content": delta.text} if delta.text else {},
                    finish_reason=delta.finish_reason,
                    token_ids=delta.token_ids if want_ids else None,
                    with_usage_field=usage_field,
                ))
            if delta.finish_reason:
                await stream.abort()  # ended by a stop string, the worker still runs; else a no-op
                if usage_field:
                    yield _event(oai.usage_chunk(reply.id, reply.created, reply.model, reply.usage()))
                clean = True
                yield "data: [DONE]\n\n"
                return
            try:
                chunk = await stream.next_chunk()
            except StreamError as e:
                clean = True
                yield _event(error_body(str(e), "server_error", None, e.code))
                return
    finally:
        # NOTE: when the client disconnects, Starlette cancels this generator and an
        # await here could be cancelled too, so the abort (or unsubscribe) is its own task.
        spawn(stream.abort())
        _log_finished(reply, disconnected=not clean)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _failure(chunk: TokenChunk) -> OpenAIError | None:
    if chunk.finish_reason == "error":
        return internal(f"worker {chunk.worker_id} failed: {chunk.error or 'unknown error'}", code="worker_error")
    if chunk.finish_reason == "abort":
        return unavailable(f"worker {chunk.worker_id} aborted the request: {chunk.error or 'no reason given'}")
    return None


def _raise_if_failed(chunk: TokenChunk) -> None:
    failure = _failure(chunk)
    if failure is not None:
        raise failure


def _http_error(e: StreamError) -> OpenAIError:
    if e.status == 400:
        return bad_request(str(e), code=e.code)
    return OpenAIError(e.status, str(e), "server_error", None, e.code)


def _log_finished(reply: _Reply, disconnected: bool = False) -> None:
    log.info(
        "request_finished",
        request_id=reply.request_id,
        prompt_tokens=len(reply.prompt_token_ids),
        completion_tokens=len(reply.proc.token_ids),
        cached_tokens=reply.proc.num_cached_tokens,
        finish_reason=reply.proc.finish_reason,
        client_disconnected=disconnected,
        seconds=round(time.monotonic() - reply.started, 3),
    )
