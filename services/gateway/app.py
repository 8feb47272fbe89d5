"""FastAPI app: routes, the NATS connection's lifespan, and a root trace span per HTTP request.

Routes: POST /v1/chat/completions (``api/chat.py``), POST /v1/completions
(``api/completions.py``), POST /v1/responses + GET/DELETE /v1/responses/{id}
(``api/responses.py``), POST /v1/messages (``api/messages.py``), POST /tokenize and
POST /detokenize (vLLM's, ``api/tokenize.py``), GET /v1/models,
GET /v1/models/{id}, GET /health (200 when a tokenizer, a prefill and a decode
worker are alive, else 503; the body counts live workers by role), GET /metrics
(Prometheus text format: ``metrics.py``, docs/observability.md). GET /openapi.json describes them,
request bodies included (``describe_request_bodies``).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from deepinfer.gateway import metrics as gateway_metrics
from deepinfer.gateway.api import openai_schema as oai
from deepinfer.gateway.api.messages import CountTokensRequest, MessagesRequest
from deepinfer.gateway.api.messages import add_routes as add_anthropic_routes
from deepinfer.gateway.api.chat import create_chat_completion
from deepinfer.gateway.api.completions import create_completion
from deepinfer.gateway.pipeline.generation import REQUEST_SPAN, Gateway
from deepinfer.gateway.api.limits import BodyLimitMiddleware
from deepinfer.gateway.config import GatewayConfig, ModelInfo, load_model
from deepinfer.gateway.api.errors import OpenAIError, install_error_handlers
from deepinfer.gateway.pipeline.registry import WorkerRegistry
from deepinfer.gateway.api.responses import ResponsesRequest
from deepinfer.gateway.api.responses import add_routes as add_responses_routes
from deepinfer.gateway.api.tokenize import DetokenizeRequest, TokenizeRequest
from deepinfer.gateway.api.tokenize import add_routes as add_tokenize_routes
from deepinfer.mesh import MeshClient
from deepinfer.protocol import PrefillBooked, subjects
from deepinfer.telemetry import extract_context, get_logger, tracer

log = get_logger(__name__)

# POST routes -> the model their JSON body is parsed into (for the OpenAPI spec)
REQUEST_BODIES = {"/v1/chat/completions": oai.ChatCompletionRequest, "/v1/completions": oai.CompletionRequest,
                  "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
                  "/v1/messages/count_tokens": CountTokensRequest, "/tokenize": TokenizeRequest,
                  "/detokenize": DetokenizeRequest}


async def share_bookings(gw: Gateway) -> None:
    """Tell the other gateways each prefill booking this one makes, and count theirs
    (``Router.peer_booked``): gateways sharing workers otherwise learn each other's bookings only
    from the workers' next load reports, and meanwhile send work to the same idle worker."""
    me = gw.config.worker_id

    async def on_booked(msg: PrefillBooked) -> None:
        if msg.gateway_id != me:
            gw.router.peer_booked(msg.worker_id, msg.request_id, msg.seconds, msg.tokens)

    def announce(worker_id: str, request_id: str, seconds: float, tokens: int) -> None:
        msg = PrefillBooked(gateway_id=me, worker_id=worker_id, request_id=request_id, seconds=seconds,
                            tokens=tokens)
        task = asyncio.get_running_loop().create_task(gw.mesh.publish(subjects.ROUTER_BOOKED, msg))
        task.add_done_callback(_log_failure)

    await gw.mesh.subscribe(subjects.ROUTER_BOOKED, on_booked)
    gw.router.on_booked = announce


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("booking_not_shared", error=str(task.exception()))


