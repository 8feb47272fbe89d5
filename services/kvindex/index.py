"""The prefix index in Redis: block metadata, LRU order, per-class expiry order, hit statistics.

Keys (``P`` = the configured prefix, default ``deepinfer:kv:``; a member is
``<class>:<hash>`` because one hash may be stored under two classes, as two
files)::

    P b:<class>:<hash>   HASH  fp, bytes, tokens, stored, access   (times: clock seconds)
    P lru                ZSET  member -> last access               (capacity eviction order)
    P c:<class>          ZSET  hash -> last access                 (retention sweep order)
    P classes            SET   classes that have blocks
    P bytes              INT   payload bytes of every indexed block
    P hits:<class>       HASH  lookups, queried_tokens, hit_tokens
    P statclasses        SET   classes that have hit statistics
    P workers            HASH  worker id -> "<epoch>:<last event id>"
    P ready              STR   set once the index was built from the storage tier

Multi-key updates run as Lua scripts, so every change to a block moves its
hash, both sorted sets and the byte total together (atomic in Redis). Needs a
single Redis (not Cluster: the scripts touch undeclared keys). Every method
raises ``redis.exceptions.RedisError`` (or OSError / TimeoutError) when Redis
is unreachable; the service turns that into misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import redis.asyncio as aioredis

_STORE = """
local p, cls, fp, nb, tok, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local added = 0
for i = 7, #ARGV do
  local h = ARGV[i]
  local k = p .. 'b:' .. cls .. ':' .. h
  if redis.call('EXISTS', k) == 0 then
    redis.call('HSET', k, 'fp', fp, 'bytes', nb, 'tokens', tok, 'stored', now, 'access', now)
    redis.call('INCRBY', p .. 'bytes', tonumber(nb))
    added = added + 1
  else
    redis.call('HSET', k, 'access', now)
  end
  redis.call('ZADD', p .. 'lru', now, cls .. ':' .. h)
  redis.call('ZADD', p .. 'c:' .. cls, now, h)
end
redis.call('SADD', p .. 'classes', cls)
return added
"""

# ARGV: prefix, field ('' = unconditional), then pairs (member, bound): a member is
# removed only if its <field> <= bound (so a block touched meanwhile survives).
_REMOVE = """
local p, fld = ARGV[1], ARGV[2]
local out = {}
for i = 3, #ARGV, 2 do
  local m, bound = ARGV[i], tonumber(ARGV[i + 1])
  local sep = string.find(m, ':', 1, true)
  local cls, h = string.sub(m, 1, sep - 1), string.sub(m, sep + 1)
  local k = p .. 'b:' .. m
  local v = redis.call('HMGET', k, 'fp', 'bytes', 'stored', 'access')
  local ok = v[1]
  if ok and fld ~= '' then
    local cur = (fld == 'stored') and v[3] or v[4]
    ok = tonumber(cur) <= bound
  end
  if ok then
    redis.call('DEL', k)
    redis.call('DECRBY', p .. 'bytes', tonumber(v[2]) or 0)
    redis.call('ZREM', p .. 'lru', m)
    redis.call('ZREM', p .. 'c:' .. cls, h)
    table.insert(out, m)
    table.insert(out, v[1])
  elseif not v[1] then
    redis.call('ZREM', p .. 'lru', m)
    redis.call('ZREM', p .. 'c:' .. cls, h)
  end
end
return out
"""

_LOOKUP = """
local p, cls, now, want = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local n, tokens = 0, 0
for i = 5, #ARGV do
  local h = ARGV[i]
  local k = p .. 'b:' .. cls .. ':' .. h
  local t = redis.call('HGET', k, 'tokens')
  if not t then break end
  n = n + 1
  tokens = tokens + tonumber(t)
  redis.call('HSET', k, 'access', now)
  redis.call('ZADD', p .. 'lru', now, cls .. ':' .. h)
  redis.call('ZADD', p .. 'c:' .. cls, now, h)
end
if want > 0 and tokens > want then tokens = want end
local s = p .. 'hits:' .. cls
redis.call('HINCRBY', s, 'lookups', 1)
redis.call('HINCRBY', s, 'queried_tokens', want)
if want > 0 then redis.call('HINCRBY', s, 'hit_tokens', tokens) end
redis.call('SADD', p .. 'statclasses', cls)
return {n, tokens}
"""

# ARGV: prefix, then groups of 6: class, hash, fp, bytes, tokens, time (stored = access = time).
_ADD_IF_ABSENT = """
local p = ARGV[1]
local added = 0
for i = 2, #ARGV, 6 do
  local cls, h, fp, nb, tok, t = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
  local k = p .. 'b:' .. cls .. ':' .. h
  if redis.call('EXISTS', k) == 0 then
    redis.call('HSET', k, 'fp', fp, 'bytes', nb, 'tokens', tok, 'stored', t, 'access', t)
    redis.call('INCRBY', p .. 'bytes', tonumber(nb))
    redis.call('ZADD', p .. 'lru', t, cls .. ':' .. h)
    redis.call('ZADD', p .. 'c:' .. cls, t, h)
    redis.call('SADD', p .. 'classes', cls)
    added = added + 1
  end
