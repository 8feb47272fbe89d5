"""The gateway's Prometheus metrics: what feeds the instruments of ``deepinfer.telemetry.metrics``.

* ``MetricsMiddleware`` (pure ASGI): every HTTP request counted by endpoint and status
  (``deepinfer_http_requests_total``); a generation request answered 2xx/3xx observes
  ``deepinfer_e2e_request_latency_seconds`` when its last byte is sent (streams too). It
  records the request's arrival, the start of its time to first token.
* ``on_chunk`` / ``on_finished`` (called by ``pipeline.generation``): time to first token, inter-token
  latency, generated and prompt tokens, and each choice's finish reason.
* ``GatewayCollector``: read at each scrape of ``GET /metrics`` (on the event loop): streams
  in flight and waiting for their first token (the admission's queue), admission refusals
  by reason, live workers by role.

Endpoint labels are fixed names (``ENDPOINTS``), never raw paths, so ids in paths add no series.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepinfer.telemetry import metrics as m

ENDPOINTS = {
    ("POST", "/v1/chat/completions"): "chat_completions",
    ("POST", "/v1/completions"): "completions",
    ("POST", "/v1/responses"): "responses",
    ("POST", "/v1/messages"): "messages",
    ("POST", "/v1/messages/count_tokens"): "count_tokens",
    ("GET", "/v1/models"): "models",
    ("GET", "/health"): "health",
    ("GET", "/metrics"): "metrics",
}
GENERATION = frozenset({"chat_completions", "completions", "responses", "messages"})


def endpoint_label(method: str, path: str) -> str:
    label = ENDPOINTS.get((method, path))
    if label is not None:
        return label
    if path.startswith("/v1/responses/"):
        return "responses_stored"  # GET / DELETE /v1/responses/{id}
    if path.startswith("/v1/models/"):
        return "models"
    return "other"


@dataclass
class _Request:
    endpoint: str
    arrived: float


_current: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("deepinfer_http_request", default=None)


class MetricsMiddleware:
    """Counts every HTTP request by endpoint and status; times generation requests end to end."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        req = _Request(endpoint_label(scope["method"], scope["path"]), time.monotonic())
        token = _current.set(req)
        status = 500  # no response started: the app raised

        async def send_with_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            _current.reset(token)
            m.HTTP_REQUESTS.labels(req.endpoint, str(status)).inc()
            if req.endpoint in GENERATION and status < 400:
                m.E2E_REQUEST_LATENCY.labels(req.endpoint).observe(time.monotonic() - req.arrived)


# --- per choice -----------------------------------------------------------------------------
def _now_request() -> _Request:
    return _current.get() or _Request("other", time.monotonic())


@dataclass
class ChoiceTiming:
    """A choice's metric state (``pipeline.generation.Choice.timing``): created in the request's context."""

    request: _Request = field(default_factory=_now_request)
    last_token_at: float = 0.0  # monotonic time of its latest token (0: none yet)
    worker_finish: str | None = None  # "error" / "abort" chunk from a worker
    counted: bool = False


def on_chunk(choice, chunk) -> None:
    """A chunk of ``choice`` arrived (first chunks when they arrive, not when yielded)."""
    t: ChoiceTiming = choice.timing
    if chunk.finish_reason in ("error", "abort"):
        t.worker_finish = chunk.finish_reason
    n = len(chunk.token_ids)
    if not n:
        return
    now, endpoint = time.monotonic(), t.request.endpoint
    m.GENERATION_TOKENS.labels(endpoint).inc(n)
    if not t.last_token_at:
        m.TIME_TO_FIRST_TOKEN.labels(endpoint).observe(now - t.request.arrived)
        cls = choice.stream.traffic_class or "chat"
        m.PROMPT_TOKENS.labels(cls).inc(chunk.num_prompt_tokens)
        m.PROMPT_CACHED_TOKENS.labels(cls).inc(chunk.num_cached_tokens)
    else:
        itl = m.INTER_TOKEN_LATENCY.labels(endpoint)
        gap = (now - t.last_token_at) / n
        for _ in range(n):
            itl.observe(gap)
    t.last_token_at = now


def on_finished(choices) -> None:
    """The choices' stream ended (finished, failed or abandoned): count each one's finish reason once."""
    for c in choices:
        t: ChoiceTiming = c.timing
        if t.counted:
            continue
        t.counted = True
        reason = c.proc.finish_reason or t.worker_finish or "incomplete"
        m.REQUESTS_FINISHED.labels(t.request.endpoint, reason).inc()


# --- read at scrape time -----------------------------------------------------------------------
class GatewayCollector:
    """Admission and registry state of one gateway (``Gateway``), read on the event loop."""

    def __init__(self, gw):
        self.gw = gw

    def describe(self):
        return []

    def collect(self):
        gw = self.gw
        yield GaugeMetricFamily("deepinfer_gateway_requests_running",
                                "Generation streams in flight (admitted, not finished; n choices count n)",
                                value=gw.admission.inflight())
        yield GaugeMetricFamily("deepinfer_gateway_admission_queue_depth",
                                "Admitted streams still waiting for their first token (submitting or in prefill)",
                                value=gw.admission.waiting())
        rejected = CounterMetricFamily("deepinfer_gateway_admission_rejected_total",
                                       "Requests answered 429 by admission, by reason", labels=["reason"])
        for reason, n in sorted(gw.admission.rejected.items()):
            rejected.add_metric([reason], n)
        yield rejected
        workers = GaugeMetricFamily("deepinfer_gateway_workers", "Live workers by role (heartbeats)",
                                    labels=["role"])
        counts = {role: 0 for role in gw.required_roles}  # a required role with none alive reads 0, not absent
        counts.update(gw.registry.counts())
        for role, n in sorted(counts.items()):
            workers.add_metric([role], n)
        yield workers


def gateway_registry(gw) -> CollectorRegistry:
    """A registry of ``gw``'s own state (one per app: tests build many apps in one process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(gw))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """``GET /metrics``: the process's instruments, then the gateway's state."""
    return m.exposition(m.REGISTRY, registry)
