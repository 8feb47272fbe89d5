"""A worker's side of the kvindex: prefix lookups and KV events. Never raises into the caller.

    worker                                   kvindex (services/kvindex)
    ------                                   -------
    lookup(hashes) --KVLookupRequest (queue group kvindex)--> longest stored prefix
                   <--KVLookupReply(num_blocks)---------------
    publish_stored / publish_removed / publish_cleared
                   --KVEvent--> JetStream stream DEEPINFER_KV_EVENTS --> consumed in order

A lookup that times out or finds no kvindex running is a miss (0 blocks).
Events carry this client's ``epoch`` (random per instance) and an event id
counting 1, 2, 3 ... per epoch; a publish that fails is logged and counted
(``publish_errors``) and its id is skipped, which the kvindex sees as a gap
and answers by re-syncing from the storage tier.

Publishing never waits on JetStream: ``publish_*`` queue the event (its id
taken at once, so ids follow the calls' order) and one background task sends
the queue in order. A queue of ``MAX_QUEUED_EVENTS`` drops the next event
(counted, ``dropped_events``; its id is a gap as above), so a stalled stream
(a leader election, NATS down) costs the index a re-sync, never a request's
time. ``flush`` waits for the queue to be sent (a test's, or a draining
worker's, last events).

Lives in libs (not services/kvindex) because worker services use it and
services never import each other.
"""

from __future__ import annotations

import asyncio
import uuid

from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import NoStreamResponseError, NotFoundError

from deepinfer.mesh.client import MeshClient, MeshError, stream_replicas
from deepinfer.protocol import (
    KVEvent,
    KVIndexHealth,
    KVIndexHealthRequest,
    KVLookupReply,
    KVLookupRequest,
    ProtocolError,
    pack,
    subjects,
)
from deepinfer.telemetry import get_logger, inject_headers

log = get_logger(__name__)

KV_EVENTS_MAX_AGE_S = 24 * 3600.0  # events older than this are dropped from the stream (the index re-syncs)
KV_EVENTS_MAX_BYTES = 256 << 20
MAX_QUEUED_EVENTS = 10_000  # events waiting to be sent; beyond this new ones are dropped (counted)


async def ensure_kv_events_stream(js) -> None:
    """Create the KV events stream if it does not exist, with ``stream_replicas()`` replicas
    (idempotent; an existing one is kept as is, with a warning when its replica count differs).

    ``js``: a nats-py JetStream context. Raises nats errors when JetStream is
    unavailable (or has fewer servers than the replicas asked for).
    """
    replicas = stream_replicas()
    try:
        info = await js.stream_info(subjects.KV_EVENTS_STREAM)
        _check_replicas(subjects.KV_EVENTS_STREAM, info.config.num_replicas, replicas)
        return
    except NotFoundError:
        pass
    config = StreamConfig(name=subjects.KV_EVENTS_STREAM, subjects=[subjects.KV_EVENTS_ALL],
                          storage=StorageType.FILE, discard=DiscardPolicy.OLD, num_replicas=replicas,
                          max_age=KV_EVENTS_MAX_AGE_S, max_bytes=KV_EVENTS_MAX_BYTES)
    try:
        await js.add_stream(config)
    except Exception:  # created by another process meanwhile? then it exists now
        await js.stream_info(subjects.KV_EVENTS_STREAM)


_warned_replicas: set[str] = set()


def _check_replicas(name: str, have: int | None, want: int) -> None:
    """Warn (once per stream and process) that an existing stream has another replica count: it is
    kept, since changing it is an operator's decision (``nats stream edit``)."""
    if (have or 1) != want and name not in _warned_replicas:
        _warned_replicas.add(name)
        log.warning("jetstream_replicas_differ", stream=name, replicas=have or 1, wanted=want)


