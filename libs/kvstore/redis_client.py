"""Redis clients from one URL: a single server, or the master a group of Sentinels watches.

Forms (``DEEPINFER_REDIS_URL``, ``--redis-url``, ``--redis``)::

    redis://[[user]:password@]host[:port][/db]          one server (redis-py's own URL forms,
    rediss://...  unix://...                            TLS and unix sockets included)
    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]

A ``redis+sentinel://`` URL lists Sentinels (port 26379 by default) and names the
monitored service (the ``<master-name>`` of ``sentinel monitor``). The client asks
the Sentinels for the service's current master on each new connection, so after a
Sentinel failover the first call on a dead connection fails (callers treat that
as Redis down for a moment) and the next one reaches the promoted replica. User
and password authenticate to the master (and its replicas); the Sentinels are
asked without authentication. This is the form Celery/Kombu and Sidekiq use, as
redis-py has no URL form for Sentinel.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL: sentinels [(host, port)], service (master name), db,
    and the master's username / password (None when not given)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``redis+sentinel://[[user]:password@]host[:port][,...]/service[/db]``.
    Raises ValueError naming what is wrong (scheme, no host, bad port, no service, bad db)."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ValueError(f"not a {SENTINEL_SCHEME}:// URL: {url!r}")
    auth, _, hosts = parts.netloc.rpartition("@")
    username = password = None
    if auth:
        user, _, pw = auth.partition(":")
        username, password = unquote(user) or None, unquote(pw) or None
    sentinels = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "")
        if not host:
            raise ValueError(f"{url!r}: a Sentinel without a host")
        try:
            sentinels.append((host, int(port) if port else SENTINEL_PORT))
        except ValueError:
            raise ValueError(f"{url!r}: Sentinel port {port!r} is not a number") from None
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(f"{url!r}: the path must be /<service>[/<db>] (the master name Sentinel monitors)")
    try:
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError:
        raise ValueError(f"{url!r}: database {path[1]!r} is not a number") from None
    return SentinelURL(tuple(sentinels), unquote(path[0]), db, username, password)


def redis_client(url: str, **kwargs) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` (either form above). ``kwargs`` go to every
    connection (``decode_responses``, ``socket_timeout``, ``retry``, ...); the Sentinel queries
    use the same connect and socket timeouts. Raises ValueError for a malformed URL."""
    if not url.startswith(SENTINEL_SCHEME + "://"):
        return aioredis.Redis.from_url(url, **kwargs)
    s = parse_sentinel_url(url)
    timeouts = {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kwargs}
    sentinel = Sentinel(list(s.sentinels), sentinel_kwargs=timeouts)
    return sentinel.master_for(s.service, db=s.db, username=s.username, password=s.password, **kwargs)


def describe(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)
