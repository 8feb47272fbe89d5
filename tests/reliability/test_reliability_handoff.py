"""Handoffs and the aborts that overtake them.

A prefill worker's handoff to the gateway's chosen decode worker can go unanswered for
``TARGET_HANDOFF_TIMEOUT_S`` while that worker's submit subscription is busy: prefill then aborts
that handoff (its ``Attempt``) and hands the request to the queue group. The abort may reach the
worker before the late submit does; the worker remembers it and refuses that submit, while the
retry through the queue group (the submit's next handoff, which may land on the same worker: a
mesh with one decode worker relies on it) and the gateway's resumes are still taken. Otherwise
two decode workers would stream the same request on one subject.
"""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.decode.service import DecodeService
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.mock import MockConfig
from deepinfer.launcher import start_nats
from deepinfer.mesh import MeshClient, NoResponders, RequestTimeout
from deepinfer.models.convert import ensure_default_model
from deepinfer.protocol import AbortRequest, Attempt, DecodeRequest, SamplingParams, SubmitReply, TokenChunk, subjects, unpack
from waiting import eventually


@pytest.fixture
def nats_url(tmp_path):
    proc = start_nats(tmp_path / "nats")
    yield proc.url
    proc.stop()


def decode_request(request_id: str, attempt: Attempt = Attempt()) -> DecodeRequest:
    return DecodeRequest(request_id=request_id, prompt_token_ids=list(range(300, 340)), output_token_ids=[500],
                         sampling=SamplingParams(max_tokens=4000, ignore_eos=True),  # ~4 s: still running at the checks
                         stream_subject=subjects.stream(request_id), kv_block_keys=[], num_kv_tokens=0, block_size=16,
                         attempt=attempt)


async def test_a_decode_worker_refuses_a_handoff_aborted_before_it_arrived(nats_url, tmp_path):
    service = DecodeService(nats_url, str(ensure_default_model(progress=False)), EngineConfig(), str(tmp_path / "kv"),
                            "decode-t", mock=MockConfig(cost=(0.001, 1e-6, 0.0, 0.0)), heartbeat_s=0.5)
    await service.start()
    client = await MeshClient.connect(nats_url, "handoff-test")
    chunks: dict[str, list] = {"late": [], "normal": [], "gone": [], "over": []}
    try:
        for rid in chunks:
            async def record(m, rid=rid):
                chunks[rid].append(unpack(m.data, expect=TokenChunk))

            await client.nc.subscribe(subjects.stream(rid), cb=record)
        abort = subjects.abort("decode", "decode-t")
        await client.publish(abort, AbortRequest("late", attempt=Attempt(0, 0)))  # prefill gave up on its targeted handoff
        await client.publish(abort, AbortRequest("gone", attempt=None))  # a gateway abort of an id not here
        # the client left while the handoff was on its way: the gateway's final abort, to every worker
        await client.publish(subjects.DECODE_ABORT_ANY, AbortRequest("over", final=True))
        await client.nc.flush()
        await asyncio.sleep(0.2)

        async def submit(rid: str, attempt: Attempt = Attempt()) -> SubmitReply:
            return await client.request(subjects.decode_submit("decode-t"), decode_request(rid, attempt), timeout=10,
                                        expect=SubmitReply)

        late = await submit("late")
        # every attempt of it: prefill's handoffs and a gateway resume (a later submit)
        over = [await submit("over", attempt) for attempt in (Attempt(0, 0), Attempt(0, 1), Attempt(1, 0))]
        await asyncio.sleep(0.3)
        assert (late.accepted, late.error) == (False, "aborted")
        assert chunks["late"] == [] and "late" not in service.requests
        assert [(r.accepted, r.error) for r in over] == [(False, "aborted")] * 3 and chunks["over"] == []
        retry = await submit("late", attempt=Attempt(0, 1))  # prefill's retry through the queue group landed here
        assert retry.accepted and service.requests["late"].req.attempt == Attempt(0, 1)
        await client.publish(abort, AbortRequest("late", attempt=Attempt(0, 0)))  # a late copy of the first abort: no effect
        normal, gone = await submit("normal"), await submit("gone")
        await eventually(lambda: len(chunks["late"]) > 1 and len(chunks["normal"]) > 1)  # both decoding
        assert "late" in service.requests and len(chunks["late"]) > 1
        assert normal.accepted and len(chunks["normal"]) > 1 and gone.accepted
        await client.publish(abort, AbortRequest("late"))
        await client.publish(subjects.DECODE_ABORT_ANY, AbortRequest("gone", final=True))  # any attempt running
        await client.publish(subjects.abort("decode", "decode-t"), AbortRequest("normal"))  # and drops them
        await client.nc.flush()
        await eventually(lambda: service.engine.block_manager.num_used_blocks == 0, interval=0.05)
        assert service.engine.block_manager.num_used_blocks == 0 and not service.requests
        assert service.load_report().aborted_requests == 3
    finally:
        await client.close()
        await service.stop()


# --- prefill's side: a busy decode worker delays a handoff, an abort stops it --------------------


@pytest.fixture
async def prefill(nats_url, tmp_path):
    from deepinfer.prefill.service import PrefillService

    service = PrefillService(nats_url, str(ensure_default_model(progress=False)), EngineConfig(), str(tmp_path / "kv"),
                             "prefill-t", mock=MockConfig(cost=(0.001, 1e-6, 0.0, 0.0)), heartbeat_s=0.5)
    await service.start()
    yield service
    await service.stop()