class KVIndexClient:
    """One worker's kvindex client over its ``MeshClient``.

    fingerprint: the model fingerprint of the blocks this worker stores.
    lookup_timeout_s: how long a lookup may wait before counting as a miss.
    publish_timeout_s: how long to wait for JetStream to acknowledge an event.
    """

    def __init__(self, mesh: MeshClient, worker_id: str, fingerprint: str, lookup_timeout_s: float = 0.25,
                 publish_timeout_s: float = 2.0):
        self.mesh = mesh
        self.worker_id = worker_id
        self.fingerprint = fingerprint
        self.lookup_timeout_s = lookup_timeout_s
        self.publish_timeout_s = publish_timeout_s
        self.epoch = uuid.uuid4().hex[:16]
        self.subject = subjects.kv_events(worker_id)
        self.publish_errors = 0
        self.dropped_events = 0
        self.lookup_errors = 0
        self._next_id = 1
        self._queue: asyncio.Queue[KVEvent] = asyncio.Queue()
        self._sender: asyncio.Task | None = None
        self._js = mesh.nc.jetstream()

    async def lookup(self, hashes: list[str], traffic_class: str = "chat", num_tokens: int = 0) -> int:
        """Blocks of ``hashes`` stored as a prefix (0..len(hashes)); 0 on any failure (a miss).

        num_tokens: prompt tokens the caller will use (for hit rates in tokens).
        """
        req = KVLookupRequest(hashes=list(hashes), traffic_class=traffic_class, num_tokens=num_tokens)
        try:
            reply = await self.mesh.request(subjects.KVINDEX_LOOKUP, req, self.lookup_timeout_s,
                                            expect=KVLookupReply)
        except (MeshError, ProtocolError) as e:
            self.lookup_errors += 1
            log.debug("kv_lookup_failed", error=str(e))
            return 0
        return max(0, min(int(reply.num_blocks), len(hashes)))

    async def health(self, timeout: float = 1.0) -> KVIndexHealth | None:
        """The kvindex's health report, or None when none answers in ``timeout`` s."""
        try:
            return await self.mesh.request(subjects.KVINDEX_HEALTH, KVIndexHealthRequest(), timeout,
                                           expect=KVIndexHealth)
        except (MeshError, ProtocolError):
            return None

    def publish_stored(self, hashes: list[str], traffic_class: str = "chat", block_bytes: int = 0,
                       block_tokens: int = 0) -> int:
        """Announce blocks written (or found present) under ``traffic_class``; returns the event id."""
        return self._queue_event("stored", block_hashes=list(hashes), traffic_class=traffic_class,
                                 block_bytes=block_bytes, block_tokens=block_tokens)

    def publish_removed(self, hashes: list[str], traffic_class: str = "chat") -> int:
        """Announce blocks gone or corrupt (the index drops them); returns the event id."""
        return self._queue_event("removed", block_hashes=list(hashes), traffic_class=traffic_class)

    def publish_cleared(self) -> int:
        """Announce that this fingerprint's tier changed wholesale (the index re-syncs); returns the event id."""
        return self._queue_event("cleared")

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait up to ``timeout`` s until every queued event was sent (or failed); False if not."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout`` s), then stop the sender."""
        await self.flush(timeout)
        if self._sender is not None:
            self._sender.cancel()
            self._sender = None

    def _queue_event(self, kind: str, **fields) -> int:
        event_id = self._next_id
        self._next_id += 1
        if self._queue.qsize() >= MAX_QUEUED_EVENTS:
            self.dropped_events += 1
            if self.dropped_events == 1 or self.dropped_events % 1000 == 0:
                log.warning("kv_event_dropped", kind=kind, event_id=event_id, dropped=self.dropped_events)
            return event_id
        self._queue.put_nowait(KVEvent(kind=kind, worker_id=self.worker_id, event_id=event_id,
                                       fingerprint=self.fingerprint, epoch=self.epoch, **fields))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_queued())
        return event_id

    async def _send_queued(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                await self._send(event)
            finally:
                self._queue.task_done()

    async def _send(self, event: KVEvent) -> None:
        data = pack(event)
        for attempt in (1, 2):
            try:
                await self._js.publish(self.subject, data, timeout=self.publish_timeout_s,
                                       stream=subjects.KV_EVENTS_STREAM, headers=inject_headers())
                return
            except Exception as e:  # no stream yet, NATS down, timeout: the index will see a gap
                if attempt == 1 and isinstance(e, NoStreamResponseError):
                    try:
                        await ensure_kv_events_stream(self._js)
                        continue
                    except Exception:
                        pass
                self.publish_errors += 1
                log.warning("kv_event_publish_failed", kind=event.kind, event_id=event.event_id, error=str(e))
                return
