"""structlog set-up: JSON lines (console-pretty on a terminal) with service fields.

Every line carries ``service`` and ``worker_id`` (bound at start-up) plus any
context-bound fields (``request_id``) and the current ``trace_id`` / ``span_id``.
"""

from __future__ import annotations

import logging
import sys

import structlog
from opentelemetry import trace


def _add_trace_ids(_, __, event_dict):
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


def configure_logging(service: str, worker_id: str = "", level: str = "INFO") -> None:
    """Route structlog and stdlib logging to stderr as JSON (pretty on a TTY)."""
    pretty = sys.stderr.isatty()
    renderer = structlog.dev.ConsoleRenderer() if pretty else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, worker_id=worker_id)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def get_logger(name: str | None = None):
    return structlog.get_logger(name)
