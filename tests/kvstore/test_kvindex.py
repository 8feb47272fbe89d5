"""kvindex: lookups, KV events (gaps -> re-sync from the storage tier), retention, capacity, Redis faults.

Each test runs the service in-process against a private nats-server (the KV
events stream and its durable consumer are per server) and the session's
redis-server under a key prefix of its own, with a fake clock.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from deepinfer.kvindex.config import IndexConfig, parse_duration, parse_retention, parse_size
from deepinfer.kvindex.index import classify_event_id
from deepinfer.kvindex.service import KVIndexService
from deepinfer.kvstore import BlockStore, KVIndexClient, block_hashes
from deepinfer.kvstore.format import EPHEMERAL
from deepinfer.kvstore.redis_client import redis_client
from deepinfer.kvstore.store import ephemeral_key
from deepinfer.launcher import start_nats, start_redis
from deepinfer.mesh import MeshClient
from deepinfer.protocol import KVEvent, KVIndexHealth, KVLookupRequest, pack, subjects, unpack
from waiting import eventually

FP = "fp0123456789abcd"
DAY = 86400.0
BLOCK = torch.zeros(2, 2, 16, 1, 4)  # [layers, k/v, tokens, heads, dim]: 1 KiB of float32
BLOCK_BYTES = BLOCK.numel() * 4


class FakeClock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def chain(n: int, salt: int = 0) -> list[str]:
    return block_hashes([salt * 1000 + i for i in range(16 * n)], 16, FP)


@pytest.fixture
def kv_nats(tmp_path):
    proc = start_nats(tmp_path / "nats")
    yield proc.url
    proc.stop()


@pytest.fixture
async def make_index(kv_nats, redis_url, tmp_path):
    """``await make_index(clock, redis_url=..., **IndexConfig fields)`` -> (service, client, store, redis)."""
    made = []

    async def _make(clock, redis=None, worker_id="kvindex-test", redis_prefix=None, **cfg):
        prefix = redis_prefix or f"test-{uuid.uuid4().hex[:8]}:"
        cfg.setdefault("sweep_interval_s", 3600.0)
        config = IndexConfig(kv_root=str(tmp_path / "kv"), redis_prefix=prefix, redis_check_s=0.1, **cfg)
        svc = KVIndexService(kv_nats, redis or redis_url, config, worker_id=worker_id, clock=clock)
        await svc.start()
        mesh = await MeshClient.connect(kv_nats, "prefill-test")
        client = KVIndexClient(mesh, "prefill-test", FP, lookup_timeout_s=1.0)
        r = redis_client(redis or redis_url, decode_responses=True)
        made.append((svc, mesh, r))
        return svc, client, BlockStore(tmp_path / "kv", FP), r

    yield _make
    for svc, mesh, r in made:
        await svc.stop()
        await mesh.close()
        await r.aclose()


async def applied(svc: KVIndexService, n: int) -> None:
    await eventually(lambda: _ge(svc.events_applied, n))


async def _ge(a, b):
    return a >= b


def write_blocks(store: BlockStore, hashes: list[str], cls: str = "chat") -> None:
    for h in hashes:
        store.put(h, BLOCK, cls, num_tokens=16)


async def block_keys(r, svc: KVIndexService, cls: str, h: str) -> int:
    """How many of the block's Redis records exist (hash, LRU entry, class entry): 0 or 3."""
    p = svc.config.redis_prefix
    return (await r.exists(f"{p}b:{cls}:{h}") + (await r.zscore(f"{p}lru", f"{cls}:{h}") is not None)
            + (await r.zscore(f"{p}c:{cls}", h) is not None))


# ------------------------------------------------------------------------ pure parts


def test_event_ids_classify_duplicates_gaps_and_restarts():
    assert classify_event_id(None, "e1", 1) == "ok"
    assert classify_event_id(None, "e1", 4) == "gap"  # events of an unknown worker were missed
    assert classify_event_id("e1:4", "e1", 5) == "ok"
    assert classify_event_id("e1:4", "e1", 4) == "dup"
    assert classify_event_id("e1:4", "e1", 7) == "gap"
    assert classify_event_id("e1:4", "e2", 1) == "ok"  # the worker restarted
    assert classify_event_id("e1:4", "e2", 3) == "gap"


