"""Redis behind Sentinel: ``redis+sentinel://`` URLs, and the kvindex and the gateway's response
store carrying on through a failover (master killed, its replica promoted).

Each test of the failover starts its own master, replica and one Sentinel (quorum 1) on free
ports; the Sentinel declares the master down after 500 ms.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest
from test_kvindex import BLOCK_BYTES, FP, FakeClock, applied, chain, kv_nats, write_blocks  # noqa: F401 (fixture)

from deepinfer.gateway.response_store import ResponseStore
from deepinfer.kvindex.config import IndexConfig
from deepinfer.kvindex.service import KVIndexService
from deepinfer.kvstore import BlockStore, KVIndexClient
from deepinfer.kvstore.redis_client import SentinelURL, describe, parse_sentinel_url, redis_client
from deepinfer.launcher import ManagedProcess, free_port, redis_server_binary, start_redis, wait_for_port
from deepinfer.mesh import MeshClient

SERVICE = "deepinfer-test"


def test_sentinel_urls_parse_and_bad_ones_say_what_is_wrong():
    assert parse_sentinel_url("redis+sentinel://10.0.0.1:26380,10.0.0.2/mymaster/2") == SentinelURL(
        (("10.0.0.1", 26380), ("10.0.0.2", 26379)), "mymaster", 2)
    u = parse_sentinel_url("redis+sentinel://:s%40cret@h1/svc")
    assert (u.username, u.password, u.db, u.sentinels) == (None, "s@cret", 0, (("h1", 26379),))
    assert parse_sentinel_url("redis+sentinel://bob:pw@h1:1/svc").username == "bob"
    for bad, says in [("redis://h/0", "not a redis+sentinel"), ("redis+sentinel://h1", "/<service>"),
                      ("redis+sentinel://h1/svc/x", "not a number"), ("redis+sentinel://h1:xx/svc", "port"),
                      ("redis+sentinel://,h1/svc", "without a host"), ("redis+sentinel://h1/a/1/2", "/<service>")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_sentinel_url(bad)
    assert describe("redis+sentinel://:pw@h1/svc") == "redis+sentinel://:***@h1/svc"
    assert describe("redis://h:1/0") == "redis://h:1/0"


async def test_a_plain_url_gives_a_plain_client(redis_url):
    r = redis_client(redis_url, decode_responses=True)
    try:
        await r.set("sentinel-test:plain", "1")
        assert await r.get("sentinel-test:plain") == "1"
    finally:
        await r.aclose()


class SentinelGroup:
    """A master, one replica and one Sentinel watching them as ``SERVICE``."""

    def __init__(self, workdir: Path):
        self.master = start_redis(workdir / "master")
        self.replica = start_redis(workdir / "replica", extra_args=("--replicaof", "127.0.0.1", str(self.master.port)))
        self.sentinel_port = free_port()
        conf = workdir / "sentinel.conf"  # Sentinel rewrites its config file: it must be its own
        conf.write_text(f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {workdir}\n"
                        f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 1\n"
                        f"sentinel down-after-milliseconds {SERVICE} 500\n"
                        f"sentinel failover-timeout {SERVICE} 5000\n")
        self.sentinel = ManagedProcess("sentinel", [redis_server_binary(), str(conf), "--sentinel"],
                                       workdir / "sentinel.log")
        wait_for_port(self.sentinel_port, self.sentinel, 20)
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}"

    async def ready(self) -> None:
        """Wait until the replica is in sync and the Sentinel knows it (a failover needs both)."""
        import redis.asyncio as aioredis

        s = aioredis.Redis(port=self.sentinel_port, decode_responses=True, socket_timeout=2)
        try:
            await until(lambda: _replicas_known(s), timeout=30)
        finally:
            await s.aclose()

    def kill_master(self) -> None:
        os.kill(self.master.pid, signal.SIGKILL)

    def stop(self) -> None:
        for p in (self.sentinel, self.replica, self.master):
            p.stop()


async def _replicas_known(s) -> bool:
    replicas = await s.sentinel_slaves(SERVICE)
    return any("s_down" not in r.get("flags", "") and r.get("master-link-status") == "ok" for r in replicas)


async def until(fn, timeout: float, interval: float = 0.1):
    """Await ``fn()`` until truthy (exceptions count as not yet); fail after ``timeout`` s."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            value = await asyncio.wait_for(fn(), 5)
            if value:
                return value
            last = value
        except Exception as e:
            last = e
        await asyncio.sleep(interval)
    raise AssertionError(f"not within {timeout} s (last: {last!r})")


@pytest.fixture
async def sentinel_group(tmp_path):
    group = SentinelGroup(tmp_path)
    try:
        await group.ready()
        yield group
    finally:
        group.stop()


@pytest.mark.timeout(120)
async def test_kvindex_and_response_store_carry_on_through_a_sentinel_failover(sentinel_group, tmp_path, kv_nats):
    url = sentinel_group.url
    config = IndexConfig(kv_root=str(tmp_path / "kv"), redis_prefix=f"t-{uuid.uuid4().hex[:8]}:",
                         redis_check_s=0.1, sweep_interval_s=3600.0, leader_lease_s=1.0)
    svc = KVIndexService(kv_nats, url, config, worker_id="kvindex-s", clock=FakeClock())
    await svc.start()
    mesh = await MeshClient.connect(kv_nats, "prefill-s")
    store_api = ResponseStore(url)
    try:
        client = KVIndexClient(mesh, "prefill-s", FP, lookup_timeout_s=1.0)
        blocks = BlockStore(tmp_path / "kv", FP)
        before = chain(2, salt=1)
        write_blocks(blocks, before)
        client.publish_stored(before, "chat", BLOCK_BYTES, 16)
        await applied(svc, 1)
        assert await client.lookup(before, "chat", 32) == 2
        await store_api.put({"id": "resp_1", "object": "response"}, [{"role": "user", "content": "hi"}])
        await svc.redis.execute_command("WAIT", 1, 2000)  # the replica has all of it

        t0 = time.monotonic()
        sentinel_group.kill_master()
        await until(lambda: _lookup_is(client, before, 2), timeout=30)
        print(f"\nkvindex answered from the promoted replica {time.monotonic() - t0:.1f} s after the master died")
        assert (await store_api.get("resp_1"))["context"] == [{"role": "user", "content": "hi"}]
        after = chain(2, salt=2)
        write_blocks(blocks, after)
        client.publish_stored(after, "chat", BLOCK_BYTES, 16)
        await until(lambda: _lookup_is(client, after, 2), timeout=20)
        assert svc.leading
    finally:
        await store_api.aclose()
        await mesh.close()
        await svc.stop()


async def _lookup_is(client, hashes, n) -> bool:
    return await client.lookup(hashes, "chat", 16 * n) == n