end
return added
"""


# KEYS[1]: the leader key; ARGV: worker id, lease (ms). Takes a free lease or renews one's own.
_LEAD = """
local cur = redis.call('GET', KEYS[1])
if cur == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
  return 1
end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
  return 1
end
return 0
"""

# KEYS[1]: the leader key; ARGV[1]: worker id. Gives the lease up if it is one's own.
_RESIGN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass
class Removed:
    """A block the index dropped; its file is ``<root>/<fingerprint>/<retention_class>/<key[:2]>/<key>.kvb``."""

    retention_class: str
    key: str
    fingerprint: str


@dataclass
class NewBlock:
    """A block found in the storage tier (replay): class, hash, fingerprint, bytes, tokens, time written."""

    retention_class: str
    key: str
    fingerprint: str
    nbytes: int
    num_tokens: int
    time: float


def classify_event_id(previous: str | None, epoch: str, event_id: int) -> str:
    """Compare an event's id with the last one applied for its worker.

    previous: ``"<epoch>:<id>"`` last applied, or None for a worker never seen.
    Returns "dup" (already applied: skip), "ok" (the next one) or "gap"
    (events were missed: apply it, then re-sync from the storage tier).
    A new epoch (the worker restarted) starts again at 1.
    """
    if previous is not None:
        prev_epoch, _, last = previous.rpartition(":")
        if prev_epoch == epoch:
            last_id = int(last)
            if event_id <= last_id:
                return "dup"
            return "ok" if event_id == last_id + 1 else "gap"
    return "ok" if event_id == 1 else "gap"


def _num(x: float) -> str:
    return repr(float(x))


class RedisIndex:
    """The index over one ``redis.asyncio.Redis`` (created with ``decode_responses=True``)."""

    def __init__(self, r: aioredis.Redis, prefix: str = "deepinfer:kv:"):
        self.r = r
        self.p = prefix
        self._store = r.register_script(_STORE)
        self._remove = r.register_script(_REMOVE)
        self._lookup = r.register_script(_LOOKUP)
        self._add_if_absent = r.register_script(_ADD_IF_ABSENT)
        self._lead = r.register_script(_LEAD)
        self._resign = r.register_script(_RESIGN)

    # --- blocks -------------------------------------------------------------------
    async def store(self, retention_class: str, hashes: list[str], fingerprint: str, nbytes: int,
                    num_tokens: int, now: float) -> int:
        """Index blocks as stored now (existing ones are only touched). Returns how many were new."""
        if not hashes:
            return 0
        return int(await self._store(args=[self.p, retention_class, fingerprint, int(nbytes), int(num_tokens),
                                           _num(now), *hashes]))

    async def remove(self, members: Iterable[tuple[str, str]], field: str = "",
                     bounds: Iterable[float] | None = None) -> list[Removed]:
        """Drop ``(class, hash)`` blocks; with ``field`` ("access" / "stored"), only those whose field <= bound.

        Returns the blocks actually dropped (so their files can be deleted).
        """
        members = list(members)
        if not members:
            return []
        bounds = list(bounds) if bounds is not None else [0.0] * len(members)
        args = [self.p, field]
        for (cls, h), b in zip(members, bounds):
            args += [f"{cls}:{h}", _num(b)]
        out = await self._remove(args=args)
        removed = []
        for m, fp in zip(out[::2], out[1::2]):
            cls, _, h = m.partition(":")
            removed.append(Removed(cls, h, fp))
        return removed

    async def add_if_absent(self, blocks: list[NewBlock]) -> int:
        """Index blocks found on disk unless already indexed; returns how many were added."""
        if not blocks:
            return 0
        args = [self.p]
        for b in blocks:
            args += [b.retention_class, b.key, b.fingerprint, int(b.nbytes), int(b.num_tokens), _num(b.time)]
        return int(await self._add_if_absent(args=args))

    async def lookup(self, retention_class: str, hashes: list[str], num_tokens: int, now: float) -> tuple[int, int]:
        """Longest prefix of ``hashes`` indexed under ``retention_class``: (blocks, tokens).

        Touches the hit blocks' last access and adds to the class's hit
        statistics (queried ``num_tokens``, hit tokens capped at it).
        """
        n, tokens = await self._lookup(args=[self.p, retention_class, _num(now), int(num_tokens), *hashes])
        return int(n), int(tokens)

    async def expired(self, retention_class: str, cutoff: float, limit: int = 500) -> list[tuple[str, float]]:
        """Up to ``limit`` ``(hash, last access)`` of the class last used at or before ``cutoff``, oldest first."""
        rows = await self.r.zrangebyscore(f"{self.p}c:{retention_class}", "-inf", _num(cutoff),
                                          start=0, num=limit, withscores=True)
        return [(h, float(s)) for h, s in rows]

    async def least_recent(self, limit: int = 64) -> list[tuple[str, str, float, int]]:
        """The ``limit`` least recently used blocks: ``(class, hash, last access, bytes)``, oldest first."""
        rows = await self.r.zrange(f"{self.p}lru", 0, limit - 1, withscores=True)
        if not rows:
            return []
        pipe = self.r.pipeline(transaction=False)
        for m, _ in rows:
            pipe.hget(f"{self.p}b:{m}", "bytes")
        sizes = await pipe.execute()
        out = []
        for (m, score), size in zip(rows, sizes):
            cls, _, h = m.partition(":")
            out.append((cls, h, float(score), int(size or 0)))
        return out

    async def entries(self, batch: int = 1000):
        """Yield every indexed block as ``(class, hash, fingerprint, stored)`` (scans; for re-syncs)."""
        cursor = 0
        while True:
            cursor, rows = await self.r.zscan(f"{self.p}lru", cursor, count=batch)
            members = [m for m, _ in rows]
            if members:
                pipe = self.r.pipeline(transaction=False)
                for m in members:
                    pipe.hmget(f"{self.p}b:{m}", "fp", "stored")
                metas = await pipe.execute()
                for m, (fp, stored) in zip(members, metas):
                    cls, _, h = m.partition(":")
                    yield cls, h, fp, float(stored) if stored is not None else 0.0
            if cursor == 0:
                return

    async def classes(self) -> list[str]:
        return sorted(await self.r.smembers(f"{self.p}classes"))

    async def total_bytes(self) -> int:
        return int(await self.r.get(f"{self.p}bytes") or 0)

    async def num_blocks(self) -> int:
        return int(await self.r.zcard(f"{self.p}lru"))

    async def has_block(self, retention_class: str, key: str) -> bool:
        return bool(await self.r.exists(f"{self.p}b:{retention_class}:{key}"))

    # --- workers, readiness, statistics --------------------------------------------------
    async def last_event(self, worker_id: str) -> str | None:
        """``"<epoch>:<last event id>"`` applied for ``worker_id``, or None."""
        return await self.r.hget(f"{self.p}workers", worker_id)

    async def set_last_event(self, worker_id: str, epoch: str, event_id: int) -> None:
        await self.r.hset(f"{self.p}workers", worker_id, f"{epoch}:{event_id}")

    async def lead(self, worker_id: str, lease_s: float) -> bool:
        """Take the leader lease for ``lease_s`` seconds if no one holds it, or renew it if
        ``worker_id`` does; whether ``worker_id`` holds it now."""
        return bool(await self._lead(keys=[f"{self.p}leader"], args=[worker_id, max(1, int(lease_s * 1000))]))

    async def resign(self, worker_id: str) -> bool:
        """Give the leader lease up if ``worker_id`` holds it (a clean stop: the next replica
        takes over at once instead of after the lease); whether it did."""
        return bool(await self._resign(keys=[f"{self.p}leader"], args=[worker_id]))

    async def leader(self) -> str | None:
        """The worker id holding the leader lease, or None."""
        return await self.r.get(f"{self.p}leader")

    async def is_ready(self) -> bool:
        """Whether the index was built from the storage tier since Redis last lost its data."""
        return bool(await self.r.exists(f"{self.p}ready"))

    async def mark_ready(self, now: float) -> None:
        await self.r.set(f"{self.p}ready", _num(now))

    async def hit_stats(self) -> dict[str, dict[str, int]]:
        """class -> {"lookups", "queried_tokens", "hit_tokens"}."""
        classes = sorted(await self.r.smembers(f"{self.p}statclasses"))
        pipe = self.r.pipeline(transaction=False)
        for cls in classes:
            pipe.hgetall(f"{self.p}hits:{cls}")
        rows = await pipe.execute()
        return {cls: {k: int(row.get(k, 0)) for k in ("lookups", "queried_tokens", "hit_tokens")}
                for cls, row in zip(classes, rows)}
