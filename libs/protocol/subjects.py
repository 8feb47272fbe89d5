"""NATS subject names and queue groups.

Naming: ``deepinfer.<service>.<verb>`` for request/reply served by a queue
group (any replica answers), ``deepinfer.<service>.<worker_id>.<verb>`` for a
message to one chosen worker, ``deepinfer.stream.<request_id>`` for a
request's token stream back to the gateway, ``deepinfer.load.<role>.<worker_id>``
for heartbeats / load reports, ``deepinfer.kv.events.<worker_id>`` for KV
events (captured by the JetStream stream ``KV_EVENTS_STREAM``),
``deepinfer.experts.{stats,placement}`` for expert load balancing.
"""

PREFIX = "deepinfer"

# Queue groups: replicas of one service share one group.
TOKENIZER_GROUP = "tokenizer"
PREFILL_GROUP = "prefill"
DECODE_GROUP = "decode"
KVINDEX_GROUP = "kvindex"
VISION_GROUP = "vision"

# Request/reply, served by a queue group.
TOKENIZER_ENCODE_CHAT = f"{PREFIX}.tokenizer.encode_chat"
PREFILL_SUBMIT = f"{PREFIX}.prefill.submit"
DECODE_SUBMIT = f"{PREFIX}.decode.submit"
KVINDEX_LOOKUP = f"{PREFIX}.kvindex.lookup"  # KVLookupRequest -> KVLookupReply
KVINDEX_HEALTH = f"{PREFIX}.kvindex.health"  # KVIndexHealthRequest -> KVIndexHealth
VISION_ENCODE = f"{PREFIX}.vision.encode"  # VisionEncodeRequest -> VisionEncodeReply

# KV events (KVEvent) of every worker, kept in a JetStream stream until the kvindex consumes them.
KV_EVENTS_STREAM = "DEEPINFER_KV_EVENTS"
KV_EVENTS_ALL = f"{PREFIX}.kv.events.>"
KV_EVENTS_CONSUMER = "kvindex"  # durable consumer shared by kvindex replicas

# Broadcast (every prefill worker): abort a request whose submit reply was lost or late,
# so whichever worker queued it drops it.
PREFILL_ABORT_ANY = f"{PREFIX}.prefill.abort"
# The same for decode workers (aggregated serving submits the prompt to them): names the attempt.
DECODE_ABORT_ANY = f"{PREFIX}.decode.abort"

# Heartbeats / load reports of every worker: deepinfer.load.<role>.<worker_id>
LOAD_ALL = f"{PREFIX}.load.>"

# Gateways -> every other gateway (plain subscription): PrefillBooked, each prefill booking as it
# is made, so gateways sharing workers see each other's before the workers' next load report.
ROUTER_BOOKED = f"{PREFIX}.router.booked"

# Expert load balancing. MoE workers -> balancer: ExpertStats (plain subscription:
# run one balancer). Balancer -> every MoE worker: ExpertPlacementUpdate, the latest one per
# model also kept in the JetStream KV bucket EXPERTS_BUCKET under placement_key(model), so a
# worker that starts later (or missed a message) reads it there.
EXPERTS_STATS = f"{PREFIX}.experts.stats"
EXPERTS_PLACEMENT = f"{PREFIX}.experts.placement"
EXPERTS_BUCKET = "DEEPINFER_EXPERTS"
BALANCER_STATUS = f"{PREFIX}.balancer.status"  # BalancerStatusRequest -> BalancerStatus


def load(role: str, worker_id: str) -> str:
    """Subject a worker publishes its heartbeat / load report on."""
    return f"{PREFIX}.load.{role}.{worker_id}"


def prefill_submit(worker_id: str) -> str:
    """Subject for dispatching a prefill to one chosen worker."""
    return f"{PREFIX}.prefill.{worker_id}.submit"


def decode_submit(worker_id: str) -> str:
    """Subject for handing a request to one chosen decode worker."""
    return f"{PREFIX}.decode.{worker_id}.submit"


def abort(role: str, worker_id: str) -> str:
    """Subject that makes a worker drop a request and free its KV blocks."""
    return f"{PREFIX}.{role}.{worker_id}.abort"


def stream(request_id: str) -> str:
    """Per-request subject on which workers publish ``TokenChunk`` s."""
    return f"{PREFIX}.stream.{request_id}"


def kv_events(worker_id: str) -> str:
    """Subject a worker publishes its ``KVEvent`` s on (captured by ``KV_EVENTS_STREAM``)."""
    return f"{PREFIX}.kv.events.{worker_id}"


def placement_key(model: str) -> str:
    """Key of a model's latest ``ExpertPlacementUpdate`` in ``EXPERTS_BUCKET``."""
    return f"placement.{model}"
