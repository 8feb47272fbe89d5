"""A decode worker refuses a handoff whose abort came first (issue #13, item 3: found by the
cancellation test of ``test_reliability_mesh``).

On a loaded machine a prefill worker's handoff to the gateway's chosen decode worker can go
unanswered for ``TARGET_HANDOFF_TIMEOUT_S`` while that worker's submit subscription is busy with
earlier submits: prefill then sends it an abort and hands the request to the queue group. The abort
reached the worker before the submit did, found nothing to drop and was forgotten; the late submit
then ran. Two decode workers streamed the same request on one subject, the gateway (aborting the one
it watched when the client left) let the other run to its last token: 3 of 1,000 cancelled streams,
one still holding 109 KV blocks 16 s later. A decode worker now remembers ids aborted before their
submit and refuses it.
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


def decode_request(request_id: str) -> DecodeRequest:
    return DecodeRequest(request_id=request_id, prompt_token_ids=list(range(300, 340)), output_token_ids=[500],
                         sampling=SamplingParams(max_tokens=200, ignore_eos=True),
                         stream_subject=subjects.stream(request_id), kv_block_keys=[], num_kv_tokens=0, block_size=16)


async def test_a_decode_worker_refuses_a_handoff_aborted_before_it_arrived(nats_url, tmp_path):
    service = DecodeService(nats_url, str(ensure_default_model(progress=False)), EngineConfig(), str(tmp_path / "kv"),
                            "decode-t", mock=MockConfig(cost=(0.001, 1e-6, 0.0, 0.0)), heartbeat_s=0.5)
    await service.start()
    client = await MeshClient.connect(nats_url, "handoff-test")
    chunks: dict[str, list] = {"late": [], "normal": []}
    try:
        for rid in chunks:
            async def record(m, rid=rid):
                chunks[rid].append(unpack(m.data, expect=TokenChunk))

            await client.nc.subscribe(subjects.stream(rid), cb=record)
        await client.publish(subjects.abort("decode", "decode-t"), AbortRequest("late"))  # prefill gave up first
        await client.nc.flush()
        await asyncio.sleep(0.2)
        late = await client.request(subjects.decode_submit("decode-t"), decode_request("late"), timeout=10,
                                    expect=SubmitReply)
        normal = await client.request(subjects.decode_submit("decode-t"), decode_request("normal"), timeout=10,
                                      expect=SubmitReply)
        await asyncio.sleep(0.5)
        assert (late.accepted, late.error) == (False, "aborted")
        assert chunks["late"] == [] and "late" not in service.requests
        assert normal.accepted and len(chunks["normal"]) > 1  # the worker still takes other requests
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
