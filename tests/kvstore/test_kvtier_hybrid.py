"""The storage tier with a hybrid sliding-window model, through a real mesh (SWA bounded replay).

Two prefill workers, one decode worker and the kvindex serve a tiny random
Gemma 3 (window 12 tokens, 3 of 4 layers sliding). A prompt computed on
prefill-0 leaves its full layers' blocks in the tier; prefill-1 hits them for
another prompt sharing the prefix and, the window state being elsewhere,
replays the last window (bounded) or recomputes (exact, per request). Every
answer crosses the prefill -> decode handoff, whose window layers' KV travels
as ephemeral blocks beside the full parts.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from deepinfer.kvstore import KVIndexClient, block_hashes
from deepinfer.launcher import Mesh
from deepinfer.mesh import MeshClient
from deepinfer.protocol import LoadReport, PrefillRequest, SamplingParams, SubmitReply, TokenChunk, subjects, unpack
from model_helpers import hf_greedy_uncached, prompts
from test_swa_replay import BS, PREFIX, WINDOW, tiny_gemma3

from conftest import MESH_START_TIMEOUT

NEW_TOKENS = 8
WORKER_ARGS = ["--block-size", str(BS), "--kv-cache-gb", "0.01", "--no-calibrate", "--step-time-budget-ms", "0"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_gemma3(tmp_path_factory, "gemma3-mesh",
                       ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def tier(model, tmp_path_factory):
    path, _ = model
    m = Mesh(model=str(path), workdir=tmp_path_factory.mktemp("mesh-hybrid"), services=("kvindex", "prefill", "decode"),
             replicas={"prefill": 2}, extra_args={"prefill": WORKER_ARGS, "decode": WORKER_ARGS})
    m.start(timeout=MESH_START_TIMEOUT)
    reports = asyncio.run(wait_for_workers(m, {"prefill-0", "prefill-1", "decode-0"}))
    yield m, reports["prefill-0"].fingerprint
    m.stop()


async def wait_for_workers(mesh: Mesh, workers: set[str], timeout: float = MESH_START_TIMEOUT) -> dict:
    mc = await MeshClient.connect(mesh.nats_url, "test-hybrid-watch")
    seen: dict[str, LoadReport] = {}

    async def on_report(m):
        r = unpack(m.data, LoadReport)
        seen[r.worker_id] = r

    try:
        await mc.nc.subscribe(subjects.LOAD_ALL, cb=on_report)
        deadline = time.monotonic() + timeout
        while not workers <= seen.keys():
            assert time.monotonic() < deadline, f"workers up: {sorted(seen)}"
            await asyncio.sleep(0.2)
        return seen
    finally:
        await mc.close()


async def run_on(mesh: Mesh, worker: str, ids: list[int], mode: str | None = None,
                 salt: str | None = None) -> tuple[list[int], TokenChunk]:
    """Greedy tokens through prefill ``worker`` and decode; (tokens, prefill's first chunk)."""
    mc = await MeshClient.connect(mesh.nats_url, "test-hybrid")
    try:
        rid = uuid.uuid4().hex
        chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()

        async def on_chunk(m):
            chunks.put_nowait(unpack(m.data, TokenChunk))

        sub = await mc.nc.subscribe(subjects.stream(rid), cb=on_chunk)
        sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, swa_replay=mode)
        reply = await mc.request(subjects.prefill_submit(worker),
                                 PrefillRequest(rid, ids, sp, subjects.stream(rid), cache_salt=salt), 10,
                                 expect=SubmitReply)
        assert reply.accepted, reply.error
        tokens, first = [], None
        while True:
            c = await asyncio.wait_for(chunks.get(), 60)
            if c.role == "prefill" and c.token_ids:
                first = c
            tokens += c.token_ids
            if c.finish_reason:
                break
        assert c.finish_reason == "length", c.error
        await sub.unsubscribe()
        return tokens, first
    finally:
        await mc.close()


async def wait_indexed(mesh: Mesh, fingerprint: str, num_blocks: int, timeout: float = 20) -> None:
    mc = await MeshClient.connect(mesh.nats_url, "test-hybrid-health")
    try:
        index = KVIndexClient(mc, "test", fingerprint)
        for _ in range(int(timeout * 10)):
            health = await index.health()
            if health is not None and health.num_blocks >= num_blocks:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"kvindex never reached {num_blocks} blocks")
    finally:
        await mc.close()


async def test_hybrid_prefix_from_the_tier_is_replayed_or_recomputed_and_handed_off(tier, model):
    mesh, fingerprint = tier
    _, hf = model
    prefix, a, b = prompts(512, [PREFIX, 9, 11], seed=11)
    p1, p2 = prefix + a, prefix + b
    first_run, chunk = await run_on(mesh, "prefill-0", p1)
    assert chunk.prefix_path == "cold" and first_run == hf_greedy_uncached(hf, p1, NEW_TOKENS)  # via the handoff
    await wait_indexed(mesh, fingerprint, len(p1) // BS)
    stored = [mesh.kv_root / fingerprint / "chat" / h[:2] / f"{h}.kvb" for h in block_hashes(p1, BS, fingerprint)]
    assert all(f.exists() for f in stored)
    # full layers only: 1 of 4 layers, [1, 2, BS, 2 KV heads, 32] fp32 plus a header
    assert all(BS * 2 * 32 * 2 * 4 < f.stat().st_size < 2 * BS * 2 * 32 * 2 * 4 for f in stored)

    replayed, chunk = await run_on(mesh, "prefill-1", p2, mode="bounded")
    assert chunk.prefix_path == "bounded_replay" and chunk.num_replayed_tokens == WINDOW
    assert chunk.num_cached_tokens == PREFIX - WINDOW and len(replayed) == NEW_TOKENS
    exact, chunk = await run_on(mesh, "prefill-1", p2, mode="exact")
    assert chunk.prefix_path == "exact_recompute" and chunk.num_cached_tokens == 0
    cold, chunk = await run_on(mesh, "prefill-0", p2, salt="cold")
    assert chunk.prefix_path == "cold"
    assert exact == cold == hf_greedy_uncached(hf, p2, NEW_TOKENS)
    for _ in range(50):  # decode deletes the ephemeral blocks (partial, replayed, window parts) once read
        if not any((mesh.kv_root / fingerprint / "ephemeral").rglob("*.kvb")):
            break
        await asyncio.sleep(0.1)
    assert not any((mesh.kv_root / fingerprint / "ephemeral").rglob("*.kvb"))
    reports = await wait_for_workers(mesh, {"prefill-1"})
    assert reports["prefill-1"].prefix_paths == {"bounded_replay": 1, "exact_recompute": 1}
    assert reports["prefill-1"].replayed_tokens == WINDOW
