"""Images in chat requests (vision-language models, issue #11).

The APIs' image parts reach ``resolve_images`` as template parts ``{"type": "image_url", "url"}``
(OpenAI ``image_url`` parts, Responses ``input_image`` parts, Anthropic image blocks: base64 ones
become ``data:`` URLs), optionally with ``param`` (the API's path of the part, for errors); error
messages use each API's words (``Terms``). For each one:

  * ``data:<media type>;base64,<data>``: base64-decoded (strictly: bad padding or characters are a 400);
  * ``http(s)://``: fetched (``image_fetch``: within the remote-URL policy, public addresses only
    by default; ``image_fetch_timeout_s`` for the whole download, redirects checked and followed,
    the body read only up to ``max_image_bytes``); refused, unreachable, an HTTP error or too large
    is a 400 saying which;
  * anything else, or more than ``max_images`` images: a 400.

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
import re
from dataclasses import dataclass

from deepinfer.gateway.errors import bad_request, mesh_errors
from deepinfer.gateway.image_fetch import RemotePolicy, fetch
from deepinfer.protocol import VisionEncodeReply, VisionEncodeRequest, subjects
from deepinfer.telemetry import tracer

_DATA_URL = re.compile(r"^data:([\w.+/-]*)((?:;[\w.+-]+=[^;,]*)*)(;base64)?,", re.ASCII)


@dataclass(frozen=True)
class Terms:
    """How an API names an image and its fields, for error messages in that API's own words."""

    name: str  # the image part
    url: str  # its URL field
    data: str  # its inline data


OPENAI = Terms("image_url", "image_url.url", "the data: URL")
RESPONSES = Terms("input_image", "input_image.image_url", "the data: URL")
ANTHROPIC = Terms("image block", "source.url", "source.data")


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
               for m in messages)


def decode_data_url(url: str, max_bytes: int, param: str, terms: Terms = OPENAI) -> bytes:
    m = _DATA_URL.match(url)
    if m is None or not m.group(3):
        raise bad_request(f"{terms.name}: a data: URL must be base64 (data:image/png;base64,...)", param=param)
    data = url[m.end():]
    if len(data) > (max_bytes + 2) // 3 * 4 + 4:
        raise bad_request(f"image too large: over {max_bytes} bytes", param=param, code="image_too_large")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{terms.name}: {terms.data} is not valid base64", param=param) from None
    if len(raw) > max_bytes:
        raise bad_request(f"image too large: {len(raw)} bytes (limit {max_bytes})", param=param,
                          code="image_too_large")
    return raw


async def image_bytes(url, gw, param: str, terms: Terms = OPENAI) -> bytes:
    if not isinstance(url, str) or not url:
        raise bad_request(f"{terms.url} must be a non-empty string", param=param)
    cfg = gw.config
    if url.startswith("data:"):
        return decode_data_url(url, cfg.max_image_bytes, param, terms)
    if url.startswith(("http://", "https://")):
        return await fetch(url, cfg.max_image_bytes, cfg.image_fetch_timeout_s, remote_policy(cfg), param,
                           field=terms.url)
    raise bad_request(f"{terms.url} must be a data: URL or an http(s) URL", param=param)


def remote_policy(cfg) -> RemotePolicy:
    return RemotePolicy(cfg.allow_remote_images, cfg.allow_private_image_urls, tuple(cfg.allowed_media_domains))


async def encode_one(gw, request_id: str, data: bytes, param: str) -> VisionEncodeReply:
    timeout = gw.config.vision_timeout_s
    with mesh_errors("vision", "vision service", timeout, param, code="invalid_image"):
        return await gw.mesh.request(subjects.VISION_ENCODE, VisionEncodeRequest(request_id, [data]),
                                     timeout=timeout, expect=VisionEncodeReply)


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
        raise bad_request(f"too many images: {len(where)} (limit {gw.config.max_images})", param=param)
    with tracer().start_as_current_span("gateway.images") as span:
        span.set_attribute("deepinfer.images", len(where))
        blobs = await asyncio.gather(*(image_bytes(messages[i]["content"][j].get("url"), gw, at, terms)
                                       for i, j, at in where))
        replies = await asyncio.gather(*(encode_one(gw, request_id, b, at) for (_, _, at), b in zip(where, blobs)))
    out = [dict(m) for m in messages]
    for (i, j, _), rep in zip(where, replies):
        if out[i]["content"] is messages[i]["content"]:
            out[i]["content"] = list(messages[i]["content"])
        out[i]["content"][j] = {"type": "image", "image_hash": rep.image_hashes[0]}
    return out, replies[0].embeddings_fingerprint