def test_config_parsers():
    assert parse_retention("agent=3d, chat=12h") == {"agent": 3 * DAY, "chat": 12 * 3600.0}
    assert parse_duration("90") == 90 and parse_size("1.5G") == 3 << 29 and parse_size("512MiB") == 512 << 20
    with pytest.raises(ValueError):
        parse_retention("agent")


def test_kv_messages_roundtrip():
    ev = KVEvent(kind="stored", worker_id="w", event_id=3, block_hashes=["ab"], block_bytes=10, block_tokens=16,
                 fingerprint=FP, epoch="e")
    assert unpack(pack(ev)) == ev
    assert unpack(pack(KVLookupRequest(["ab"], "agent", 40))).num_tokens == 40
    h = KVIndexHealth("k", True, hit_stats={"chat": {"lookups": 2, "queried_tokens": 100, "hit_tokens": 25}})
    assert unpack(pack(h)).hit_rate("chat") == 0.25 and h.hit_rate("agent") == 0.0


# ---------------------------------------------------------------------------- lookups


async def test_lookup_answers_the_longest_stored_prefix_and_counts_hit_tokens(make_index):
    svc, client, store, _ = await make_index(FakeClock())
    h = chain(4)
    write_blocks(store, h[:3])
    client.publish_stored(h[:3], "chat", block_bytes=BLOCK_BYTES, block_tokens=16)
    await applied(svc, 1)

    assert await client.lookup(h, "chat", num_tokens=70) == 3  # 48 of 70 tokens cached
    assert await client.lookup([h[0], h[1], h[3], h[2]], "chat", num_tokens=64) == 2  # 32 of 64
    assert await client.lookup([h[3], h[0]], "chat", num_tokens=32) == 0
    assert await client.lookup(h, "agent", num_tokens=64) == 0  # another class: other files
    health = await client.health()
    assert health.redis_ok and health.num_blocks == 3 and health.total_bytes == 3 * BLOCK_BYTES
    assert health.hit_stats["chat"] == {"lookups": 3, "queried_tokens": 166, "hit_tokens": 80}
    assert health.hit_stats["agent"] == {"lookups": 1, "queried_tokens": 64, "hit_tokens": 0}

    client.publish_removed([h[1]], "chat")
    await applied(svc, 2)
    assert await client.lookup(h, "chat", num_tokens=64) == 1


async def test_client_lookup_is_a_miss_when_no_kvindex_runs(kv_nats):
    mesh = await MeshClient.connect(kv_nats, "lonely")
    try:
        client = KVIndexClient(mesh, "prefill-x", FP)
        t0 = time.monotonic()
        assert await client.lookup(chain(2), "chat", 32) == 0
        assert time.monotonic() - t0 < 1.0
        assert client.publish_stored(chain(1), "chat") == 1  # creates the stream; never raises
        assert client.publish_stored(chain(1), "chat") == 2
        assert await client.flush() and client.publish_errors == 0
    finally:
        await mesh.close()


async def test_publishing_never_waits_on_jetstream_and_a_full_queue_drops_counted(kv_nats, monkeypatch):
    """A stalled stream (a leader election, NATS gone) holds up no caller: events queue (their ids
    taken in call order) and one task sends them in order; beyond the queue's bound the next events
    are dropped and counted (the kvindex sees their ids as a gap and re-syncs)."""
    from deepinfer.kvstore import index_client

    monkeypatch.setattr(index_client, "MAX_QUEUED_EVENTS", 3)
    mesh = await MeshClient.connect(kv_nats, "stalled")
    try:
        client = KVIndexClient(mesh, "prefill-stalled", FP)
        release, sent = asyncio.Event(), []

        async def stalled_publish(subject, data, **kw):
            await release.wait()
            sent.append(unpack(data).event_id)

        monkeypatch.setattr(client._js, "publish", stalled_publish)
        t0 = time.monotonic()
        ids = [client.publish_stored(chain(1, salt=i), "chat") for i in range(5)]
        assert ids == [1, 2, 3, 4, 5] and time.monotonic() - t0 < 0.05
        assert client.dropped_events == 2  # 3 queued, 2 over the bound
        assert not await client.flush(timeout=0.2)  # still stalled
        release.set()
        assert await client.flush(timeout=2)
        assert sent == [1, 2, 3] and client.publish_errors == 0
        await client.close()
    finally:
        await mesh.close()


