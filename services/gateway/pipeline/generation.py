"""The gateway's one generation pipeline: every API (chat, completions, responses, Anthropic
messages) is an adapter around it.

An API module parses its body into its own request model and validates it; then, the same for all:
``start_request`` (request id, live workers or 503, traffic class), the tokenizer service
(``api.common.encode_messages_images``; completions may send ids), ``output_budget`` with the one
context-length error (``api.errors.context_length_exceeded``), ``SamplingParams``, ``new_choices`` and
``open_choices``; the API renders the chunks in its wire format and ``respond`` sends them as SSE
or JSON.

An API handler turns its request into a prompt (token ids), ``SamplingParams``
and ``n``; ``open_choices`` submits the n choices (one ``RequestStream`` and
``OutputProcessor`` each: ids ``<id>-0`` .. ``<id>-<n-1>``, seeds
``seed + i``) and waits until every one has its first token, so errors can
still be HTTP errors (``open_prompts``: several prompts' choices at once, the
legacy completions' list of prompts); ``chunks`` then yields ``(choice, chunk)`` as they
arrive. Errors are ``OpenAIError`` (status, message, type, code); each API
renders them in its own shape.

Before anything is submitted, ``admit`` routes and admits the choices (``router``: a
ranked plan of prefill workers and a decode worker per choice; ``admission``: 429 with
Retry-After past the in-flight limit, the per-worker queue limit or the TTFT SLO), so
every API surface gets routing and admission the same way.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

import structlog
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace

from deepinfer.gateway.api import logprobs as lp
from deepinfer.gateway import metrics as gateway_metrics
from deepinfer.gateway.pipeline.admission import Admission, rate_limited
from deepinfer.gateway.config import GatewayConfig, ModelInfo
from deepinfer.gateway.api.errors import OpenAIError, bad_request, internal, unavailable
from deepinfer.gateway.stream.output import OutputProcessor
from deepinfer.gateway.pipeline.registry import WorkerRegistry
from deepinfer.gateway.pipeline.router import Plan, Router
from deepinfer.gateway.stream.request_stream import ClientGone, RequestStream, StreamError, spawn
from deepinfer.gateway.api.tools import ToolCallParser
from deepinfer.mesh import MeshClient
from deepinfer.protocol import SamplingParams, TokenChunk
from deepinfer.telemetry import get_logger, tracer

log = get_logger(__name__)

# the roles that must have a live worker for requests to be served, by serving mode
REQUIRED_ROLES = {"disagg": ("tokenizer", "prefill", "decode"), "agg": ("tokenizer", "decode")}
# the HTTP request's server span (set by ``app.RootSpanMiddleware``): usage attributes go on it
REQUEST_SPAN: contextvars.ContextVar[trace.Span | None] = contextvars.ContextVar("request_span", default=None)


@dataclass
class Gateway:
    """What a request handler needs: settings, the model, the mesh and the worker registry."""

    config: GatewayConfig
    model: ModelInfo
    registry: WorkerRegistry
    mesh: MeshClient | None = None
    token_bytes: lp.TokenBytes | None = None
    router: Router | None = None
    admission: Admission | None = None

    def __post_init__(self):
        if self.token_bytes is None:
            self.token_bytes = lp.TokenBytes(self.model.tokenizer)
        if self.router is None:
            self.router = Router(self.registry, self.config.routing)
        if self.admission is None:
            self.admission = Admission(self.config.admission)
        self._kv_index = None

    @property
    def required_roles(self) -> tuple[str, ...]:
        return REQUIRED_ROLES[self.config.mode]

    @property
    def max_model_len(self) -> int:
        """The context requests are held to, in tokens (prompt + completion): the model's
        (``--max-model-len``, else config.json), or less where a live worker that runs prompts
        reports a smaller ``LoadReport.max_model_len`` (its own ``--max-model-len``, or a KV
        cache that holds fewer tokens)."""
        limits = [w.report.max_model_len for role in self.required_roles if role != "tokenizer"
                  for w in self.registry.alive(role) if w.report.max_model_len > 0]
        return min([self.model.max_model_len, *limits])

    def kv_index(self):
        """The kvindex client for prefix lookups (None before the mesh is connected)."""
        if self._kv_index is None and self.mesh is not None:
            from deepinfer.kvstore import KVIndexClient

            self._kv_index = KVIndexClient(self.mesh, self.config.worker_id, "")
        return self._kv_index




@dataclass
class Choice:
    """One of the ``n`` requests behind a completion: its stream, text and logprobs so far."""

    index: int
    stream: RequestStream
    proc: OutputProcessor
    first: TokenChunk | None = None
    parts: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    timing: gateway_metrics.ChoiceTiming = field(default_factory=gateway_metrics.ChoiceTiming)  # TTFT, ITL, finish
    # tool calls split out of the text (off unless the API request offered tools)
    tool_parser: ToolCallParser = field(default_factory=lambda: ToolCallParser(enabled=False))
    gateway: "Gateway | None" = None  # for routing and admission (None: queue group, no limits)
    span: trace.Span | None = None  # the request's span (set by ``open_choices``; usage goes on it)

    @property
    def done(self) -> bool:
        return self.proc.finish_reason is not None




def check_workers(registry: WorkerRegistry, roles: tuple[str, ...] = REQUIRED_ROLES["disagg"]) -> None:
    """503 at once when no worker of one of ``roles`` (``Gateway.required_roles``) is alive (once the
    registry has listened long enough)."""
    if not registry.warm:
        return
    counts = registry.counts()
    missing = [role for role in roles if not counts.get(role)]
    if missing:
        raise unavailable(f"no live {' / '.join(missing)} worker")




TRAFFIC_CLASS_HEADER = "X-Traffic-Class"
SALT_MAX_CHARS = 256


def request_traffic_class(req, header: str | None, allowed: tuple[str, ...]) -> str:
    """The request's storage-tier class: its ``traffic_class`` field, else the header, else "chat".
    ``req``: any API's parsed request (``traffic_class``, ``cache_salt``). Raises a 400 for a class
    the gateway does not know or a too-long ``cache_salt``."""
    cls = req.traffic_class or header or "chat"
    if cls not in allowed:
        raise bad_request(f"unknown traffic class {cls!r}; expected one of {', '.join(allowed)}",
                          param="traffic_class")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= SALT_MAX_CHARS:
        raise bad_request(f"cache_salt must be 1-{SALT_MAX_CHARS} characters", param="cache_salt")
    return cls


def start_request(request: Request, gw: Gateway, req) -> tuple[str, str]:
    """Begin one generation request of any API, once its body is parsed and valid: a fresh request
    id, bound to the logs and set on the HTTP request's span; a 503 when a serving role has no live
    worker (``check_workers``); its traffic class (``request_traffic_class``: 400). Returns
    (request id, traffic class)."""
    request_id = uuid.uuid4().hex
    structlog.contextvars.bind_contextvars(request_id=request_id)
    trace.get_current_span().set_attribute("deepinfer.request_id", request_id)
    check_workers(gw.registry, gw.required_roles)
    return request_id, request_traffic_class(req, request.headers.get(TRAFFIC_CLASS_HEADER),
                                             gw.config.traffic_classes)


async def respond(request: Request, stream: bool, sse, collect, headers: dict[str, str]) -> Response:
    """The reply of an API in its wire format: with ``stream``, an SSE response of ``sse`` (an async
    iterator of encoded events); else the JSON body built by ``collect(request)``, or 499 when the
    client left before it was complete. ``headers``: the API's response headers (request ids)."""
    if stream:
        return StreamingResponse(sse, media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        body = await collect(request)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(body, headers=headers)


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: its own seed (``seed + index``, wrapped to int64) when seeded."""
    if sampling.seed is None or index == 0:
        return sampling
    seed = (sampling.seed + index + 2**63) % 2**64 - 2**63
    return dataclasses.replace(sampling, seed=seed)




async def open_choices(choices: list[Choice], prompt_ids: list[int], sampling: SamplingParams, is_disconnected) -> None:
    """Submit every choice and wait for every first token; on any failure abort them all and raise.

    NOTE: submits are not cancelled midway (a worker may have accepted one
    whose reply we would never read, and it could not be aborted); each is
    bounded by the submit timeout. Waits for a first token are cancelled.
    Raises a 429 ``OpenAIError`` (``admit``) before submitting anything.
    """
    span = REQUEST_SPAN.get() or trace.get_current_span()
    gw = choices[0].gateway if choices else None
    span.set_attributes({
        "gen_ai.request.model": gw.model.served_name if gw else "",
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.choice.count": len(choices),
        "gen_ai.usage.input_tokens": len(prompt_ids),
        "deepinfer.request_id": choices[0].stream.request_id if choices else "",
        "deepinfer.traffic_class": choices[0].stream.traffic_class if choices else "",
    })
    for c in choices:
        c.span = span
    check_wire_ints(sampling)
    with tracer().start_as_current_span("gateway.admission"):
        plans = await admit(choices, prompt_ids, sampling)
    try:
        submits = await asyncio.gather(
            *(c.stream.open(prompt_ids, choice_sampling(sampling, c.index), plan) for c, plan in zip(choices, plans)),
            return_exceptions=True,
        )
    except BaseException:  # cancelled
        release(plans)
        for c in choices:
            spawn(c.stream.abort())
        raise
    failed = next((e for e in submits if isinstance(e, BaseException)), None)
    if failed is not None:
        release(plans)
        await abort_all(choices)
        if isinstance(failed, StreamError):
            if failed.status == 429 and gw is not None:
                gw.admission.count_rejected(failed.code)
            raise http_error(failed) from None
        raise failed

    async def first(c: Choice, plan: Plan | None) -> None:
        try:
            c.first = await c.stream.next_chunk(is_disconnected)
            while not c.first.token_ids and c.first.finish_reason is None:  # a worker announcing itself
                c.first = await c.stream.next_chunk(is_disconnected)
            gateway_metrics.on_chunk(c, c.first)
        except BaseException:
            release([plan])
            raise
        release([plan], arrived=c.first.finish_reason not in ("error", "abort"))
        raise_if_failed(c.first)

    tasks = [asyncio.ensure_future(first(c, plan)) for c, plan in zip(choices, plans)]
    try:
        await asyncio.gather(*tasks)
    except BaseException as e:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(e, (OpenAIError, StreamError, ClientGone)):
            await abort_all(choices)
        else:  # cancelled: an await here could be cancelled too
            for c in choices:
                spawn(c.stream.abort())
        if isinstance(e, StreamError):
            raise http_error(e) from None
        raise


async def open_prompts(groups: list[tuple[list[Choice], list[int], SamplingParams]], is_disconnected) -> None:
    """``open_choices`` for several prompts at once (``groups``: each prompt's choices, token ids and
    parameters); if any group fails, every choice of every group is aborted and its error raised."""
    opened = [open_choices(choices, ids, sampling, is_disconnected) for choices, ids, sampling in groups]
    everyone = [c for choices, _, _ in groups for c in choices]
    try:
        results = await asyncio.gather(*opened, return_exceptions=True)
    except BaseException:  # cancelled: an await here could be cancelled too
        for c in everyone:
            spawn(c.stream.abort())
        raise
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        await abort_all(everyone)
        raise failed


async def admit(choices: list[Choice], prompt_ids: list[int], sampling: SamplingParams) -> list[Plan | None]:
    """Count the choices in flight, route each (``Router.plan``), hold it to the limits
    (``Admission.check``) and book it (``Router.commit``). Raises a 429 ``OpenAIError``; then
    nothing stays booked or counted. Choices without a gateway get no plan (the queue group)."""
    gw = choices[0].gateway if choices else None
    if gw is None:
        return [None] * len(choices)
    streams = [c.stream for c in choices]
    gw.admission.enter(streams)
    plans: list[Plan] = []
    # NOTE: TTFT runs from the request's receipt; parsing, tokenizing and image encoding before
    # routing took ``waited`` of it already, which the workers' predictions do not see
    waited = max(0.0, time.monotonic() - choices[0].timing.request.arrived)
    started = gw.router.clock() - waited
    try:
        predicted = gw.router.config.prefill_policy in ("predicted", "dynamo")
        first = choices[0].stream
        shape = await gw.router.shape(gw.kv_index() if predicted or gw.admission.config.needs_prediction else None,
                                      prompt_ids, first.traffic_class, first.cache_salt, sampling.max_tokens,
                                      images=first.images)
        for c in choices:
            plan = gw.router.plan(c.stream.request_id, shape)
            plan.waited_s = waited
            gw.admission.check(plan)
            gw.admission.check_decode(plan)
            gw.router.commit(plan, gw.admission.config.ttft_slo_s, started_at=started)
            plans.append(plan)
            log.debug("routed", request_id=plan.request_id, prompt_tokens=shape.num_tokens,
                      cached_tokens=shape.cached_tokens, predicted_ttft_s=plan.predicted_ttft_s,
                      ranked=[(c.worker_id, round(c.finish_s, 3), round(c.queue_s, 3)) for c in plan.candidates[:4]],
                      decode=plan.decode_worker)
    except BaseException:
        gw.admission.leave(streams)
        for plan in plans:
            gw.router.forget(plan)
        raise
    return plans


def release(plans: list[Plan | None], arrived: bool = False) -> None:
    """The plans' requests have their first token (``arrived``) or failed: no deadline to protect any more."""
    for plan in plans:
        if plan is not None and plan.router is not None:
            plan.router.first_token(plan, arrived)


async def abort_all(choices: list[Choice]) -> None:
    await asyncio.gather(*(c.stream.abort() for c in choices), return_exceptions=True)


async def chunks(choices: list[Choice], is_disconnected=None):
    """Yield ``(choice, chunk)`` from every choice as chunks arrive, first chunks first, until all are done.

    The consumer processes each chunk before the next is read (so ``choice.done``
    is current). A ``StreamError`` or ``ClientGone`` of any choice propagates.
    """
    # the streaming phase, in which the gateway detokenizes each chunk as it arrives (``OutputProcessor``)
    span = tracer().start_span("gateway.detokenize", context=trace.set_span_in_context(choices[0].span)
                               if choices and choices[0].span else None)
    try:
        async with aclosing(_chunks(choices, is_disconnected)) as inner:  # its cleanup runs now, not at GC
            async for item in inner:
                yield item
    finally:
        span.set_attribute("gen_ai.usage.output_tokens", sum(len(c.proc.token_ids) for c in choices))
        span.end()
        _annotate_usage(choices)


def _annotate_usage(choices: list[Choice]) -> None:
    """The request span's usage attributes (GenAI semantic conventions, plus ours)."""
    if not choices or choices[0].span is None:
        return
    choices[0].span.set_attributes({
        "gen_ai.usage.output_tokens": sum(len(c.proc.token_ids) for c in choices),
        "gen_ai.response.finish_reasons": [str(c.proc.finish_reason) for c in choices],
        "deepinfer.cached_tokens": min(c.proc.num_cached_tokens for c in choices),
        "deepinfer.worker_id": sorted({c.stream.worker_id for c in choices if c.stream.worker_id}),
    })


async def _chunks(choices: list[Choice], is_disconnected=None):
    for c in choices:
        yield c, c.first
    pending: dict[asyncio.Future, Choice] = {}

    def arm(c: Choice) -> None:
        task = asyncio.ensure_future(c.stream.next_chunk(is_disconnected))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "exception never retrieved"
        pending[task] = c

    for c in choices:
        if not c.done:
            arm(c)
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t].index):
                c = pending.pop(task)
                chunk = task.result()
                gateway_metrics.on_chunk(c, chunk)
                yield c, chunk
                if not c.done:
                    arm(c)
    finally:
        for task in pending:
            task.cancel()
        gateway_metrics.on_finished(choices)




