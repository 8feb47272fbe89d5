"""structlog set-up: JSON lines (console-pretty on a terminal) with service fields.

Every line carries ``service`` and ``worker_id`` (set at start-up, on every
thread's lines) plus any context-bound fields (``request_id``: bound by the
gateway's API handlers and by ``MeshClient`` around each handler of a message
that names a request) and the current span's ``trace_id`` / ``span_id``.
"""

from __future__ import annotations

import logging
import sys

import structlog
from opentelemetry import trace

_service_fields: dict[str, str] = {}  # service, worker_id: on every line, whichever thread logs it


def _add_service(_, __, event_dict):
    for k, v in _service_fields.items():
        event_dict.setdefault(k, v)
    return event_dict


def _add_trace_ids(_, __, event_dict):
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


class _Stderr:
    """Whatever ``sys.stderr`` is when a line is written, not when logging was configured
    (a configured logger outlives a replaced or closed stream, e.g. under a test runner's capture)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(service: str, worker_id: str = "", level: str = "INFO") -> None:
    """Route structlog and stdlib logging (uvicorn, OpenTelemetry's exporters, any
    library) to stderr as JSON lines with the same fields (pretty on a TTY).

    ``level``: DEBUG, INFO, WARNING, ERROR (an unknown name means INFO). Our own
    loggers log at ``level``; third-party stdlib loggers at WARNING and above,
    except uvicorn's start-up lines at INFO.
    """
    pretty = sys.stderr.isatty()
    renderer = structlog.dev.ConsoleRenderer() if pretty else structlog.processors.JSONRenderer()
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service,
        _add_trace_ids,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=True,
    )
    _service_fields.update(service=service, worker_id=worker_id)
    # stdlib records: the same processors, the logger's name as ``logger``, the message as ``event``
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").setLevel(logging.INFO)  # "Uvicorn running on ..."


def get_logger(name: str | None = None):
    return structlog.get_logger(name)
