"""NATS subject names and queue groups.

Naming: ``deepinfer.<service>.<verb>`` for request/reply served by a queue
group (any replica answers), ``deepinfer.<service>.<worker_id>.<verb>`` for a
message to one chosen worker, ``deepinfer.stream.<request_id>`` for a
request's token stream back to the gateway, ``deepinfer.load.<role>.<worker_id>``
for heartbeats / load reports.
"""

PREFIX = "deepinfer"

# Queue groups: replicas of one service share one group.
TOKENIZER_GROUP = "tokenizer"
PREFILL_GROUP = "prefill"
DECODE_GROUP = "decode"

# Request/reply, served by a queue group.
TOKENIZER_ENCODE_CHAT = f"{PREFIX}.tokenizer.encode_chat"
PREFILL_SUBMIT = f"{PREFIX}.prefill.submit"
DECODE_SUBMIT = f"{PREFIX}.decode.submit"

# Broadcast (every prefill worker): abort a request whose submit reply was lost or late,
# so whichever worker queued it drops it.
PREFILL_ABORT_ANY = f"{PREFIX}.prefill.abort"

# Heartbeats / load reports of every worker: deepinfer.load.<role>.<worker_id>
LOAD_ALL = f"{PREFIX}.load.>"


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
