"""Typed NATS client: msgpack messages, trace context in headers, timeouts.

Every message on the wire is a ``deepinfer.protocol`` dataclass. Handlers are
wrapped so that each incoming message runs inside a span whose parent is the
sender's ``traceparent`` header (with the message's ``request_id``, when it has
one, on the span and bound into every log line the handler writes), and so that
a handler that raises answers the requester with an ``ErrorReply`` instead of
leaving it to time out.

A message larger than the server's ``max_payload`` (NATS's default: 1 MiB) cannot be sent:
``request`` and ``publish`` raise ``MessageTooLarge`` (the gateway answers 413), and a handler
whose reply is too large answers a ``bad_request`` ``ErrorReply`` saying so instead of leaving the
requester to time out (a reply's size follows from its request, e.g. the ids of a huge prompt).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Awaitable, Callable

import nats
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
import structlog
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind

from deepinfer.protocol import ErrorReply, ProtocolError, pack, unpack
from deepinfer.telemetry import extract_context, get_logger, inject_headers, tracer
from deepinfer.telemetry.metrics import timed_handler, timed_request

log = get_logger(__name__)


class MeshError(RuntimeError):
    """A mesh call failed (base class)."""


class RequestTimeout(MeshError):
    """No reply within the timeout."""


class NoResponders(MeshError):
    """No service is subscribed to the subject (none running, or all dead)."""


class MessageTooLarge(MeshError):
    """The message is larger than the NATS server's ``max_payload``."""

    def __init__(self, subject: str, size: int, limit: int):
        super().__init__(f"a {size}-byte message on {subject} exceeds the mesh's {limit}-byte message limit")
        self.size = size
        self.limit = limit


class RemoteError(MeshError):
    """The remote handler answered with an ``ErrorReply``; ``kind`` says whose fault."""

    def __init__(self, error: str, kind: str = "internal"):
        super().__init__(error)
        self.kind = kind


Handler = Callable[[object], Awaitable[object | None]]


