"""OpenTelemetry tracing with W3C trace context carried in NATS headers.

Every service installs an SDK ``TracerProvider`` (``configure_tracing``), so spans
get real ids and a request is one trace across processes: ``MeshClient`` injects
the current span's ``traceparent`` into each NATS message's headers and runs each
handler inside a span parented by the sender's.

Export is chosen by the standard OpenTelemetry environment variables:

* ``OTEL_TRACES_EXPORTER``: ``otlp`` (endpoint, headers and timeout from
  ``OTEL_EXPORTER_OTLP_*``; ``OTEL_EXPORTER_OTLP_PROTOCOL`` ``http/protobuf``, the
  default, or ``grpc`` with opentelemetry-exporter-otlp-proto-grpc installed),
  ``console`` (JSON to stdout), ``none``; a comma-separated list for several; an
  unknown name is skipped with a warning. Unset: ``otlp`` when
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set,
  else none. ``OTEL_SDK_DISABLED=true``: none.
* ``OTEL_SERVICE_NAME`` overrides the service name (default ``deepinfer-<role>``);
  ``OTEL_RESOURCE_ATTRIBUTES`` adds resource attributes (the SDK reads both).
* ``DEEPINFER_TRACES_FILE``: ours, also write every span as one JSON line to this
  file (appended; several processes may share it). For tests and offline reading.

With no exporter, spans are not recorded (the ``ALWAYS_OFF`` sampler): they only get
ids, so log lines still carry a request's trace id and the context still propagates;
nothing is stored, serialised or sent. Configure every service alike: a service with
tracing off propagates "not sampled", and the default parent-based sampler of a
service downstream with tracing on then does not record that request either.

Attributes follow the OpenTelemetry GenAI semantic conventions where they apply
(``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.request.max_tokens``,
``gen_ai.usage.input_tokens`` ...) and use the ``deepinfer.`` prefix for ours.
"""

from __future__ import annotations

import json
import os
import threading
import time

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor,
                                            SpanExporter, SpanExportResult)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler

from deepinfer.telemetry.logs import get_logger

log = get_logger(__name__)

_provider: TracerProvider | None = None


class JsonLinesExporter(SpanExporter):
    """Appends each span as one JSON line (name, ids, parent, service, times in ns,
    attributes) to ``path``; lines are written whole, so processes may share the file."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s)) + "\n" for s in spans)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_record(span: ReadableSpan) -> dict:
    """A finished span as a plain dict (``JsonLinesExporter``'s line)."""
    ctx, parent = span.context, span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent is not None else None,
        "service": span.resource.attributes.get("service.name"),
        "worker_id": span.resource.attributes.get("service.instance.id"),
        "pid": os.getpid(),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
    }


def _exporters() -> list[tuple[SpanExporter, bool]]:
    """(exporter, batched) per configured exporter (see the module docstring). A name it
    does not know, or OTLP over gRPC without its package, is skipped with a warning:
    tracing is never a reason for a service not to serve."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = os.environ.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        names = "otlp" if endpoint else "none"
    out: list[tuple[SpanExporter, bool]] = []
    for name in (n.strip().lower() for n in names.split(",")):
        if name in ("", "none"):
            continue
        if name == "otlp":
            protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
            try:
                if protocol == "grpc":
                    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
                else:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                log.warning("otel_exporter_unavailable", protocol=protocol,
                            hint="pip install opentelemetry-exporter-otlp-proto-grpc, or use http/protobuf")
                continue
            out.append((OTLPSpanExporter(), True))
        elif name == "console":
            out.append((ConsoleSpanExporter(), False))
        else:
            log.warning("otel_exporter_unsupported", exporter=name, supported="otlp, console, none")
    path = os.environ.get("DEEPINFER_TRACES_FILE")
    if path:
        out.append((JsonLinesExporter(path), False))
    return out


class _QuietSampler(Sampler):
    """The SDK's default (parent-based, always on) except for health checks and metric
    scrapes: their spans and children are not recorded (a 5 s health check and scrape
    would otherwise be most of the traces)."""

    QUIET = frozenset({"GET /health", "GET /metrics", "kvindex.health", "balancer.status"})
    QUIET_PATHS = frozenset({"/health", "/metrics"})  # FastAPI names its server span "GET" at first

    def __init__(self):
        self._default = ParentBased(ALWAYS_ON)

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None):
        if name in self.QUIET or (attributes or {}).get("url.path") in self.QUIET_PATHS:
            return ALWAYS_OFF.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        return self._default.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return "DeepInferQuietSampler"


def configure_tracing(service: str, worker_id: str = "") -> None:
    """Install the SDK tracer provider and the configured exporters, once per process."""
    global _provider
    if _provider is not None:
        return
    attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"deepinfer-{service}",
             "service.namespace": "deepinfer"}
    if worker_id:
        attrs["service.instance.id"] = worker_id
    exporters = _exporters()
    # nothing to export: spans are not recorded (ALWAYS_OFF), only their ids made, for log lines
    # and propagation (13.7 against 29 us a span with a recording one on this CPU)
    provider = TracerProvider(resource=Resource.create(attrs), sampler=_QuietSampler() if exporters else ALWAYS_OFF)
    for exporter, batched in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter) if batched else SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider


def shutdown_tracing() -> None:
    """Flush and stop the exporters (a service calls it when it stops)."""
    if _provider is not None:
        _provider.shutdown()


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


def epoch_ns(perf_counter_s: float) -> int:
    """Wall-clock ns of a ``time.perf_counter()`` reading (span times recorded after the fact)."""
    return time.time_ns() - int((time.perf_counter() - perf_counter_s) * 1e9)


def record_span(name: str, start_s: float, end_s: float, parent: context.Context | None,
                attributes: dict | None = None) -> None:
    """A span for work timed elsewhere (e.g. on the engine thread): ``start_s`` / ``end_s``
    are ``time.perf_counter()`` readings; ``parent`` is the context it belongs under."""
    span = tracer().start_span(name, context=parent, start_time=epoch_ns(start_s), attributes=attributes)
    span.end(end_time=epoch_ns(end_s))
