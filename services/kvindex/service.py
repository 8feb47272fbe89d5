"""kvindex service: which KV blocks the shared storage tier holds, over Redis.

Lifecycle of what this service handles:
  1. KV events. Workers publish ``KVEvent`` s on ``deepinfer.kv.events.<worker>``;
     the JetStream stream ``DEEPINFER_KV_EVENTS`` keeps them until this
     service's durable consumer (``kvindex``, shared by replicas) fetches them,
     in order. Each event's id is checked against the worker's last one
     (``index.classify_event_id``): a duplicate is skipped; otherwise
     "stored" indexes the blocks (then the capacity is enforced), "removed"
     drops them, "cleared" re-syncs the fingerprint from the files. A gap in
     the ids also re-syncs (``maintenance.replay``). The event is acked once
     applied; while Redis is down nothing is fetched, so events wait in the
     stream. A consumer (or stream) found gone is created again and the index
     re-synced (``_heal_events``).
  2. Lookups. ``deepinfer.kvindex.lookup`` (queue group ``kvindex``):
     ``KVLookupRequest(hashes, class, num_tokens)`` -> ``KVLookupReply`` with
     the longest prefix of ``hashes`` whose blocks are all indexed under that
     class; hit blocks' last access is touched, hit statistics (tokens) are
     counted. Redis down -> 0 blocks at once (``redis_ok=False``); Redis
     slower than ``lookup_timeout_s`` -> 0 blocks for that lookup.
  3. Health. ``deepinfer.kvindex.health`` -> ``KVIndexHealth`` (redis_ok,
     blocks, bytes, hit statistics); answered even while Redis is down.
  4. Background: a Redis watchdog (every ``redis_check_s``: ping; after an
     outage, or when the index lost its data, re-sync from the storage tier),
     and a sweep every ``sweep_interval_s`` (retention per class, capacity
     by LRU, orphan ephemeral files).

Replicas: any number may run over one Redis. Every replica answers lookups
and health; one, the leader, holds a lease in Redis (``leader_lease_s``,
renewed every third of it) and alone fetches events, re-syncs and sweeps, so
one worker's events are applied in order and a sweep runs once. A replica that
finds the lease free takes it (and the events where the old leader left them in
the durable consumer); a leader that cannot renew in time steps down.

All times come from ``clock`` (seconds; ``time.time`` by default), so tests
move time without sleeping (the lease uses Redis' own expiry and the monotonic clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Callable

import redis.asyncio as aioredis
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError
from opentelemetry import trace
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from deepinfer.kvindex import maintenance
from deepinfer.kvindex.config import (
    DEFAULT_RETENTION_S,
    IndexConfig,
    parse_duration,
    parse_retention,
    parse_size,
)
from deepinfer.kvindex.index import RedisIndex, classify_event_id
from deepinfer.kvstore.format import EPHEMERAL, SAFE_NAME, BadBlock, block_path, verify_block
from deepinfer.kvstore.index_client import ensure_kv_events_stream
from deepinfer.kvstore.redis_client import describe, redis_client
from deepinfer.mesh import Service, run_service
from deepinfer.mesh.args import service_parser
from deepinfer.protocol import (
    ErrorReply,
    KVEvent,
    KVIndexHealth,
    KVIndexHealthRequest,
    KVLookupReply,
    KVLookupRequest,
    ProtocolError,
    subjects,
    unpack,
)
from deepinfer.telemetry import get_logger

log = get_logger(__name__)
CONSUMER_CHECK_S = 5.0  # idle fetching this long: check that the events consumer still exists

_REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
EVENT_KINDS = ("stored", "removed", "cleared")


class KVIndexService(Service):
    role = "kvindex"

    def __init__(self, nats_url: str, redis_url: str, config: IndexConfig, worker_id: str | None = None,
                 clock: Callable[[], float] = time.time):
        super().__init__(nats_url, worker_id)
        self.redis_url = redis_url
        self.config = config
        self.clock = clock
        self.redis: aioredis.Redis | None = None
        self.index: RedisIndex | None = None
        self.redis_ok = False
        self._redis_failure_logged = False
        self.events_applied = 0
        self.gaps = 0
        self.replays = 0
        self.consumer_recreated = 0  # times the events consumer (or its stream) was found gone
        self.lookup_timeouts = 0
        self._tasks: list[asyncio.Task] = []
        self._replay_lock = asyncio.Lock()
        self._replay_pending: set[str | None] = set()
        self._replay_task: asyncio.Task | None = None
        self._events_sub = None  # the JetStream pull subscription of KV events
        self.leading = False  # holds the leader lease: applies events, re-syncs, sweeps
        self.leader_changes = 0  # times this replica became the leader
        self._lease_deadline = 0.0  # monotonic time the lease this replica holds runs out
        self._lead_tasks: list[asyncio.Task] = []
        self._maint_lock = asyncio.Lock()
        self._stopping = False

    async def setup(self) -> None:
        self.redis = redis_client(
            self.redis_url, decode_responses=True, socket_connect_timeout=0.5, socket_timeout=5.0,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self.index = RedisIndex(self.redis, self.config.redis_prefix)
        await self.mesh.subscribe(subjects.KVINDEX_LOOKUP, self.on_lookup, queue=subjects.KVINDEX_GROUP,
                                  span_name="kvindex.lookup")
        await self.mesh.subscribe(subjects.KVINDEX_HEALTH, self.on_health, queue=subjects.KVINDEX_GROUP,
                                  span_name="kvindex.health")
        await self.check_redis()
        if await self.try_lead():
            await self.replay_idle()  # an empty index is built from the files before lookups are answered
        self._tasks = [asyncio.create_task(self._watch_redis()), asyncio.create_task(self._lead_loop())]

    # --- handlers -------------------------------------------------------------------
    async def on_lookup(self, req: KVLookupRequest):
        if not SAFE_NAME.fullmatch(req.traffic_class or ""):
            return ErrorReply(error=f"bad traffic class {req.traffic_class!r}", kind="bad_request")
        if not self.redis_ok:
            return KVLookupReply(num_blocks=0, redis_ok=False)
        try:
            n, tokens = await asyncio.wait_for(
                self.index.lookup(req.traffic_class, list(req.hashes), max(0, req.num_tokens), self.clock()),
                self.config.lookup_timeout_s)
        except asyncio.TimeoutError:  # slow, not necessarily down: a miss; the watchdog decides about "down"
            self.lookup_timeouts += 1
            return KVLookupReply(num_blocks=0)
        except (RedisError, OSError) as e:
            self._redis_failed(e)
            return KVLookupReply(num_blocks=0, redis_ok=False)
        trace.get_current_span().set_attributes({
            "deepinfer.traffic_class": req.traffic_class, "deepinfer.kv.queried_blocks": len(req.hashes),
            "deepinfer.kv.hit_blocks": n, "deepinfer.kv.hit_tokens": tokens})
        log.info("kv_lookup", traffic_class=req.traffic_class, queried_blocks=len(req.hashes), hit_blocks=n)
        return KVLookupReply(num_blocks=n, num_tokens=tokens)

    async def on_health(self, _req: KVIndexHealthRequest) -> KVIndexHealth:
        h = KVIndexHealth(worker_id=self.worker_id, redis_ok=self.redis_ok, capacity_bytes=self.config.capacity_bytes,
                          events_applied=self.events_applied, gaps=self.gaps, replays=self.replays,
                          lookup_timeouts=self.lookup_timeouts, leading=self.leading)
        if self.redis_ok:
            try:
                h.num_blocks, h.total_bytes, h.hit_stats, leader = await asyncio.wait_for(asyncio.gather(
                    self.index.num_blocks(), self.index.total_bytes(), self.index.hit_stats(), self.index.leader()),
                    1.0)
                h.leader = leader or ""
            except asyncio.TimeoutError:  # slow, not necessarily down (as for lookups): counts unknown (-1)
                pass
            except _REDIS_ERRORS as e:
                self._redis_failed(e)
                h.redis_ok = False
        return h

    async def apply_event(self, ev: KVEvent) -> str:
        """Apply one KV event to the index; returns its id status ("ok", "gap" or "dup").

        Raises RedisError (and OSError / TimeoutError) when Redis fails: the
        caller leaves the event in the stream for redelivery.
        """
        status = classify_event_id(await self.index.last_event(ev.worker_id), ev.epoch, ev.event_id)
        if status == "dup":
            return status
        hashes = [h for h in ev.block_hashes if SAFE_NAME.fullmatch(h)]
        cls_ok = bool(SAFE_NAME.fullmatch(ev.traffic_class or "")) and ev.traffic_class != EPHEMERAL
        if ev.kind == "stored" and cls_ok and SAFE_NAME.fullmatch(ev.fingerprint or ""):
            await self.index.store(ev.traffic_class, hashes, ev.fingerprint, ev.block_bytes,
                                   ev.block_tokens or self.config.default_block_tokens, self.clock())
            if self.config.capacity_bytes > 0:
                await self.enforce_capacity()
        elif ev.kind == "removed" and cls_ok:
            await self.index.remove([(ev.traffic_class, h) for h in hashes])
            if SAFE_NAME.fullmatch(ev.fingerprint or ""):
                await asyncio.to_thread(self._drop_damaged, ev.fingerprint, ev.traffic_class, hashes)
        elif ev.kind == "cleared":
            self.request_replay(ev.fingerprint or None)
        else:
            log.warning("kv_event_ignored", kind=ev.kind, worker=ev.worker_id, traffic_class=ev.traffic_class)
        await self.index.set_last_event(ev.worker_id, ev.epoch, ev.event_id)
        self.events_applied += 1
        if status == "gap":
            self.gaps += 1
            log.info("kv_event_gap", worker=ev.worker_id, event_id=ev.event_id)
            self.request_replay(ev.fingerprint if SAFE_NAME.fullmatch(ev.fingerprint or "") else None)
        return status

    # --- maintenance ----------------------------------------------------------------
    def _drop_damaged(self, fingerprint: str, traffic_class: str, hashes: list[str]) -> None:
        """Read the files a worker reported gone or damaged once more, here, and delete those still
        damaged (a worker never deletes what it failed to verify: ``BlockStore``); a file that now
        reads well (rewritten meanwhile, or the worker's view was stale) is kept. Verified as a load
        verifies (``format.verify_block``), without torch."""
        for h in hashes:
            path = block_path(self.config.kv_root, fingerprint, traffic_class, h)
            try:
                verify_block(path, fingerprint, h)
            except BadBlock as e:
                if e.corrupt:
                    with contextlib.suppress(OSError):
                        path.unlink()
                log.info("kv_block_damaged", fingerprint=fingerprint, traffic_class=traffic_class, block=h,
                         why=str(e), deleted=not path.exists())
            except FileNotFoundError:  # gone already
                pass
            except OSError as e:  # unreadable here: kept (the next load reports it again)
                log.info("kv_block_damaged", fingerprint=fingerprint, traffic_class=traffic_class, block=h,
                         why=str(e), deleted=False)

    async def replay(self, fingerprint: str | None = None) -> maintenance.ReplayResult:
        """Re-sync the index with the storage tier now (one fingerprint or all); marks the index ready."""
        async with self._replay_lock:
            t0 = time.monotonic()
            result = await maintenance.replay(self.index, self.config.kv_root, self.clock(),
                                              self.config.default_block_tokens, fingerprint)
            if fingerprint is None:
                await self.index.mark_ready(self.clock())
            self.replays += 1
            log.info("kv_index_replayed", fingerprint=fingerprint, scanned=result.scanned, added=result.added,
                     dropped=result.dropped, seconds=round(time.monotonic() - t0, 3))
            return result

    def request_replay(self, fingerprint: str | None) -> None:
        """Schedule a re-sync in the background (coalesced with any already pending)."""
        self._replay_pending.add(fingerprint)
        if self._replay_task is None or self._replay_task.done():
            self._replay_task = asyncio.create_task(self._run_pending_replays())

    async def _run_pending_replays(self) -> None:
        while self._replay_pending:
            fps = self._replay_pending
            self._replay_pending = set()
            try:
                if None in fps:
                    await self.replay(None)
                else:
                    for fp in sorted(fps):
                        await self.replay(fp)
            except _REDIS_ERRORS as e:
                self._redis_failed(e)  # the watchdog replays everything once Redis is back
                return

    async def replay_idle(self) -> None:
        """Wait until no background re-sync is pending or running (tests)."""
        while self._replay_task is not None and not self._replay_task.done():
            await asyncio.wait({self._replay_task})

    async def enforce_capacity(self) -> int:
        """Evict least-recently-used blocks (index + files) down to the capacity; returns how many."""
        async with self._maint_lock:
            removed = await maintenance.evict_to_capacity(self.index, self.config.kv_root, self.config.capacity_bytes)
        if removed:
            log.info("kv_evicted", blocks=len(removed))
        return len(removed)

    async def sweep(self) -> dict[str, int]:
        """One sweep now: retention per class, then capacity, then orphan ephemeral files.

        Returns counts {"expired", "evicted", "ephemeral"}. Raises RedisError
        when Redis fails.
        """
        now = self.clock()
        async with self._maint_lock:
            expired = await maintenance.expire(self.index, self.config.kv_root, self.config.retention_of, now)
        evicted = await self.enforce_capacity()
        ephemeral = await maintenance.remove_orphan_ephemeral(self.config.kv_root, self.config.ephemeral_ttl_s, now)
        if expired or ephemeral:
            log.info("kv_swept", expired=len(expired), evicted=evicted, ephemeral=ephemeral)
        return {"expired": len(expired), "evicted": evicted, "ephemeral": ephemeral}

    async def check_redis(self) -> bool:
        """Ping Redis; on success after an outage (or with a lost index) re-sync from the storage tier."""
        try:
            await asyncio.wait_for(self.redis.ping(), max(1.0, self.config.lookup_timeout_s))
            was_ok = self.redis_ok
            self.redis_ok = True
            if not was_ok:
                log.info("redis_ok", url=describe(self.redis_url))
            if self.leading and not await self.index.is_ready():
                await self.replay(None)
        except _REDIS_ERRORS as e:
            self._redis_failed(e)
        return self.redis_ok

    def _redis_failed(self, e: BaseException) -> None:
        # logged when it goes down, and once when it was never up (a wrong URL, a password, a Redis
        # in protected mode refusing other hosts: prefix caching would be off without a word)
        if self.redis_ok or not self._redis_failure_logged:
            log.warning("redis_down", url=describe(self.redis_url), error=f"{type(e).__name__}: {e}")
            self._redis_failure_logged = True
        self.redis_ok = False

    # --- leadership -------------------------------------------------------------------
    async def try_lead(self) -> bool:
        """Take or renew the leader lease (when Redis is up) and start or stop the leader's work
        to match; whether this replica leads now. A leader that cannot reach Redis keeps leading
        until its lease would have run out, then steps down."""
        lease = self.config.leader_lease_s
        held = None
        if self.redis_ok:
            t = time.monotonic()
            try:
                held = await asyncio.wait_for(self.index.lead(self.worker_id, lease), lease / 3)
            except _REDIS_ERRORS as e:
                self._redis_failed(e)
            else:
                if held:
                    self._lease_deadline = t + lease
        if held and not self.leading:
            await self._step_up()
        elif self.leading and (held is False or time.monotonic() >= self._lease_deadline):
            await self._step_down("another replica holds the lease" if held is False else "lease not renewed")
        return self.leading

    async def _step_up(self) -> None:
        self.leading = True
        self.leader_changes += 1
        log.info("kvindex_leading", worker=self.worker_id, lease_s=self.config.leader_lease_s)
        try:
            if not await self.index.is_ready():
                self.request_replay(None)
        except _REDIS_ERRORS as e:
            self._redis_failed(e)  # the watchdog re-syncs once Redis is back
        self._lead_tasks = [asyncio.create_task(self._consume_events()), asyncio.create_task(self._sweep_loop())]

    async def _step_down(self, why: str) -> None:
        self.leading = False
        log.warning("kvindex_stepped_down", worker=self.worker_id, reason=why)
        await self._stop_lead_tasks()

    async def _stop_lead_tasks(self) -> None:
        tasks, self._lead_tasks = self._lead_tasks, []
        await _cancel(tasks)
        if self._events_sub is not None:
            # NOTE: left subscribed, the pull subscription held the connection's drain for its whole
            # 5 s bound at every stop; unacked events stay in the durable consumer for the next leader
            sub, self._events_sub = self._events_sub, None
            try:
                await sub.unsubscribe()
            except Exception as e:
                log.warning("kv_events_unsubscribe_failed", error=str(e))

    async def _lead_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.leader_lease_s / 3)
            await self.try_lead()

    # --- background loops -------------------------------------------------------------
    async def _watch_redis(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.redis_check_s)
            await self.check_redis()

    async def _sweep_loop(self) -> None:
        while not self._stopping and self.leading:
            await asyncio.sleep(self.config.sweep_interval_s)
            if not self.redis_ok or not self.leading:
                continue
            try:
                await self.sweep()
            except _REDIS_ERRORS as e:
                self._redis_failed(e)
            except Exception:
                log.exception("kv_sweep_failed")

    async def _consume_events(self) -> None:
        """Fetch and apply events for as long as the service runs. The pull subscription heals
        itself: every ``CONSUMER_CHECK_S`` of fetches that found nothing, and after a fetch error,
        the durable consumer is looked up, and if it (or its stream) is gone, both are created
        again and the index re-synced from the files, since the events in the lost stream are gone
        too. (A fetch from a deleted consumer only times out: without the check the index would
        silently take no more events.)"""
        js = self.mesh.nc.jetstream()
        psub = await self._subscribe_events(js)
        checked = time.monotonic()
        while psub is not None and not self._stopping and self.leading:
            if not self.redis_ok or time.monotonic() >= self._lease_deadline:  # nothing applied off lease
                await asyncio.sleep(0.2)
                continue
            try:
                msgs = await psub.fetch(batch=64, timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):
                if time.monotonic() - checked >= CONSUMER_CHECK_S:
                    checked = time.monotonic()
                    psub = await self._heal_events(js, psub)
                continue
            except Exception as e:  # NATS reconnecting, or the consumer is gone
                log.debug("kv_events_fetch_failed", error=str(e))
                await asyncio.sleep(0.5)
                psub = await self._heal_events(js, psub)
                continue
            await self._apply_batch(msgs)

    async def _subscribe_events(self, js):
        """The pull subscription on the events stream (both created when missing), retried every
        second until JetStream answers; None once the service stops or no longer leads."""
        while not self._stopping and self.leading:
            try:
                await ensure_kv_events_stream(js)
                self._events_sub = await js.pull_subscribe(
                    subjects.KV_EVENTS_ALL, durable=self.config.durable, stream=subjects.KV_EVENTS_STREAM)
                return self._events_sub
            except Exception as e:  # JetStream not reachable yet
                log.warning("kv_events_subscribe_failed", error=str(e))
                await asyncio.sleep(1.0)
        return None

    async def _heal_events(self, js, psub):
        """``psub`` if its consumer still exists (or JetStream cannot tell now), else a new one."""
        try:
            await js.consumer_info(subjects.KV_EVENTS_STREAM, self.config.durable)
            return psub
        except NotFoundError:
            pass
        except Exception as e:  # NATS reconnecting: look again later
            log.debug("kv_events_consumer_check_failed", error=str(e))
            return psub
        log.warning("kv_events_consumer_lost", stream=subjects.KV_EVENTS_STREAM, durable=self.config.durable)
        try:
            await psub.unsubscribe()
        except Exception:
            pass
        psub = await self._subscribe_events(js)
        self.request_replay(None)  # what the lost stream held is lost: re-sync from the files
        self.consumer_recreated += 1
        return psub

    async def _apply_batch(self, msgs) -> None:
        for i, msg in enumerate(msgs):
            try:
                ev = unpack(msg.data, expect=KVEvent)
            except ProtocolError as e:
                log.warning("kv_event_undecodable", error=str(e))
                await msg.term()
                continue
            try:
                await self.apply_event(ev)
            except _REDIS_ERRORS as e:
                self._redis_failed(e)
                for m in msgs[i:]:  # redelivered, in order, once Redis is back
                    await m.nak(delay=self.config.redis_check_s)
                return
            except Exception:
                log.exception("kv_event_failed", worker=ev.worker_id, event_id=ev.event_id)
            await msg.ack()

    async def metric_families(self) -> list:
        """The storage tier's size and the lookups by traffic class, as ``on_health`` reports them."""
        from deepinfer.telemetry.metrics import kvindex_families

        return [*await super().metric_families(), *kvindex_families(await self.on_health(KVIndexHealthRequest()))]

    # --- lifecycle ------------------------------------------------------------------
    async def finish_inflight(self) -> None:
        # NOTE: nats-py may turn a cancellation inside fetch() into another error, so the
        # loops also check _stopping, and the wait is bounded.
        self._stopping = True
        await _cancel([t for t in [*self._tasks, self._replay_task] if t is not None])
        await self._stop_lead_tasks()
        if self.leading and self.redis_ok:  # the next replica takes over now, not after the lease
            try:
                await asyncio.wait_for(self.index.resign(self.worker_id), 1.0)
            except _REDIS_ERRORS:
                pass
            self.leading = False

    async def teardown(self) -> None:
        if self.redis is not None:
            try:
                await self.redis.aclose()
            except Exception:
                pass


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait for them, at most 3 s (logged if some did not stop)."""
    for t in tasks:
        t.cancel()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=3.0)
        if pending:
            log.warning("kvindex_tasks_did_not_stop", tasks=len(pending))


def main(argv: list[str] | None = None) -> None:
    p = service_parser("kvindex", "KV prefix index over Redis: events, lookups, retention, capacity")
    env = os.environ.get
    p.add_argument("--redis-url", default=env("DEEPINFER_REDIS_URL", "redis://127.0.0.1:6379"),
                   help="Redis URL: redis://host:port or redis+sentinel://host:port[,host:port]/service (env DEEPINFER_REDIS_URL)")
    p.add_argument("--kv-root", default=env("DEEPINFER_KV_ROOT", os.path.expanduser("~/.cache/deepinfer/kvstore")),
                   help="storage tier root directory (env DEEPINFER_KV_ROOT)")
    default_ret = ",".join(f"{k}={v / 86400:g}d" for k, v in DEFAULT_RETENTION_S.items())
    p.add_argument("--retention", type=parse_retention, default=parse_retention(env("DEEPINFER_KV_RETENTION", default_ret)),
                   help=f"CLASS=DURATION,... after last use, over the defaults {default_ret} (env DEEPINFER_KV_RETENTION)")
    p.add_argument("--default-retention", type=parse_duration, default=parse_duration(env("DEEPINFER_KV_DEFAULT_RETENTION", "7d")),
                   help="retention of classes not listed (default 7d)")
    p.add_argument("--capacity", type=parse_size, default=parse_size(env("DEEPINFER_KV_CAPACITY", "0")),
                   help="bytes the storage tier may hold, e.g. 100G; LRU eviction beyond (env DEEPINFER_KV_CAPACITY; 0 = no limit)")
    p.add_argument("--sweep-interval", type=parse_duration, default=parse_duration("60s"),
                   help="time between retention/capacity sweeps (default 60s)")
    p.add_argument("--ephemeral-ttl", type=parse_duration, default=parse_duration("1h"),
                   help="age after which orphan ephemeral blocks are deleted (default 1h)")
    p.add_argument("--block-tokens", type=int, default=int(env("DEEPINFER_BLOCK_SIZE", "16")),
                   help="tokens per block when an event or file does not say (default 16)")
    p.add_argument("--redis-prefix", default="deepinfer:kv:", help="prefix of this index's Redis keys")
    p.add_argument("--leader-lease", type=parse_duration, default=parse_duration("3s"),
                   help="the leader replica's Redis lease (default 3s): a new leader takes over within ~1.3x that")
    args = p.parse_args(argv)
    config = IndexConfig(kv_root=args.kv_root, retention_s={**DEFAULT_RETENTION_S, **args.retention}, default_retention_s=args.default_retention,
                         capacity_bytes=args.capacity, sweep_interval_s=args.sweep_interval,
                         ephemeral_ttl_s=args.ephemeral_ttl, default_block_tokens=args.block_tokens,
                         redis_prefix=args.redis_prefix, leader_lease_s=args.leader_lease)
    run_service(KVIndexService(args.nats, args.redis_url, config, args.worker_id), args.log_level,
                metrics_port=args.metrics_port)