async def test_a_lost_events_stream_is_created_again_and_the_index_resyncs(make_index, monkeypatch):
    """The events stream deleted under a running kvindex (a JetStream reset): its consumer is found
    gone, both are created again, the index re-syncs from the files (what the lost stream held is
    lost) and takes new events, instead of silently taking none."""
    from deepinfer.kvindex import service as kvindex_service

    monkeypatch.setattr(kvindex_service, "CONSUMER_CHECK_S", 0.2)
    svc, client, store, _ = await make_index(FakeClock())
    first, lost, after = chain(1, salt=1), chain(1, salt=2), chain(1, salt=3)
    write_blocks(store, first)
    client.publish_stored(first, "chat", BLOCK_BYTES, 16)
    await applied(svc, 1)
    await client.mesh.nc.jetstream().delete_stream(subjects.KV_EVENTS_STREAM)
    write_blocks(store, lost)  # its event went nowhere: the stream was gone (the file is there)
    await eventually(lambda: _ge(svc.consumer_recreated, 1))
    await svc.replay_idle()
    assert await client.lookup(lost, "chat", 16) == 1  # found by the re-sync
    write_blocks(store, after)
    client.publish_stored(after, "chat", BLOCK_BYTES, 16)  # into the stream created again
    await eventually(lambda: client.lookup(after, "chat", 16))


async def test_a_block_reported_damaged_is_deleted_by_the_kvindex_only_if_it_still_is(make_index):
    """A worker that failed to verify a block reports it removed; the kvindex reads the file again
    and deletes it if still damaged, and keeps it if it now reads well (the worker saw a stale
    version, or another host rewrote it)."""
    svc, client, store, _ = await make_index(FakeClock())
    damaged, fine = chain(1, salt=7), chain(1, salt=8)
    write_blocks(store, damaged + fine)
    path = store.path(damaged[0], "chat")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    client.publish_removed(damaged + fine, "chat")
    await applied(svc, 1)
    assert not path.exists() and store.path(fine[0], "chat").exists()


# ----------------------------------------------------------- re-sync from the storage tier


async def test_empty_index_is_built_from_the_storage_tier_at_start(make_index, tmp_path):
    h = chain(3)
    write_blocks(BlockStore(tmp_path / "kv", FP), h[:2])
    svc, client, _, _ = await make_index(FakeClock())
    assert svc.replays == 1
    assert await client.lookup(h, "chat", 48) == 2


async def test_event_id_gap_triggers_replay_from_the_storage_tier(make_index):
    clock = FakeClock()
    svc, client, store, _ = await make_index(clock)
    assert svc.replays == 1  # the (empty) start-up build
    on_disk_only = chain(2, salt=1)
    write_blocks(store, on_disk_only)  # written while its events were lost
    ghost = chain(1, salt=2)  # indexed, but its file is gone
    client.publish_stored(ghost, "chat", BLOCK_BYTES, 16)
    await applied(svc, 1)
    assert await client.lookup(on_disk_only, "chat", 32) == 0
    assert await client.lookup(ghost, "chat", 16) == 1

    clock.advance(10)
    client._next_id += 1  # event 2 never reaches the stream
    kept = chain(1, salt=3)
    write_blocks(store, kept)
    client.publish_stored(kept, "chat", BLOCK_BYTES, 16)  # event 3: a gap
    await applied(svc, 2)
    await svc.replay_idle()
    assert svc.gaps == 1 and svc.replays == 2
    assert await client.lookup(on_disk_only, "chat", 32) == 2  # found on disk
    assert await client.lookup(ghost, "chat", 16) == 0  # dropped: no file
    assert await client.lookup(kept, "chat", 16) == 1


# ---------------------------------------------------------------- retention and capacity


