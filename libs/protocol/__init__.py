"""Every NATS subject and message type of the mesh, defined once.

Messages are small dataclasses sent as msgpack maps ``{"v": SCHEMA_VERSION,
"t": <type name>, ...fields}``. ``pack``/``unpack`` are the only codec; a
message with a different major schema version is refused with
``ProtocolError`` so mixed deployments fail loudly instead of misreading.
"""

from deepinfer.protocol.messages import (  # noqa: F401
    SCHEMA_VERSION,
    AbortRequest,
    BalancerStatus,
    BalancerStatusRequest,
    DecodeRequest,
    EncodeChatReply,
    EncodeChatRequest,
    ErrorReply,
    ExpertPlacementUpdate,
    ExpertStats,
    KVEvent,
    KVIndexHealth,
    KVIndexHealthRequest,
    KVLookupReply,
    KVLookupRequest,
    LoadReport,
    PrefillBooked,
    PrefillRequest,
    ProtocolError,
    SamplingParams,
    SubmitReply,
    TokenChunk,
    VisionEncodeReply,
    VisionEncodeRequest,
    pack,
    unpack,
)
from deepinfer.protocol import subjects  # noqa: F401
from deepinfer.protocol.aborts import AbortLedger  # noqa: F401
from deepinfer.protocol.attempts import Attempt, reaches  # noqa: F401
