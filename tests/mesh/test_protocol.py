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
