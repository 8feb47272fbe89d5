import msgpack
import pytest

from deepinfer.protocol import (
    SCHEMA_VERSION, DecodeRequest, ErrorReply, PrefillRequest, ProtocolError, SamplingParams, TokenChunk, pack, unpack,
)


def test_roundtrip_keeps_nested_sampling_params():
    req = PrefillRequest("r1", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=7, seed=3), "deepinfer.stream.r1")
    out = unpack(pack(req))
    assert out == req
    assert isinstance(out.sampling, SamplingParams) and out.sampling.max_tokens == 7


def test_envelope_carries_schema_version_and_type():
    d = msgpack.unpackb(pack(ErrorReply(error="x")))
    assert d["v"] == SCHEMA_VERSION and d["t"] == "ErrorReply"


def test_unknown_fields_are_ignored_for_forward_compatibility():
    d = msgpack.unpackb(pack(TokenChunk("r", [5], "decode", "w1")))
    d["added_later"] = 1
    assert unpack(msgpack.packb(d)).token_ids == [5]


@pytest.mark.parametrize("data", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 99, "t": "ErrorReply", "error": "x"}),
                                  msgpack.packb({"v": SCHEMA_VERSION, "t": "Nope"}),
                                  msgpack.packb({"v": SCHEMA_VERSION, "t": "TokenChunk"})])
def test_bad_messages_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        unpack(data)


def test_expect_rejects_other_types():
    with pytest.raises(ProtocolError):
        unpack(pack(ErrorReply(error="x")), expect=DecodeRequest)


# --- attempts: which copy of a request a message belongs to --------------------------------------
def test_attempts_order_by_submit_then_handoff_and_survive_the_wire():
    from deepinfer.protocol import AbortRequest, Attempt

    first, retry = Attempt(0, 0), Attempt(0, 0).next_handoff()  # prefill's queue-group retry
    resume = retry.next_submit()  # the gateway's failover: newer than any handoff of an earlier submit
    assert first < retry < resume == Attempt(1, 0) and Attempt(0, 50) < Attempt(1, 0)
    assert sorted([resume, first, retry]) == [first, retry, resume]
    chunk = unpack(pack(TokenChunk("r", [5], "decode", "w", attempt=retry)))
    assert chunk.attempt == retry and isinstance(chunk.attempt, Attempt)
    assert unpack(pack(TokenChunk("r", [5], "prefill", "w"))).attempt is None  # not said
    assert unpack(pack(AbortRequest("r"))).attempt is None  # any copy
    req = unpack(pack(DecodeRequest("r", [1], [2], SamplingParams(), "s", [], 1, 16, attempt=resume)))
    assert req.attempt == resume


def test_an_abort_reaches_its_own_attempt_or_any_and_the_ledger_refuses_what_it_names():
    from deepinfer.protocol import AbortLedger, AbortRequest, Attempt, reaches

    assert reaches(None, Attempt(3, 1)) and reaches(Attempt(0, 1), Attempt(0, 1))
    assert not reaches(Attempt(0, 0), Attempt(0, 1)) and not reaches(Attempt(1, 0), Attempt(0, 0))
    ledger = AbortLedger(capacity=2)
    ledger.record(AbortRequest("a", Attempt(0, 0)))  # a timed-out handoff: that copy only
    assert ledger.refuses("a", Attempt(0, 0)) and not ledger.refuses("a", Attempt(0, 1))
    ledger.record(AbortRequest("b", Attempt(2, 0), final=True))  # the client left: every copy
    assert ledger.refuses("b", Attempt(0, 0)) and ledger.refuses("b", Attempt(7, 3))
    ledger.record(AbortRequest("c"))  # the oldest entry goes
    assert len(ledger) == 2 and not ledger.refuses("a", Attempt(0, 0)) and ledger.refuses("c", Attempt(5, 5))
