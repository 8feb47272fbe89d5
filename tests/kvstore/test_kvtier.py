"""The shared storage tier end to end: two prefill workers, one kvindex, one storage root.

Requests are sent straight to a chosen prefill worker (``deepinfer.prefill.<id>.submit``)
so a test decides where a prefix is computed and where it is reused. Greedy outputs are
compared with a cold run of the same prompt under another ``cache_salt`` (which can hit
nothing: the salt is mixed into every block hash).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from deepinfer.kvstore import KVIndexClient, block_hashes, model_fingerprint
from deepinfer.launcher import Mesh
from deepinfer.mesh import MeshClient
from deepinfer.models.convert import ensure_default_model
from deepinfer.protocol import PrefillRequest, SamplingParams, SubmitReply, TokenChunk, subjects, unpack

from conftest import MESH_START_TIMEOUT

BS = 16
TEXT = ("A lighthouse keeper logs the weather every hour: wind from the north-west, visibility "
        "good, a fishing boat heading home before the storm. ")


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    m = Mesh(workdir=tmp_path_factory.mktemp("mesh-tier"), replicas={"prefill": 2})
    m.start(timeout=MESH_START_TIMEOUT)
    # healthy needs one prefill worker; the tests address both by id
    for _ in range(MESH_START_TIMEOUT * 4):
        if httpx.get(m.gateway_url + "/health").json()["workers"].get("prefill") == 2:
            break
        time.sleep(0.25)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ensure_default_model(progress=False) / "tokenizer.json"))


def prompt(tok, tag: str, repeats: int = 6) -> list[int]:
    """~170 tokens of shared text per tag, then a short distinct question."""
    return tok.encode(f"[{tag}] " + TEXT * repeats + f"Question about {tag}: what comes next?").ids


def fingerprint() -> str:
    return model_fingerprint(ensure_default_model(progress=False), "float32", BS)


async def run_on(mesh: Mesh, worker: str, ids: list[int], salt: str | None = None, cls: str = "chat",
                 max_tokens: int = 8) -> tuple[list[int], int]:
    """Greedy ``max_tokens`` tokens via prefill worker ``worker``; (tokens, cached prompt tokens)."""
    mc = await MeshClient.connect(mesh.nats_url, "test-kvtier")
    try:
        rid = uuid.uuid4().hex
        subject = subjects.stream(rid)
        chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()

        async def on_chunk(m):
            chunks.put_nowait(unpack(m.data, TokenChunk))

        sub = await mc.nc.subscribe(subject, cb=on_chunk)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        reply = await mc.request(subjects.prefill_submit(worker), PrefillRequest(rid, ids, sp, subject, cls, salt),
                                 10, expect=SubmitReply)
        assert reply.accepted, reply.error
        tokens, cached = [], None
        while True:
            c = await asyncio.wait_for(chunks.get(), 120)
            if c.role == "prefill" and c.token_ids:
                cached = c.num_cached_tokens
            tokens += c.token_ids
            if c.finish_reason:
                break
        assert c.finish_reason == "length", c.error
        await sub.unsubscribe()
        return tokens, cached
    finally:
        await mc.close()


async def wait_indexed(mesh: Mesh, ids: list[int], timeout: float = 20) -> None:
    """Until the kvindex holds every full block of prompt ``ids`` (its events are asynchronous)."""
    mc = await MeshClient.connect(mesh.nats_url, "test-kvtier-lookup")
    try:
        index = KVIndexClient(mc, "test", fingerprint())
        hashes = block_hashes(ids, BS, fingerprint())
        for _ in range(int(timeout * 10)):
            if await index.lookup(hashes) == len(hashes):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"kvindex never held the {len(hashes)} blocks of the prompt")
    finally:
        await mc.close()


def block_file(mesh: Mesh, ids: list[int], index: int, cls: str = "chat"):
    key = block_hashes(ids, BS, fingerprint())[index]
    return mesh.kv_root / fingerprint() / cls / key[:2] / f"{key}.kvb"


async def test_prefix_computed_on_one_worker_is_reused_by_another(tier, tok):
    a = prompt(tok, "shared")
    b = a[:-6] + tok.encode(" Another question: who keeps the log?").ids
    await run_on(tier, "prefill-0", a)
    await wait_indexed(tier, a)
    warm, cached = await run_on(tier, "prefill-1", b)
    shared_blocks = len(a[:-6]) // BS
    assert cached == shared_blocks * BS and cached > 100  # loaded from the tier, not recomputed
    cold, cold_cached = await run_on(tier, "prefill-1", b, salt="someone-else")
    assert cold_cached == 0  # another tenant's salt hits nothing
    assert warm == cold


async def test_corrupt_or_deleted_block_is_a_miss_and_the_answer_stays_correct(tier, tok):
    for how, tag in (("corrupt", "corrupt"), ("delete", "deleted")):
        ids = prompt(tok, tag)
        await run_on(tier, "prefill-0", ids)
        await wait_indexed(tier, ids)
        path = block_file(tier, ids, 3)
        assert path.exists()
        if how == "corrupt":
            data = bytearray(path.read_bytes())
            data[-100] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path.unlink()
        out, cached = await run_on(tier, "prefill-1", ids)
        assert cached == 3 * BS, how  # blocks 0-2 loaded; block 3 is a miss, so is the rest
        cold, _ = await run_on(tier, "prefill-1", ids, salt=f"cold-{how}")
        assert out == cold, how


async def test_unwritable_class_directory_still_answers_correctly(tier, tok):
    """Writes fail (a file where the class directory should be): decode recomputes, serving goes on."""
    ids = prompt(tok, "unwritable")
    base = tier.kv_root / fingerprint()
    base.mkdir(parents=True, exist_ok=True)
    (base / "agent").write_bytes(b"not a directory")
    try:
        out, cached = await run_on(tier, "prefill-0", ids, cls="agent")
        cold, _ = await run_on(tier, "prefill-1", ids, salt="cold-unwritable")
        assert out == cold and cached == 0
    finally:
        (base / "agent").unlink()


async def test_redis_down_serves_without_the_index(tier, tok):
    """Last in this module: it stops the mesh's Redis."""
    tier.redis.stop()
    ids = prompt(tok, "no-redis")
    out, cached = await run_on(tier, "prefill-1", ids)
    cold, _ = await run_on(tier, "prefill-0", ids, salt="cold-no-redis")
    assert out == cold
    mc = await MeshClient.connect(tier.nats_url, "test-kvtier-health")
    try:
        health = await KVIndexClient(mc, "test", fingerprint()).health()
        assert health is not None and health.redis_ok is False
    finally:
        await mc.close()
    gateway = httpx.get(tier.gateway_url + "/health")
    assert gateway.status_code == 200 and gateway.json()["kv_index"]["redis_ok"] is False