async def test_retention_expires_each_class_after_last_use_files_and_redis_together(make_index):
    clock = FakeClock()
    svc, client, store, r = await make_index(clock, retention_s={"agent": 3 * DAY, "chat": 7 * DAY})
    agent, chat = chain(2, salt=1), chain(2, salt=2)
    write_blocks(store, agent, "agent")
    write_blocks(store, chat, "chat")
    client.publish_stored(agent, "agent", BLOCK_BYTES, 16)
    client.publish_stored(chat, "chat", BLOCK_BYTES, 16)
    await applied(svc, 2)

    clock.advance(3 * DAY - 1)
    assert (await svc.sweep())["expired"] == 0
    clock.advance(2)  # agent blocks: 3 days since last use
    assert (await svc.sweep())["expired"] == 2
    for h in agent:
        assert not store.contains(h, "agent") and await block_keys(r, svc, "agent", h) == 0
    for h in chat:
        assert store.contains(h, "chat") and await block_keys(r, svc, "chat", h) == 3

    assert await client.lookup(chat[:1], "chat", 16) == 1  # day 3: chat[0] used again
    clock.advance(4 * DAY)  # day 7 + 1 s: chat[1] expires, chat[0] (used on day 3) lives on
    assert (await svc.sweep())["expired"] == 1
    assert store.contains(chat[0], "chat") and await block_keys(r, svc, "chat", chat[0]) == 3
    assert not store.contains(chat[1], "chat") and await block_keys(r, svc, "chat", chat[1]) == 0
    clock.advance(3 * DAY)  # day 10 + 1 s
    assert (await svc.sweep())["expired"] == 1
    assert not store.contains(chat[0], "chat") and await block_keys(r, svc, "chat", chat[0]) == 0
    assert (await client.health()).total_bytes == 0


async def test_the_sweep_removes_old_ephemeral_blocks_and_temporary_files_of_dead_writers(make_index):
    """An ephemeral block decode never picked up, and a ``.tmp-`` file a writer killed mid-write left,
    are deleted once older than ``ephemeral_ttl_s``; younger ones (a write in progress) are kept."""
    clock = FakeClock()
    svc, _, store, _ = await make_index(clock, ephemeral_ttl_s=3600.0)
    store.put(ephemeral_key("req-1", 0), BLOCK, EPHEMERAL, num_tokens=16)
    store.put(ephemeral_key("req-2", 0), BLOCK, EPHEMERAL, num_tokens=16)
    old_eph = store.path(ephemeral_key("req-1", 0), EPHEMERAL)
    young_eph = store.path(ephemeral_key("req-2", 0), EPHEMERAL)
    shard = store.path(chain(1)[0], "chat").parent
    shard.mkdir(parents=True, exist_ok=True)
    old_tmp, young_tmp = shard / ".tmp-dead", shard / ".tmp-writing"
    old_tmp.write_bytes(b"half a block")
    young_tmp.write_bytes(b"a block being written")
    for path, age in ((old_eph, 7200), (young_eph, 60), (old_tmp, 7200), (young_tmp, 60)):
        os.utime(path, (clock.t - age, clock.t - age))
    assert (await svc.sweep())["ephemeral"] == 2
    assert not old_eph.exists() and not old_tmp.exists() and young_eph.exists() and young_tmp.exists()


async def test_capacity_evicts_least_recently_used_files_and_redis_together(make_index):
    clock = FakeClock()
    svc, client, store, r = await make_index(clock, capacity_bytes=3 * BLOCK_BYTES)
    b = [chain(1, salt=i)[0] for i in range(4)]
    for i in range(3):
        write_blocks(store, [b[i]])
        client.publish_stored([b[i]], "chat", BLOCK_BYTES, 16)
        await applied(svc, i + 1)
        clock.advance(1)
    assert await client.lookup([b[0]], "chat", 16) == 1  # b0 used again: b1 is now the oldest
    clock.advance(1)
    write_blocks(store, [b[3]])
    client.publish_stored([b[3]], "chat", BLOCK_BYTES, 16)
    await applied(svc, 4)

    assert not store.contains(b[1], "chat") and await block_keys(r, svc, "chat", b[1]) == 0
    for h in (b[0], b[2], b[3]):
        assert store.contains(h, "chat") and await block_keys(r, svc, "chat", h) == 3
    health = await client.health()
    assert health.total_bytes == 3 * BLOCK_BYTES and health.num_blocks == 3


