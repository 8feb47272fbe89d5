"""Images in chat requests (vision-language models).

The APIs' image parts reach ``resolve_images`` as template parts ``{"type": "image_url", "url"}``
(OpenAI ``image_url`` parts, Responses ``input_image`` parts, Anthropic image blocks: base64 ones
become ``data:`` URLs), optionally with ``param`` (the API's path of the part), ``url_param`` (the
path of the field holding the URL or data; default ``param`` + ``Terms.url_suffix``) and
``media_type`` / ``media_param`` (Anthropic's declared type of base64 data); error messages use
each API's words (``Terms``). For each one:

  * ``data:<media type>;base64,<data>`` (scheme and ``;base64`` in any case, RFC 3986 / 2397):
    base64-decoded; ASCII whitespace inside the data is dropped first (MIME line-wrapped base64),
    anything else that is not base64 (characters, padding) is a 400. The declared media type is
    not checked against the bytes (OpenAI is lenient: ``data:text/plain;base64,<a PNG>`` is
    the PNG; the vision service decides what the bytes are) -- except for Anthropic base64 image
    blocks, whose ``media_type`` must match the image's actual format (``check_media_type``, as
    Anthropic's API: "Image does not match the provided media type image/png");
  * ``http(s)://`` (any case): fetched (``image_fetch``: within the remote-URL policy, public
    addresses only by default; ``image_fetch_timeout_s`` for the whole download, redirects checked
    and followed, the body read only up to ``max_image_bytes``); refused, unreachable, an HTTP
    error or too large is a 400 saying which;
  * anything else, or more than ``max_images`` images: a 400.

Every image error has a ``code`` and names the most specific field (``param``):
``invalid_image_url`` (not a data: / http(s) URL, a data: URL that is not base64, no host),
``invalid_image`` (bad base64, not an image, truncated, unsupported format, Anthropic media type
mismatch), ``image_too_large`` (bytes or pixels over the limits), ``too_many_images`` (param: the
first image over ``max_images``), ``image_fetch_failed`` / ``image_url_not_allowed`` (remote
URLs), ``images_not_supported`` (a text-only model). The Anthropic error shape has no ``code`` or
``param``; its messages carry the same words.

The bytes then go to the vision service (``deepinfer.vision.encode``, one request per image so
each stays within NATS's default 1 MiB max_payload and replicas share the work), which validates
and decodes them (a bad image is its ``bad_request``: our 400 with its message), stores their
embeddings and replies with each image's content hash; the parts become
``{"type": "image", "image_hash"}`` for the tokenizer. A text-only model refuses image parts (400).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
from dataclasses import dataclass

from deepinfer.gateway.api.errors import OpenAIError, bad_request, mesh_errors
from deepinfer.gateway.api.image_fetch import RemotePolicy, fetch
from deepinfer.protocol import VisionEncodeReply, VisionEncodeRequest, subjects
from deepinfer.telemetry import tracer

_DATA_URL = re.compile(r"^data:([\w.+/-]*)((?:;[\w.+-]+=[^;,]*)*)(;base64)?,", re.ASCII | re.IGNORECASE)
_WHITESPACE = str.maketrans("", "", " \t\r\n\f\v")  # MIME (RFC 2045) wraps base64 at 76 characters
# Anthropic's media types and the PIL format of each
MEDIA_FORMATS = {"image/jpeg": "JPEG", "image/png": "PNG", "image/gif": "GIF", "image/webp": "WEBP"}


@dataclass(frozen=True)
class Terms:
    """How an API names an image and its fields, for error messages in that API's own words."""

    name: str  # the image part
    url: str  # its URL field
    data: str  # its inline data
    url_suffix: str = ""  # the URL field's path below the part's (for ``param``)


OPENAI = Terms("image_url", "image_url.url", "the data: URL", ".image_url.url")
RESPONSES = Terms("input_image", "input_image.image_url", "the data: URL", ".image_url")
ANTHROPIC = Terms("image block", "source.url", "source.data", ".source")  # parts carry their url_param


def decode_data_url(url: str, max_bytes: int, param: str, terms: Terms = OPENAI) -> bytes:
    m = _DATA_URL.match(url)
    if m is None or not m.group(3):
        raise bad_request(f"{terms.name}: a data: URL must be base64 (data:image/png;base64,...)", param=param,
                          code="invalid_image_url")
    data = url[m.end():]
    limit = (max_bytes + 2) // 3 * 4 + 4
    if len(data) > limit:
        data = data.translate(_WHITESPACE)  # only line-wrapped data may be longer than the limit
        if len(data) > limit:
            raise bad_request(f"image too large: over {max_bytes} bytes", param=param, code="image_too_large")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raw = None
    if raw is None:  # whitespace (line-wrapped base64) is dropped; any other non-base64 character is an error
        try:
            raw = base64.b64decode(data.translate(_WHITESPACE), validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{terms.name}: {terms.data} is not valid base64", param=param,
                              code="invalid_image") from None
    if len(raw) > max_bytes:
        raise bad_request(f"image too large: {len(raw)} bytes (limit {max_bytes})", param=param,
                          code="image_too_large")
    return raw


