"""Stored responses of /v1/responses in Redis, for ``previous_response_id`` and GET /v1/responses/{id}.

One key per response, ``deepinfer:response:<id>``, holding JSON ``{"response": <the Response
object>, "context": [<every conversation item up to and including its output>]}`` with a TTL
(default 7 days after the response was stored; reading it does not extend it). The
context is the previous response's context + this request's input items + its output items, so
continuing a conversation is one GET however long the chain (``instructions`` are not part of
it: OpenAI does not carry them over either).

Redis down (or no Redis configured) raises ``StoreUnavailable``; the API turns that into 503 for
requests that need the store and only logs it when storing a response fails.
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from deepinfer.kvstore.redis_client import redis_client
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

KEY_PREFIX = "deepinfer:response:"
DEFAULT_TTL_S = 7 * 24 * 3600


class StoreUnavailable(Exception):
    """Redis is not configured, unreachable or failed."""


class ResponseStore:
    """``url``: Redis URL (``kvstore.redis_client``: one server or ``redis+sentinel://``), or None (every call raises ``StoreUnavailable``); ``ttl_s``: seconds a
    stored response lives; timeouts in seconds bound every call when Redis is unreachable."""

    def __init__(self, url: str | None, ttl_s: int = DEFAULT_TTL_S, connect_timeout_s: float = 1.0,
                 timeout_s: float = 2.0):
        self.url = url
        self.ttl_s = ttl_s
        self._client = None
        if url:
            self._client = redis_client(url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s,
                                             retry=Retry(NoBackoff(), 0), decode_responses=False)

    def _redis(self):
        if self._client is None:
            raise StoreUnavailable("response storage is not configured (no Redis URL)")
        return self._client

    async def put(self, response: dict, context: list[dict]) -> None:
        """Store ``response`` (its ``id`` is the key) with its conversation ``context``."""
        data = json.dumps({"response": response, "context": context}, ensure_ascii=False, separators=(",", ":"))
        try:
            await self._redis().set(KEY_PREFIX + response["id"], data.encode(), ex=self.ttl_s)
        except aioredis.RedisError as e:
            raise StoreUnavailable(f"Redis failed: {e}") from None

    async def get(self, response_id: str) -> dict | None:
        """``{"response", "context"}`` of a stored response, or None when unknown or expired."""
        try:
            raw = await self._redis().get(KEY_PREFIX + response_id)
        except aioredis.RedisError as e:
            raise StoreUnavailable(f"Redis failed: {e}") from None
        return None if raw is None else json.loads(raw)

    async def delete(self, response_id: str) -> bool:
        """Whether a stored response was deleted."""
        try:
            return bool(await self._redis().delete(KEY_PREFIX + response_id))
        except aioredis.RedisError as e:
            raise StoreUnavailable(f"Redis failed: {e}") from None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
