"""OpenTelemetry tracing with W3C trace context carried in NATS headers.

``configure_tracing`` installs an SDK TracerProvider so spans get real ids
(a request is one trace across processes); spans are exported only when an
exporter is configured by the standard ``OTEL_*`` variables (issue #10 adds
the OTLP exporter), so by default nothing leaves the process.
"""

from __future__ import annotations

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

_configured = False


def configure_tracing(service: str) -> None:
    """Install the SDK tracer provider once per process (idempotent)."""
    global _configured
    if _configured:
        return
    provider = TracerProvider(resource=Resource.create({"service.name": f"deepinfer-{service}"}))
    trace.set_tracer_provider(provider)
    _configured = True


def tracer():
    return trace.get_tracer("deepinfer")


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Return NATS headers with the current span's ``traceparent`` added."""
    headers = dict(headers or {})
    propagate.inject(headers)
    return headers


def extract_context(headers: dict[str, str] | None) -> context.Context:
    """Trace context from incoming NATS headers (empty context when absent)."""
    return propagate.extract(headers or {})