async def image_bytes(url, gw, param: str, terms: Terms = OPENAI) -> bytes:
    """The image's file bytes from a data: URL or an http(s) URL (``param``: the URL field's path)."""
    if not isinstance(url, str) or not url:
        raise bad_request(f"{terms.url} must be a non-empty string", param=param, code="invalid_image_url")
    cfg = gw.config
    scheme = url[:8].lower()  # URI schemes are case-insensitive (RFC 3986 3.1)
    if scheme.startswith("data:"):
        return decode_data_url(url, cfg.max_image_bytes, param, terms)
    if scheme.startswith(("http://", "https://")):
        return await fetch(url, cfg.max_image_bytes, cfg.image_fetch_timeout_s, remote_policy(cfg), param,
                           field=terms.url)
    raise bad_request(f"{terms.url} must be a data: URL or an http(s) URL", param=param, code="invalid_image_url")


def check_media_type(data: bytes, media_type: str, param: str) -> None:
    """Anthropic base64 images: ``media_type`` must be the image's actual format (PIL's, from the
    header; bytes PIL does not recognise are left to the vision service: "not an image")."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            actual = img.format
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError):
        return
    if actual is not None and MEDIA_FORMATS.get(media_type.lower()) != actual:
        raise bad_request(f"Image does not match the provided media type {media_type} (the data is a "
                          f"{actual} image)", param=param, code="invalid_image")


def remote_policy(cfg) -> RemotePolicy:
    return RemotePolicy(cfg.allow_remote_images, cfg.allow_private_image_urls, tuple(cfg.allowed_media_domains))


async def encode_one(gw, request_id: str, data: bytes, param: str) -> VisionEncodeReply:
    timeout = gw.config.vision_timeout_s
    try:
        with mesh_errors("vision", "vision service", timeout, param, code="invalid_image"):
            return await gw.mesh.request(subjects.VISION_ENCODE, VisionEncodeRequest(request_id, [data]),
                                         timeout=timeout, expect=VisionEncodeReply)
    except OpenAIError as e:
        if e.status == 400 and ("image too large" in e.message or "too many pixels" in e.message):
            e.code = "image_too_large"  # the vision service's own limits (bytes, pixels)
        raise


async def resolve_images(gw, request_id: str, messages: list[dict], param: str = "messages",
                         terms: Terms = OPENAI) -> tuple[list[dict], str]:
    """``messages`` with each ``{"type": "image_url", "url"}`` part replaced by ``{"type": "image",
    "image_hash"}`` (the images fetched or decoded, then encoded by the vision service), and the
    embeddings fingerprint ("" when there are no images). A part's errors name it by its ``param``
    key when it has one (the API's own field path), else ``<param>[i].content[j]``; messages use
    ``terms``. Raises 400 / 503 / 500 ``OpenAIError``."""
    where = [(i, j, p.get("param") or f"{param}[{i}].content[{j}]") for i, m in enumerate(messages)
             if isinstance(m.get("content"), list) for j, p in enumerate(m["content"]) if p.get("type") == "image_url"]
    if not where:
        return messages, ""
    if not gw.model.takes_images:
        raise bad_request(f"model {gw.model.served_name} is a text-only model: it does not take image inputs",
                          param=where[0][2], code="images_not_supported")
    if len(where) > gw.config.max_images:
        raise bad_request(f"too many images: {len(where)} (limit {gw.config.max_images})",
                          param=where[gw.config.max_images][2], code="too_many_images")
    parts = [messages[i]["content"][j] for i, j, _ in where]
    fields = [p.get("url_param") or at + terms.url_suffix for p, (_, _, at) in zip(parts, where)]

    async def one(part: dict, field: str) -> bytes:
        data = await image_bytes(part.get("url"), gw, field, terms)
        if part.get("media_type"):
            check_media_type(data, part["media_type"], part.get("media_param") or field)
        return data

    with tracer().start_as_current_span("gateway.images") as span:
        span.set_attribute("deepinfer.images", len(where))
        blobs = await asyncio.gather(*(one(p, f) for p, f in zip(parts, fields)))
        replies = await asyncio.gather(*(encode_one(gw, request_id, b, f) for f, b in zip(fields, blobs)))
    out = [dict(m) for m in messages]
    for (i, j, _), rep in zip(where, replies):
        if out[i]["content"] is messages[i]["content"]:
            out[i]["content"] = list(messages[i]["content"])
        out[i]["content"][j] = {"type": "image", "image_hash": rep.image_hashes[0]}
    return out, replies[0].embeddings_fingerprint