# ------------------------------------------------------------------------------ faults


async def test_redis_outage_answers_misses_fast_reports_it_and_recovers(make_index, tmp_path):
    redis_proc = start_redis(tmp_path / "redis-1")
    port = redis_proc.port
    try:
        h = chain(3)
        write_blocks(BlockStore(tmp_path / "kv", FP), h)
        svc, client, _, _ = await make_index(FakeClock(), redis=redis_proc.url)
        assert await client.lookup(h, "chat", 48) == 3

        redis_proc.stop()
        t0 = time.monotonic()
        assert await client.lookup(h, "chat", 48) == 0
        assert time.monotonic() - t0 < 0.5
        health = await client.health()
        assert health is not None and health.redis_ok is False and health.num_blocks == -1

        redis_proc = start_redis(tmp_path / "redis-2", port=port)  # back, empty
        await eventually(lambda: _redis_ok(client), timeout=10)
        assert await eventually(lambda: client.lookup(h, "chat", 48)) == 3  # rebuilt from the files
    finally:
        redis_proc.stop()


async def _health_with_redis(client: KVIndexClient):
    health = await client.health(timeout=0.5)
    return health if health and health.redis_ok else None


async def _redis_ok(client: KVIndexClient) -> bool:
    health = await client.health()
    return bool(health and health.redis_ok)


# -------------------------------------------------------------------------- as a process


async def test_kvindex_runs_as_a_module(kv_nats, redis_url, tmp_path):
    env = dict(os.environ, DEEPINFER_KV_ROOT=str(tmp_path / "kv"))
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.kvindex", "--nats-url", kv_nats, "--redis-url", redis_url,
                             "--redis-prefix", f"proc-{uuid.uuid4().hex[:8]}:", "--worker-id", "kvindex-p"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    mesh = await MeshClient.connect(kv_nats, "probe")
    try:
        client = KVIndexClient(mesh, "prefill-p", FP)
        # health is answered from setup on; redis_ok turns true after the first ping (and replay)
        health = await eventually(lambda: _health_with_redis(client), timeout=20)
        assert health.worker_id == "kvindex-p"
    finally:
        await mesh.close()
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert proc.returncode == 0, out.decode()[-2000:]


# ---------------------------------------------------------------------------- replicas


async def test_replicas_share_one_leader_that_alone_applies_events_and_all_answer_lookups(make_index):
    """Two replicas over one Redis: one holds the lease and applies every event (in order: one
    consumer), both answer lookups from the same index; on a clean stop the leader gives the lease
    up and the other takes over at once, with the events where the old one left them."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    a, client, store, r = await make_index(FakeClock(), worker_id="kvindex-a", redis_prefix=prefix,
                                           leader_lease_s=1.0)
    b, _, _, _ = await make_index(FakeClock(), worker_id="kvindex-b", redis_prefix=prefix, leader_lease_s=1.0)
    assert (a.leading, b.leading) == (True, False)
    assert await r.get(f"{prefix}leader") == "kvindex-a"
    await asyncio.sleep(1.5)  # longer than the lease: the leader renews it, the other never takes it
    assert (a.leading, b.leading) == (True, False) and (a.leader_changes, b.leader_changes) == (1, 0)
    first = chain(2, salt=1)
    write_blocks(store, first)
    client.publish_stored(first, "chat", BLOCK_BYTES, 16)
    await applied(a, 1)
    assert b.events_applied == 0
    for svc in (a, b):  # each replica's own lookup handler reads the shared index
        reply = await svc.on_lookup(KVLookupRequest(hashes=first, traffic_class="chat", num_tokens=32))
        assert reply.num_blocks == 2
    health = await client.health()
    assert health.leader == "kvindex-a"

    t0 = time.monotonic()
    await a.stop()  # resigns: b takes over on its next renewal (a third of the lease)
    await eventually(lambda: _is(b, "leading"), timeout=3)
    assert time.monotonic() - t0 < 1.5
    second = chain(2, salt=2)
    write_blocks(store, second)
    client.publish_stored(second, "chat", BLOCK_BYTES, 16)
    await applied(b, 1)
    assert await client.lookup(second, "chat", 32) == 2


async def test_a_leader_that_cannot_renew_steps_down_and_applies_nothing(make_index, monkeypatch):
    """A leader whose renewals fail (Redis unreachable for it alone) stops consuming once its lease
    would have run out, while another replica takes the lease over in Redis."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    a, client, store, r = await make_index(FakeClock(), worker_id="kvindex-a", redis_prefix=prefix,
                                           leader_lease_s=0.6)
    b, _, _, _ = await make_index(FakeClock(), worker_id="kvindex-b", redis_prefix=prefix, leader_lease_s=0.6)
    assert a.leading and not b.leading

    async def unreachable(*_a, **_k):
        raise ConnectionError("partitioned")

    monkeypatch.setattr(a.index, "lead", unreachable)
    monkeypatch.setattr(a, "check_redis", lambda: _false())  # its watchdog must not mark Redis up again
    await eventually(lambda: _is(b, "leading"), timeout=3)
    await eventually(lambda: _not(a, "leading"), timeout=3)
    assert await r.get(f"{prefix}leader") == "kvindex-b"
    hashes = chain(1, salt=3)
    write_blocks(store, hashes)
    client.publish_stored(hashes, "chat", BLOCK_BYTES, 16)
    await applied(b, 1)
    assert a.events_applied == 0