def failure(chunk: TokenChunk) -> OpenAIError | None:
    if chunk.finish_reason == "error":
        return internal(f"worker {chunk.worker_id} failed: {chunk.error or 'unknown error'}", code="worker_error")
    if chunk.finish_reason == "abort":
        return unavailable(f"worker {chunk.worker_id} aborted the request: {chunk.error or 'no reason given'}")
    return None


def raise_if_failed(chunk: TokenChunk) -> None:
    failed = failure(chunk)
    if failed is not None:
        raise failed


def http_error(e: StreamError) -> OpenAIError:
    if e.status == 429:
        return rate_limited(str(e), e.code, e.retry_after_s)
    if e.status < 500:
        return OpenAIError(e.status, str(e), "invalid_request_error", None, e.code)
    return OpenAIError(e.status, str(e), "server_error", None, e.code)


WIRE_INTS = (-(2**63), 2**64)  # integers msgpack carries: int64 and uint64


def check_wire_ints(sampling: SamplingParams) -> None:
    """400 naming the field when ``sampling`` holds an integer the wire cannot carry (msgpack's
    64 bits; anywhere: lists, dict keys, a structured-output schema). Each API checks its own
    ranges first; this is the backstop for what one leaves open (an Anthropic ``top_k`` of 2**64
    failed the pack: a 500)."""
    lo, hi = WIRE_INTS

    def fits(v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, list, tuple, dict)):
            return True
        if isinstance(v, int):
            return lo <= v < hi
        if isinstance(v, dict):
            return all(fits(k) and fits(x) for k, x in v.items())
        return all(fits(x) for x in v)

    for f in dataclasses.fields(sampling):
        if not fits(getattr(sampling, f.name)):
            raise bad_request(f"{f.name}: an integer is out of range (at most 64 bits)", param=f.name)




def new_choices(gw: "Gateway", request_id: str, n: int, stop: list[str], traffic_class: str = "chat",
                cache_salt: str | None = None, images: list[list] | None = None,
                embeddings_fingerprint: str = "") -> list[Choice]:
    """``n`` choices of one request, not submitted yet (images: the prompt's, ``EncodeChatReply.images``)."""
    return [
        Choice(i, RequestStream(gw.mesh, gw.registry, request_id if n == 1 else f"{request_id}-{i}",
                                gw.config.timeouts, traffic_class=traffic_class, cache_salt=cache_salt,
                                images=images, embeddings_fingerprint=embeddings_fingerprint, mode=gw.config.mode,
                                router=gw.router),
               OutputProcessor(gw.model.tokenizer, stop), gateway=gw)
        for i in range(n)
    ]


def usage_counts(choices: list[Choice], num_prompt_tokens: int) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens, cached prompt tokens) of a request.

    NOTE: the prompt is counted once however many choices; its cached part is
    what every choice found cached (each choice ran its own prefill).
    """
    completion = sum(len(c.proc.token_ids) for c in choices)
    return num_prompt_tokens, completion, min(c.proc.num_cached_tokens for c in choices)