def create_app(config: GatewayConfig, model: ModelInfo | None = None) -> FastAPI:
    gw = Gateway(
        config=config,
        model=model or load_model(config),
        registry=WorkerRegistry(min_dead_after_s=config.min_dead_after_s),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        gw.mesh = await MeshClient.connect(config.nats_url, name=config.worker_id)
        await gw.registry.start(gw.mesh)
        await share_bookings(gw)
        log.info("gateway_started", model=gw.model.served_name, max_model_len=gw.model.max_model_len,
                 nats=config.nats_url, host=config.host, port=config.port)
        try:
            yield
        finally:
            await gw.registry.stop()
            await gw.mesh.drain()
            log.info("gateway_stopped")

    app = FastAPI(title="DeepInfer gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw
    install_error_handlers(app, oai.field_names())
    app.add_middleware(RootSpanMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    app.add_middleware(gateway_metrics.MetricsMiddleware)  # outermost: counts every answer, 413s included
    metrics_registry = gateway_metrics.gateway_registry(gw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(request, gw)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(request, gw)

    add_responses_routes(app, gw)  # POST /v1/responses, GET / DELETE /v1/responses/{id}
    add_anthropic_routes(app, gw)  # POST /v1/messages, /v1/messages/count_tokens
    add_tokenize_routes(app, gw)  # POST /tokenize, /detokenize
    describe_request_bodies(app, REQUEST_BODIES)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_card(gw)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != gw.model.served_name:
            raise OpenAIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return _card(gw)

    @app.get("/health")
    async def health():
        counts = gw.registry.counts()
        ok = gw.mesh is not None and gw.mesh.nc.is_connected and all(counts.get(r) for r in gw.required_roles)
        body = {"status": "ok" if ok else "unavailable", "workers": counts,
                "kv_index": await _kv_index_health(gw) if gw.mesh is not None else None}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics():  # collected here, on the loop: the collectors read the gateway's state
        return Response(gateway_metrics.exposition(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _kv_index_health(gw: Gateway) -> dict:
    """The prefix-cache index as /health shows it. A missing index or Redis down
    degrades caching only (every lookup is a miss), so it never fails /health."""
    from deepinfer.kvstore import KVIndexClient

    h = await KVIndexClient(gw.mesh, gw.config.worker_id, "").health(timeout=0.5)
    if h is None:
        return {"reachable": False, "redis_ok": None}
    return {"reachable": True, "redis_ok": h.redis_ok, "num_blocks": h.num_blocks, "total_bytes": h.total_bytes,
            "hit_rate": {cls: round(h.hit_rate(cls), 4) for cls in h.hit_stats}}


def describe_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Put each POST route's JSON body schema (``bodies``: path -> request model) into the app's
    OpenAPI spec. The handlers read and validate their bodies themselves (strict pydantic, each
    API's error shape), so FastAPI would otherwise describe them as taking no body."""
    make = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = make()  # FastAPI's spec, kept on app.openapi_schema
            refs, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                            ref_template="#/components/schemas/{model}")
            spec.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            for path, model in bodies.items():
                spec["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}}
        return app.openapi_schema

    app.openapi = openapi


def _card(gw: Gateway) -> dict:
    return oai.model_card(gw.model.served_name, str(gw.model.path), gw.max_model_len)


# GenAI semantic conventions' operation name per API route
GEN_AI_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
                     "/v1/responses": "chat", "/v1/messages": "chat"}


class RootSpanMiddleware:
    """One server span per HTTP request (continuing the client's ``traceparent`` if sent),
    with the GenAI operation name on it.

    FastAPI (0.16x) opens that span itself when a tracer provider is set; this then only
    annotates it. With an older FastAPI it opens the span. Pure ASGI (not
    BaseHTTPMiddleware), so the route, the streaming body and every MeshClient call run
    inside the span and carry its trace context.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        current = trace.get_current_span()
        if current.is_recording() and current.kind is trace.SpanKind.SERVER:  # FastAPI's
            return await self._serve(current, scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        name = f"{scope['method']} {scope['path']}"
        with tracer().start_as_current_span(name, context=extract_context(headers), kind=trace.SpanKind.SERVER,
                                            attributes={"http.request.method": scope["method"],
                                                        "url.path": scope["path"]}) as span:
            await self._serve(span, scope, receive, send, own=True)

    async def _serve(self, span, scope, receive, send, own: bool = False) -> None:
        """Run the app under ``span``; an answer >= 400 is logged (the API handlers log the
        requests they serve) with the request id when the handler had bound one."""
        self._annotate(span, scope)
        token, status = REQUEST_SPAN.set(span), [0]

        async def send_with_status(message):
            if message["type"] == "http.response.start":  # (FastAPI's span ends with the body)
                status[0] = message["status"]
                if own:
                    span.set_attribute("http.response.status_code", status[0])
                request_id = structlog.contextvars.get_contextvars().get("request_id")
                if request_id:  # also on answers the handler refused before generating
                    span.set_attribute("deepinfer.request_id", request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            REQUEST_SPAN.reset(token)
            if status[0] >= 400 and scope["path"] not in ("/health", "/metrics"):
                log.info("request_failed", method=scope["method"], path=scope["path"], status=status[0])

    @staticmethod
    def _annotate(span, scope) -> None:
        if scope["path"] in GEN_AI_OPERATIONS:
            span.set_attributes({"gen_ai.operation.name": GEN_AI_OPERATIONS[scope["path"]],
                                 "gen_ai.provider.name": "deepinfer"})