def prefill_job(request_id: str, decode_worker: str | None = None):
    """A prefill worker's state of a request at its handoff (submit 0)."""
    from deepinfer.prefill.service import PrefillJob
    from deepinfer.protocol import PrefillRequest

    req = PrefillRequest(request_id, list(range(300, 340)), SamplingParams(max_tokens=8), subjects.stream(request_id),
                         decode_worker=decode_worker)
    return PrefillJob(req, req.attempt, None)


async def fake_decode_group(client: MeshClient, answers: list[bool], seen: list[DecodeRequest]) -> None:
    """Answer queue-group handoffs in turn: ``answers[i]`` accepts or refuses ("no room") the i-th;
    past the list, refuse."""
    async def on_submit(req: DecodeRequest):
        seen.append(req)
        ok = answers[len(seen) - 1] if len(seen) <= len(answers) else False
        return SubmitReply(accepted=ok, worker_id="decode-group", error="" if ok else "no room")

    await client.subscribe(subjects.DECODE_SUBMIT, on_submit, queue=subjects.DECODE_GROUP)


async def test_a_busy_decode_worker_delays_a_handoff_instead_of_failing_it(prefill, nats_url):
    client = await MeshClient.connect(nats_url, "handoff-test")
    try:
        async def busy(_req):  # the gateway's choice: too busy to answer in time
            await asyncio.sleep(10)

        await client.subscribe(subjects.decode_submit("decode-busy"), busy, concurrent=True)
        aborts: list[tuple[str, Attempt]] = []
        async def on_abort(m):
            aborts.append(("decode-busy", unpack(m.data, expect=AbortRequest).attempt))

        await client.nc.subscribe(subjects.abort("decode", "decode-busy"), cb=on_abort)
        seen: list[DecodeRequest] = []
        await fake_decode_group(client, [False, False, True], seen)
        await client.nc.flush()
        for _ in range(50):  # prefill's connection sees the busy worker: a probe on it times out
            try:
                await prefill.mesh.request(subjects.decode_submit("decode-busy"), decode_request("probe"), timeout=0.2)
            except NoResponders:
                await asyncio.sleep(0.1)
            except RequestTimeout:
                break
        job = prefill_job("busy-1", decode_worker="decode-busy")
        reply = await prefill.hand_off(job, decode_request("busy-1"))
        assert reply.accepted and reply.worker_id == "decode-group"
        # each try the submit's next handoff, after the targeted one (0)
        assert [r.attempt for r in seen] == [Attempt(0, 1), Attempt(0, 2), Attempt(0, 3)]
        assert aborts == [("decode-busy", Attempt(0, 0))]  # the unanswered try was called off, that attempt only
    finally:
        await client.close()


async def test_a_final_abort_stops_a_handoff_that_waits_for_a_decode_worker(prefill, nats_url):
    client = await MeshClient.connect(nats_url, "handoff-test")
    try:
        seen: list[DecodeRequest] = []
        await fake_decode_group(client, [], seen)  # every decode worker refuses: full
        await client.nc.flush()

        async def leave():
            await asyncio.sleep(0.5)
            await client.publish(subjects.PREFILL_ABORT_ANY, AbortRequest("gone-1", final=True))

        asyncio.get_running_loop().create_task(leave())
        t0 = asyncio.get_running_loop().time()
        reply = await prefill.hand_off(prefill_job("gone-1"), decode_request("gone-1"))
        assert reply is None and asyncio.get_running_loop().time() - t0 < 2.0
        assert 1 <= len(seen) <= 5
    finally:
        await client.close()


async def test_a_handoff_no_decode_worker_takes_fails_after_its_bound(prefill, nats_url, monkeypatch):
    from deepinfer.mesh import MeshError
    import deepinfer.prefill.service as prefill_service

    monkeypatch.setattr(prefill_service, "HANDOFF_WAIT_S", 1.0)
    client = await MeshClient.connect(nats_url, "handoff-test")
    try:
        seen: list[DecodeRequest] = []
        await fake_decode_group(client, [], seen)
        await client.nc.flush()
        with pytest.raises(MeshError, match="no decode worker took the request within 1s .*no room"):
            await prefill.hand_off(prefill_job("full-1"), decode_request("full-1"))
        assert len(seen) >= 2
    finally:
        await client.close()


async def test_a_concurrent_subscription_does_not_hold_messages_behind_a_slow_one(nats_url):
    """Decode's submit subscriptions: a submit whose blocks load slowly holds up no other."""
    client = await MeshClient.connect(nats_url, "concurrency-test")
    try:
        async def handler(msg: AbortRequest):  # (any message type: echoed back)
            await asyncio.sleep(1.0 if msg.request_id == "slow" else 0.0)
            return msg

        await client.subscribe("test.serial", handler)
        await client.subscribe("test.concurrent", handler, concurrent=True)
        loop = asyncio.get_running_loop()
        for subject, fast_within in (("test.concurrent", 0.5), ("test.serial", None)):
            slow = loop.create_task(client.request(subject, AbortRequest("slow"), timeout=5))
            await asyncio.sleep(0.1)
            t0 = loop.time()
            assert (await client.request(subject, AbortRequest("fast"), timeout=5)).request_id == "fast"
            took = loop.time() - t0
            assert (await slow).request_id == "slow"
            if fast_within is not None:
                assert took < fast_within
            else:  # one at a time, in order: the fast one waited for the slow one
                assert took > 0.8
    finally:
        await client.close()
