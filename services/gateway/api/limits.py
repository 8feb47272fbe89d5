"""Request body size limit: 413 in the API's own error shape, before the body is read whole.

Pure ASGI middleware: a declared ``Content-Length`` over the limit is refused at
once; a chunked body is counted as it arrives and refused when it passes the
limit (the handler never sees it). Anthropic's path (``/v1/messages``) gets
Anthropic's error shape, every other path OpenAI's.
"""

from __future__ import annotations

import json

DEFAULT_MAX_BODY_BYTES = 32 << 20  # 32 MiB


class BodyTooLarge(Exception):
    pass


def error_response_body(path: str, message: str) -> bytes:
    if path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": "request_too_large", "message": message}}
    else:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": "request_too_large"}}
    return json.dumps(body).encode()


class BodyLimitMiddleware:
    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        message = f"request body exceeds the limit of {limit} bytes"
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, send, message)
        seen = 0
        started = False

        async def counting_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(scope, send, message)

    @staticmethod
    async def _refuse(scope, send, message: str) -> None:
        body = error_response_body(scope.get("path", ""), message)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