def nats_servers(url: str) -> list[str]:
    """The servers of a NATS URL setting: one URL, or a comma-separated seed list of a cluster's
    servers (``nats://a:4222,nats://b:4222``; nats-py takes a list, not a comma-separated string).
    Raises ValueError for a setting with no URL in it."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no NATS server URL in {url!r}")
    return servers


def stream_replicas() -> int:
    """Replicas of the JetStream streams and key-value buckets the mesh creates:
    ``DEEPINFER_STREAM_REPLICAS`` (``--stream-replicas``), default 1. Raises ValueError for a
    value that is not a positive integer."""
    value = os.environ.get("DEEPINFER_STREAM_REPLICAS", "").strip() or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"DEEPINFER_STREAM_REPLICAS={value!r}: expected a positive integer")
    return int(value)


class MeshClient:
    """One NATS connection. Reconnects forever with a short wait (services outlive NATS restarts);
    with several servers (``nats_servers``) it connects to, and fails over to, any that answers."""

    def __init__(self, nc: nats.NATS):
        self.nc = nc
        self._handler_tasks: set[asyncio.Task] = set()  # handlers of ``concurrent`` subscriptions

    @property
    def reconnects(self) -> int:
        """Times the connection came back after a loss (nats-py's count): what was in flight then
        may be lost (the gateway's streams look for gaps and silence after each, ``gateway/stream/request_stream.py``)."""
        return self.nc.stats["reconnects"]

    @classmethod
    async def connect(cls, url: str, name: str) -> "MeshClient":
        last_error = [-1e9]

        async def on_error(e):  # at most one line per 10 s: an unreachable server fails every 0.5 s
            if time.monotonic() - last_error[0] >= 10:
                last_error[0] = time.monotonic()
                log.warning("nats_error", error=str(e), url=url)

        async def on_disconnect():
            log.warning("nats_disconnected")

        async def on_reconnect():
            log.info("nats_reconnected")

        nc = await nats.connect(
            servers=nats_servers(url),
            name=name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            ping_interval=5,
            max_outstanding_pings=3,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
        return cls(nc)

    async def publish(self, subject: str, msg) -> None:
        """Send ``msg``. Raises MessageTooLarge."""
        data = pack(msg)
        try:
            await self.nc.publish(subject, data, headers=inject_headers())
        except MaxPayloadError:
            raise MessageTooLarge(subject, len(data), self.nc.max_payload) from None

    @timed_request  # deepinfer_nats_request_seconds
    async def request(self, subject: str, msg, timeout: float, expect: type | None = None):
        """Send ``msg`` and wait for the reply message.

        Raises RequestTimeout, NoResponders, RemoteError (the handler failed or
        answered ``ErrorReply``), ProtocolError (an undecodable reply) or MessageTooLarge.
        """
        data = pack(msg)
        try:
            reply = await self.nc.request(subject, data, timeout=timeout, headers=inject_headers())
        except MaxPayloadError:
            raise MessageTooLarge(subject, len(data), self.nc.max_payload) from None
        except NoRespondersError as e:
            raise NoResponders(f"no responders on {subject}") from e
        except (NatsTimeout, asyncio.TimeoutError) as e:
            raise RequestTimeout(f"no reply on {subject} within {timeout:.1f}s") from e
        out = unpack(reply.data)
        if isinstance(out, ErrorReply):
            raise RemoteError(out.error, out.kind)
        if expect is not None and not isinstance(out, expect):
            raise ProtocolError(f"expected {expect.__name__}, got {type(out).__name__}")
        return out

    async def subscribe(self, subject: str, handler: Handler, queue: str = "", span_name: str | None = None,
                        concurrent: bool = False):
        """Run ``handler(message)`` for each message; reply with its return value if asked.

        ``queue``: NATS queue group, so one replica of a service gets each message.
        ``concurrent``: each message's handler runs as its own task, so a slow one (e.g. a
        submit whose KV blocks load from the storage tier) does not hold up the messages
        behind it; by default a subscription's messages are handled one at a time, in order.
        """
        name = span_name or subject
        handler = timed_handler(handler, name)  # deepinfer_nats_handler_seconds

        async def cb(raw):
            token = otel_context.attach(extract_context(raw.headers))
            try:
                with tracer().start_as_current_span(name, kind=SpanKind.CONSUMER) as span:
                    try:
                        msg = unpack(raw.data)
                        request_id = getattr(msg, "request_id", None)
                        if request_id:  # the handler's log lines and span name the request
                            span.set_attribute("deepinfer.request_id", request_id)
                            with structlog.contextvars.bound_contextvars(request_id=request_id):
                                result = await handler(msg)
                        else:
                            result = await handler(msg)
                    except ProtocolError as e:
                        result = ErrorReply(error=str(e), kind="bad_request")
                    except Exception as e:  # reply rather than let the requester time out
                        log.exception("handler_failed", subject=raw.subject)
                        result = ErrorReply(error=f"{type(e).__name__}: {e}")
                    if raw.reply and result is not None:
                        await self._reply(raw, result)
            finally:
                otel_context.detach(token)

        if concurrent:
            run_one = cb

            async def cb(raw):  # noqa: F811 (the subscription's callback starts a task per message)
                task = asyncio.get_running_loop().create_task(run_one(raw))
                self._handler_tasks.add(task)
                task.add_done_callback(self._handler_tasks.discard)

        return await self.nc.subscribe(subject, queue=queue, cb=cb)

    async def _reply(self, raw, result) -> None:
        data = pack(result)
        if len(data) > self.nc.max_payload:  # NOTE: an answer the requester can act on, not a timeout
            log.warning("reply_too_large", subject=raw.subject, bytes=len(data), limit=self.nc.max_payload)
            data = pack(ErrorReply(error=f"the reply ({len(data)} bytes) exceeds the mesh's {self.nc.max_payload}-byte "
                                         "message limit", kind="bad_request"))
        await self.nc.publish(raw.reply, data, headers=inject_headers())

    async def drain(self) -> None:
        """Let subscriptions finish what they hold, then close; just close while NATS is being
        reconnected to (nats-py refuses to drain then, and a stop must not fail on it)."""
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError):
            await self.close()

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()