async def test_a_killed_leader_process_is_replaced_within_the_lease(kv_nats, redis_url, tmp_path):
    """Two kvindex processes; the leader is SIGKILLed (no resign): the other takes the lease once it
    runs out (~1.3 leases) and applies the events published meanwhile."""
    env = dict(os.environ, DEEPINFER_KV_ROOT=str(tmp_path / "kv"))
    prefix = f"proc-{uuid.uuid4().hex[:8]}:"
    procs = {w: subprocess.Popen([sys.executable, "-m", "deepinfer.kvindex", "--nats-url", kv_nats,
                                  "--redis-url", redis_url, "--redis-prefix", prefix, "--worker-id", w,
                                  "--leader-lease", "1s"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL) for w in ("kvindex-p", "kvindex-q")}
    mesh = await MeshClient.connect(kv_nats, "probe")
    try:
        client = KVIndexClient(mesh, "prefill-p", FP)
        leader = (await eventually(lambda: _leader(client), timeout=30)).leader
        other = next(w for w in procs if w != leader)
        procs[leader].kill()
        procs[leader].wait(timeout=10)
        t0 = time.monotonic()
        await eventually(lambda: _leader(client, other), timeout=10)
        took = time.monotonic() - t0
        assert took < 1.3 * 1.0 + 1.0, took  # the lease, a renewal period, the health round trip
        store = BlockStore(tmp_path / "kv", FP)
        hashes = chain(1, salt=4)
        write_blocks(store, hashes)
        client.publish_stored(hashes, "chat", BLOCK_BYTES, 16)
        assert await eventually(lambda: client.lookup(hashes, "chat", 16), timeout=10) == 1
    finally:
        await mesh.close()
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)


async def _leader(client: KVIndexClient, want: str | None = None):
    health = await client.health(timeout=0.5)
    if health and health.redis_ok and health.leader and (want is None or health.leader == want):
        return health
    return None


async def _is(svc, attr):
    return getattr(svc, attr)


async def _not(svc, attr):
    return not getattr(svc, attr)


async def _false():
    return False


async def test_a_redis_never_reached_is_logged_once_not_kept_quiet(make_index, capsys):
    """A Redis wrong from the start (a bad URL, a password, protected mode) is logged, once: the
    kvindex used to log only a change from up to down, so a Redis never reached left no trace."""
    from deepinfer.launcher import free_port

    svc, client, _, _ = await make_index(FakeClock(), redis=f"redis://127.0.0.1:{free_port()}")
    checks, check_redis = [], svc.check_redis

    async def counted():
        try:
            return await check_redis()
        finally:
            checks.append(svc.redis_ok)

    svc.check_redis = counted  # (the watchdog looks it up at each check)
    await eventually(lambda: len(checks) >= 4)  # several watchdog checks (every 0.1 s), each one failed
    assert not any(checks)
    assert not svc.redis_ok and not svc.leading
    assert capsys.readouterr().out.count("redis_down") == 1
