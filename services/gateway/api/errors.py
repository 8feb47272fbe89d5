"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Handlers replace FastAPI's defaults (422 validation bodies, ``{"detail": ...}``
for 404/405, plain-text 500s) so a client only ever sees the OpenAI shape.
"""

from __future__ import annotations

from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.mesh import MessageTooLarge, NoResponders, RemoteError, RequestTimeout
from deepinfer.protocol import ProtocolError
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


class OpenAIError(Exception):
    """An error answered to the client as ``status`` with the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # extra response headers (429: Retry-After)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


class ContextLengthExceeded(OpenAIError):
    """400 ``context_length_exceeded``: the prompt plus the completion asked for does not fit the
    model's context. ``max_model_len``, ``prompt_tokens``, ``completion_tokens``: the numbers (tokens;
    ``exact`` False: the prompt is only known to be longer than ``prompt_tokens``). ``message`` is
    OpenAI's wording, ``anthropic_message`` Anthropic's; ``context_length_exceeded`` builds it."""

    def __init__(self, max_model_len: int, prompt_tokens: int, completion_tokens: int, field: str,
                 exact: bool = True):
        more = "" if exact else "more than "
        message = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{more}{prompt_tokens + completion_tokens} tokens ({more}{prompt_tokens} in the {field}, "
                   f"{completion_tokens} in the completion). Please reduce the length of the {field} or completion.")
        super().__init__(400, message, "invalid_request_error", field, "context_length_exceeded")
        self.max_model_len, self.prompt_tokens, self.completion_tokens = max_model_len, prompt_tokens, completion_tokens

    @property
    def anthropic_message(self) -> str:
        if self.prompt_tokens > self.max_model_len:
            return f"prompt is too long: {self.prompt_tokens} tokens > {self.max_model_len} maximum"
        return (f"input length and `max_tokens` exceed context limit: {self.prompt_tokens} + "
                f"{self.completion_tokens} > {self.max_model_len}, decrease input length or `max_tokens` and try again")


def context_length_exceeded(max_model_len: int, prompt_tokens: int, completion_tokens: int, field: str,
                            exact: bool = True) -> ContextLengthExceeded:
    """The one context-length error of every API: ``field`` names the prompt's request field
    ("messages", "prompt", "input"): it is the error's ``param`` and the message's word for the
    prompt. ``completion_tokens``: what the request asked for (at least one token)."""
    return ContextLengthExceeded(max_model_len, prompt_tokens, completion_tokens, field, exact)


def unavailable(message: str, code: str = "service_unavailable") -> OpenAIError:
    return OpenAIError(503, message, "server_error", None, code)


def internal(message: str, code: str = "internal_error") -> OpenAIError:
    return OpenAIError(500, message, "server_error", None, code)


def too_large(e: MessageTooLarge, param: str | None = None) -> OpenAIError:
    """413 for a request whose message to a mesh service would not fit in one NATS message."""
    return OpenAIError(413, f"the request is too large for the mesh ({e.size} bytes to send, at most {e.limit}); "
                            "send a shorter prompt", "invalid_request_error", param, "request_too_large")


@contextmanager
def mesh_errors(role: str, name: str, timeout: float, param: str | None = None, code: str | None = None):
    """A request to a mesh service (``role``'s workers, called ``name`` in messages) whose failures
    become HTTP errors: no worker running, or no answer within ``timeout`` -> 503; the service's
    ``bad_request`` -> 400 with its message (``param``, ``code``); its other errors or a bad reply -> 500;
    a request too large to send -> 413."""
    try:
        yield
    except MessageTooLarge as e:
        raise too_large(e, param) from None
    except NoResponders:
        raise unavailable(f"no {role} worker is running") from None
    except RequestTimeout:
        raise unavailable(f"the {name} did not answer within {timeout:.0f}s", code="timeout") from None
    except RemoteError as e:
        if e.kind == "bad_request":
            raise bad_request(str(e), param=param, code=code) from None
        raise internal(f"{name} failed: {e}") from None
    except ProtocolError as e:
        raise internal(f"bad reply from the {name}: {e}") from None


_NO_BODY = object()


def validation_error(errors: list[dict], field_names: set[str], body=_NO_BODY, dotted: bool = False) -> OpenAIError:
    """400 for the most specific pydantic error, ``param`` naming the field as the client sent it
    (``messages[0].content``; ``dotted``: ``messages.0.content``, Anthropic's form). ``body`` (the
    parsed JSON) tells the client's keys from the union-member tags pydantic puts in an error's
    location; without it, only names in ``field_names`` are kept. A field the model does not declare
    (``extra="forbid"``) is named as sent."""
    if not errors:
        return bad_request("invalid request body")
    # NOTE: a union field fails once per member; the deepest location is the member that came closest.
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    if err.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
    loc = tuple(err.get("loc", ()))
    if err.get("type") in ("extra_forbidden", "missing"):  # the last part is the field, sent or not
        where = _param_from_loc(loc[:-1], field_names, body, dotted)
        param = f"{where}.{loc[-1]}" if where else str(loc[-1])
        if err["type"] == "extra_forbidden":
            return bad_request(f"{param}: unknown parameter (not a field of this API)", param=param)
        return bad_request(f"{param}: {err.get('msg')}", param=param)
    param = _param_from_loc(loc, field_names, body, dotted)
    if not param:
        return bad_request(f"request body must be a JSON object: {err.get('msg')}")
    return bad_request(f"{param}: {err.get('msg')}", param=param)


def _param_from_loc(loc: tuple, field_names: set[str], body, dotted: bool) -> str | None:
    # NOTE: pydantic puts union-member tags ("str", "list[TextPart]", a discriminator's value such as
    # "text") and the FastAPI "body" prefix into ``loc``; keep only the body's indices and the keys
    # that are field names.
    out, node = "", body
    for i, part in enumerate(loc):
        if body is _NO_BODY:
            keep = isinstance(part, int) or part in field_names
        else:
            # a tag may equal a key of the object it tags ("text" of a text block): it is the key
            # only if the rest of the location goes on from its value
            nxt = loc[i + 1] if i + 1 < len(loc) else None
            keep = _has(node, part) and (nxt is None or _has(node[part], nxt) or not _has(node, nxt))
            if keep:
                node = node[part]
        if keep and isinstance(part, int):
            out += f".{part}" if dotted else f"[{part}]"
        elif keep and part in field_names:  # not a key of a free-form object (logit_bias' token ids)
            out += f".{part}" if out else part
    return out or None


def _has(node, part) -> bool:
    if isinstance(part, int):
        return isinstance(node, list) and 0 <= part < len(node)
    return isinstance(node, dict) and part in node


def install_error_handlers(app: FastAPI, field_names: set[str]) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors()), field_names).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(
            error_body(str(exc.detail), kind, None, code), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled_error", error=str(exc))
        return internal(f"{type(exc).__name__}: {exc}").response()
