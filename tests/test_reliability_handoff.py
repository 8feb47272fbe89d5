"""A decode worker refuses a handoff whose abort came first (issue #13, item 3: found by the
cancellation test of ``test_reliability_mesh``).

On a loaded machine a prefill worker's handoff to the gateway's chosen decode worker can go
unanswered for ``TARGET_HANDOFF_TIMEOUT_S`` while that worker's submit subscription is busy with
earlier submits: prefill then sends it an abort and hands the request to the queue group. The abort
reached the worker before the submit did, found nothing to drop and was forgotten; the late submit
then ran. Two decode workers streamed the same request on one subject, the gateway (aborting the one
it watched when the client left) let the other run to its last token: 3 of 1,000 cancelled streams,
one still holding 109 KV blocks 16 s later. Prefill's abort now names its handoff attempt, and a
decode worker remembers an attempt aborted before its submit and refuses that submit, while the
retry through the queue group (the next attempt, which may land on the same worker: a mesh with one
decode worker relies on it) and the gateway's resumes are still taken.
"""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.decode.service import DecodeService
from deepinfer.engine.llm_engine import EngineConfig
from deepinfer.engine.mock import MockConfig
from deepinfer.launcher import start_nats
from deepinfer.mesh import MeshClient
from deepinfer.models.convert import ensure_default_model
from deepinfer.protocol import AbortRequest, DecodeRequest, SamplingParams, SubmitReply, TokenChunk, subjects, unpack


@pytest.fixture
def nats_url(tmp_path):
    proc = start_nats(tmp_path / "nats")
    yield proc.url
    proc.stop()


def decode_request(request_id: str, attempt: int = 0) -> DecodeRequest:
    return DecodeRequest(request_id=request_id, prompt_token_ids=list(range(300, 340)), output_token_ids=[500],
                         sampling=SamplingParams(max_tokens=4000, ignore_eos=True),  # ~4 s: still running at the checks
                         stream_subject=subjects.stream(request_id), kv_block_keys=[], num_kv_tokens=0, block_size=16,
                         attempt=attempt)


async def test_a_decode_worker_refuses_a_handoff_aborted_before_it_arrived(nats_url, tmp_path):
    service = DecodeService(nats_url, str(ensure_default_model(progress=False)), EngineConfig(), str(tmp_path / "kv"),
                            "decode-t", mock=MockConfig(cost=(0.001, 1e-6, 0.0, 0.0)), heartbeat_s=0.5)
    await service.start()
    client = await MeshClient.connect(nats_url, "handoff-test")
    chunks: dict[str, list] = {"late": [], "normal": [], "gone": []}
    try:
        for rid in chunks:
            async def record(m, rid=rid):
                chunks[rid].append(unpack(m.data, expect=TokenChunk))

            await client.nc.subscribe(subjects.stream(rid), cb=record)
        abort = subjects.abort("decode", "decode-t")
        await client.publish(abort, AbortRequest("late", attempt=0))  # prefill gave up on its targeted handoff
        await client.publish(abort, AbortRequest("gone", attempt=-1))  # a gateway abort of an id not here
        await client.nc.flush()
        await asyncio.sleep(0.2)

        async def submit(rid: str, attempt: int = 0) -> SubmitReply:
            return await client.request(subjects.decode_submit("decode-t"), decode_request(rid, attempt), timeout=10,
                                        expect=SubmitReply)

        late = await submit("late")
        await asyncio.sleep(0.3)
        assert (late.accepted, late.error) == (False, "aborted")
        assert chunks["late"] == [] and "late" not in service.requests
        retry = await submit("late", attempt=1)  # prefill's retry through the queue group landed here
        assert retry.accepted and service.requests["late"].attempt == 1
        await client.publish(abort, AbortRequest("late", attempt=0))  # a late copy of the first abort: no effect
        normal, gone = await submit("normal"), await submit("gone")
        await asyncio.sleep(0.5)
        assert "late" in service.requests and len(chunks["late"]) > 1
        assert normal.accepted and len(chunks["normal"]) > 1 and gone.accepted
        for rid in ("late", "gone"):
            await client.publish(abort, AbortRequest(rid))
        await client.publish(subjects.abort("decode", "decode-t"), AbortRequest("normal"))  # and drops them
        await client.nc.flush()
        for _ in range(100):
            if service.engine.block_manager.num_used_blocks == 0:
                break
            await asyncio.sleep(0.05)
        assert service.engine.block_manager.num_used_blocks == 0 and not service.requests
    finally:
        await client.close()
        await service.stop()
