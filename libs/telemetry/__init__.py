"""Logging (structlog JSON) and tracing (OpenTelemetry) set-up shared by every service."""

from deepinfer.telemetry.logs import configure_logging, get_logger  # noqa: F401
from deepinfer.telemetry.tracing import (  # noqa: F401
    configure_tracing,
    extract_context,
    inject_headers,
    record_span,
    shutdown_tracing,
    tracer,
)
