"""Message types of the mesh and their msgpack codec.

Wire format: a msgpack map ``{"v": SCHEMA_VERSION, "t": "<TypeName>", **fields}``.
Unknown fields are ignored on decode (a newer sender may add optional fields
within one schema version); a different schema version is a ``ProtocolError``.
Nested messages (``SamplingParams``) travel as plain maps and are rebuilt by
the owning type's ``from_dict``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from deepinfer.protocol.attempts import Attempt

SCHEMA_VERSION = 2  # 2: ``attempt`` fields are ``Attempt`` maps (were ints)


class ProtocolError(ValueError):
    """A message could not be decoded: bad bytes, wrong schema version or type."""


_REGISTRY: dict[str, type] = {}


def message(cls):
    """Class decorator: make ``cls`` a dataclass and register it for ``unpack``."""
    cls = dataclass(cls)
    _REGISTRY[cls.__name__] = cls
    return cls


@dataclass
class SamplingParams:
    """How to pick tokens (``deepinfer.engine.sampler`` applies them in this order).

    logit_bias: token id -> value added to its logit, before everything else.
    min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this many
    output tokens. repetition_penalty: HF/CTRL, over prompt + output tokens
    (1 = off). presence_penalty / frequency_penalty: OpenAI, over output tokens
    (0 = off). temperature: 0 means greedy (argmax). min_p: drop tokens whose
    probability is below ``min_p`` times the top one's (0 = off). top_k: keep
    the k most likely tokens (0 or -1 = off). top_p: nucleus mass in (0, 1].
    max_tokens: output tokens to generate, >= 1. seed: per-request RNG seed
    (None = nondeterministic). stop_token_ids: extra ids that end generation
    besides the model's EOS ids. ignore_eos: keep going past EOS (benchmarks).
    logprobs: return the sampled token's logprob; top_logprobs: and the
    ``top_logprobs`` most likely tokens' (0-20).
    swa_replay: hybrid sliding-window models, a cached prefix whose window
    state is gone: "bounded" (replay its last W tokens: W token-forwards, a
    small accuracy cost; docs/architecture.md, "SWA bounded replay") or "exact"
    (recompute the prefix); None = the worker's ``--swa-replay``.
    structured: constrain the output (``deepinfer.engine.structured``; None = free text), one of
    ``{"type": "json_object"}``, ``{"type": "json_schema", "schema": {...}}``,
    ``{"type": "regex", "pattern": str}``, ``{"type": "choice", "choices": [str, ...]}``,
    ``{"type": "grammar", "lark": str}`` (llguidance's Lark). A grammar mask is applied before
    every other stage; when the grammar is complete only EOS is allowed. An unsupported spec is
    refused (``StructuredOutputError``), never silently ignored.
    prompt_logprobs: None = off; k (0-20) = the logprob of every prompt token after the first under
    the model's raw distribution, with the k most likely tokens at each position (vLLM's
    ``prompt_logprobs``), computed by the worker that computes the prompt: it then computes the whole
    prompt (its prefix cache is not read) and sends them with the first token
    (``TokenChunk.prompt_logprobs``).

    On the wire ``logit_bias`` is a list of ``[token_id, bias]`` pairs
    (msgpack map keys must be strings); ``from_dict`` turns it back into a dict.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    swa_replay: str | None = None
    structured: dict | None = None
    prompt_logprobs: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        if d is None:
            return cls()
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if "logit_bias" in kwargs:
            bias = kwargs["logit_bias"] or {}
            pairs = bias.items() if isinstance(bias, dict) else bias
            kwargs["logit_bias"] = {int(t): float(b) for t, b in pairs}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["logit_bias"] = [[t, b] for t, b in self.logit_bias.items()]
        return d


@message
class EncodeChatRequest:
    """gateway -> tokenizer: render the chat template and encode it (``deepinfer.recipe``).

    messages: OpenAI-shaped chat messages: ``role`` (system, developer, user,
    assistant, tool), ``content`` (a string, a list of ``{"type": "text",
    "text"}`` parts, or None), assistant ``tool_calls`` (``[{"id", "type":
    "function", "function": {"name", "arguments": <JSON string>}}]``), tool
    ``tool_call_id`` and ``name``.
    tools: OpenAI function tool schemas (``[{"type": "function", "function":
    {"name", "description", "parameters"}}]``) offered to the template; None = none.
    Control strings in any of this text are encoded as text, never as control tokens.
    """

    request_id: str
    messages: list[dict]
    add_generation_prompt: bool = True
    tools: list[dict] | None = None  # OpenAI function-tool schemas, rendered by the template


@message
class EncodeChatReply:
    """tokenizer -> gateway: prompt token ids (int32 range) of the rendered chat.

    images: vision-language models, per image part in prompt order ``[offset, length, content
    hash]``: its run of placeholder tokens in ``token_ids`` and the vision service's hash.
    """

    request_id: str
    token_ids: list[int]
    images: list[list] = field(default_factory=list)


@message
class VisionEncodeRequest:
    """gateway -> vision (``deepinfer.vision.encode``, queue group ``vision``): encode a request's images.

    images: each image's file bytes (PNG, JPEG, WebP, GIF's first frame, BMP), already taken
    out of its data: URL or fetched by the gateway. The vision worker validates and decodes
    them, hashes their pixels, and stores their embeddings in the storage tier (a cache hit
    skips the vision tower). Refused with ``ErrorReply(kind="bad_request")`` naming the image.
    """

    request_id: str
    images: list[bytes]


@message
class VisionEncodeReply:
    """vision -> gateway: per image, in order, its content hash (hex SHA-256 of its RGB pixels and
    size, ``vision.service.image_hash``) under which its embeddings [tokens_per_image, hidden] now
    sit in the storage tier (``<kv root>/<embeddings_fingerprint>/embeddings/``), and whether they
    were there already (cached)."""

    request_id: str
    image_hashes: list[str]
    tokens_per_image: int
    embeddings_fingerprint: str
    cached: list[bool] = field(default_factory=list)


@message
class PrefillRequest:
    """gateway -> prefill: run the prompt, emit the first token, hand off to decode.

    stream_subject: where every ``TokenChunk`` of this request is published.
    decode_worker: the decode worker the gateway's router chose (``deepinfer.gateway.pipeline.router``);
    prefill hands off to ``decode_submit(decode_worker)``, and to the decode queue group when
    it is None or that worker refuses or does not answer.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream_subject: str
    traffic_class: str = "chat"
    cache_salt: str | None = None  # tenant key mixed into the prefix hashes: no sharing across salts
    decode_worker: str | None = None
    attempt: Attempt = field(default_factory=Attempt)  # which copy of the request (``protocol.attempts``)
    # vision-language prompts: [offset, length, content hash] per image (``EncodeChatReply.images``)
    # and where the vision service put their embeddings (``VisionEncodeReply.embeddings_fingerprint``)
    images: list[list] = field(default_factory=list)
    embeddings_fingerprint: str = ""

    NESTED: ClassVar[dict] = {"sampling": SamplingParams, "attempt": Attempt}


@message
class DecodeRequest:
    """prefill -> decode: continue a request whose prompt KV is in the storage tier.

    kv_block_keys: storage-tier keys of the KV blocks covering the first
    ``num_kv_tokens`` tokens of ``prompt_token_ids + output_token_ids``, in
    order, ``block_size`` tokens each (the last one may be partial).
    output_token_ids: tokens already generated (the first one, by prefill).
    Hybrid sliding-window models (``engine.kv_layout``): ``kv_block_keys`` name the
    full layers' part of each block only, and ``window_block_keys[i]`` the
    window layers' part of block i (ephemeral; "" = released, outside the
    window); empty = the blocks hold every layer. num_exact_blocks: leading blocks
    whose KV equals a cold run's (-1 = all; fewer after a bounded replay).
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    stream_subject: str
    kv_block_keys: list[str]
    num_kv_tokens: int
    block_size: int
    traffic_class: str = "chat"
    cache_salt: str | None = None
    window_block_keys: list[str] = field(default_factory=list)
    num_exact_blocks: int = -1
    # [offset, length, content hash] per image of the prompt: hashed into its blocks; where the
    # vision service put their embeddings (``PrefillRequest.embeddings_fingerprint``): a decode worker
    # that recomputes part of the prompt (a resume) reads them from the storage tier
    images: list[list] = field(default_factory=list)
    embeddings_fingerprint: str = ""
    attempt: Attempt = field(default_factory=Attempt)  # the prefill submit's, with prefill's handoff number

    NESTED: ClassVar[dict] = {"sampling": SamplingParams, "attempt": Attempt}


@message
class SubmitReply:
    """Reply to a submit: accepted by ``worker_id``, or refused with ``error``."""

    accepted: bool
    worker_id: str
    error: str | None = None


@message
class AbortRequest:
    """gateway -> worker: stop this request and free its KV blocks.

    attempt: only the copy of the request with this ``Attempt`` (a targeted submit or handoff that
    timed out, so a later attempt of the same request may still land on this worker; a copy the
    gateway moved away from); None = any copy (``protocol.attempts.reaches``).
    final: the request is over (its client left, a stop string ended it): every copy of it
    stops, whatever its attempt, and any submit or handoff of it that arrives later is refused.
    The gateway broadcasts final aborts to every prefill and decode worker, so they reach the
    request wherever it is (queued, running, in a handoff between two workers)."""

    request_id: str
    attempt: Attempt | None = None
    final: bool = False

    NESTED: ClassVar[dict] = {"attempt": Attempt}


@message
class TokenChunk:
    """worker -> gateway on the request's stream subject: new token ids.

    finish_reason: None while running; "stop" (EOS / stop token), "length"
    (max_tokens or max model length), "abort", or "error" (``error`` says why).
    role / worker_id: who produced the chunk, so the gateway knows whom to
    watch for liveness and whom to abort.
    logprobs: only when the request asked (``SamplingParams.logprobs``): one
    entry per token of ``token_ids``, ``[logprob, [[token_id, logprob], ...]]``
    (the sampled token's logprob, then the ``top_logprobs`` most likely tokens,
    best first). See ``deepinfer.engine.sampler`` for which distribution.
    prefix_path: prefill's first chunk: how the prompt's cached prefix was reused
    ("cold", "hit", "swa_cache", "bounded_replay", "exact_recompute"; see
    ``engine.hybrid_blocks``); num_replayed_tokens: prefix tokens fed again by a
    bounded replay (not counted in ``num_cached_tokens``).
    offset: output tokens of the request before this chunk's (prefill's first token: 0; decode's
    announcement: the tokens it was given), so the gateway sees a chunk lost in transit (a gap)
    or a copy behind it; -1 = not said (error chunks, older senders).
    attempt: decode chunks: the ``DecodeRequest.attempt`` of the copy that produced them, so two
    copies of the request are told apart and the newer one known; None = not said.
    prompt_logprobs: the chunk with the first token, when the request asked
    (``SamplingParams.prompt_logprobs``): one entry per prompt token, None for the first (nothing
    predicts it), else ``[logprob, [[token_id, logprob], ...]]`` (the token's logprob under the
    model's raw distribution, then the k most likely tokens there, best first).
    """

    request_id: str
    token_ids: list[int]
    role: str
    worker_id: str
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[list] | None = None
    prefix_path: str = ""
    num_replayed_tokens: int = 0
    offset: int = -1
    attempt: Attempt | None = None
    prompt_logprobs: list | None = None

    NESTED: ClassVar[dict] = {"attempt": Attempt}


@message
class LoadReport:
    """Heartbeat / load report every worker publishes periodically.

    kv_tokens_used / kv_tokens_capacity: tokens of KV held / holdable.
    peak_batch_size: largest number of sequences in one forward step so far.
    interval_s: seconds between reports (a worker silent for a few intervals
    is considered dead).

    For routing and admission (appended with defaults, so older
    senders and readers interoperate):
    queued_prefill_tokens / queued_prefill_s: prompt tokens still to compute
    (uncached) over the waiting and running requests, and the engine's cost
    model's predicted compute for them in seconds (marginal piece costs
    ``b·n + d·n(c + n/2) + e·(c + n)``, without the per-step ``cost_a``).
    cost_a, cost_b, cost_d, cost_e: the fitted step cost model
    (``engine.cost_model``): seconds per step, per new token,
    per (new token, key) pair and per key gathered from the cache.
    step_time_budget_s: predicted compute per step prefill chunks may fill
    (0 = no time budget). block_size: tokens per KV block.
    prefix_hit_tokens / prefix_queried_tokens: prompt tokens served from the
    prefix cache / prompt tokens looked up, since start (hit rate = ratio).
    engine: "native" or "mock" ("" = an older worker).
    fingerprint: the model fingerprint of this worker's KV blocks (``kvstore.hashing``; a
    mock engine's differs from the model's), so a router can hash prompts as the worker does
    and look them up in the kvindex ("" = unknown). kv_block_bytes: bytes of one KV block
    over all layers (what loading a stored block reads; a mock reports the modelled model's).
    finished_requests / computed_tokens / busy_s: since start, requests finished (or handed
    off), tokens fed through the model (not cache hits) and seconds spent in forward passes
    (a load-balance view: trace replay compares them across workers).
    prefix_paths: since start, admitted requests by how their cached prefix was reused
    (``TokenChunk.prefix_path``); replayed_tokens: prefix tokens fed again by bounded
    replays; swa_cache_bytes / swa_cache_hits / swa_cache_misses: the SWA state cache's
    size and block lookups (hybrid sliding-window models; 0 otherwise).
    """

    role: str
    worker_id: str
    active_requests: int = 0
    waiting_requests: int = 0
    kv_tokens_used: int = 0
    kv_tokens_capacity: int = 0
    peak_batch_size: int = 0
    steps: int = 0
    interval_s: float = 1.0
    draining: bool = False
    queued_prefill_tokens: int = 0
    queued_prefill_s: float = 0.0
    cost_a: float = 0.0
    cost_b: float = 0.0
    cost_d: float = 0.0
    cost_e: float = 0.0
    step_time_budget_s: float = 0.0
    block_size: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    engine: str = ""
    fingerprint: str = ""
    kv_block_bytes: int = 0
    finished_requests: int = 0
    computed_tokens: int = 0
    busy_s: float = 0.0
    prefix_paths: dict[str, int] = field(default_factory=dict)
    replayed_tokens: int = 0
    swa_cache_bytes: int = 0
    swa_cache_hits: int = 0
    swa_cache_misses: int = 0
    vision_forwards: int = 0  # vision workers: vision tower forward passes since start
    vision_images: int = 0  # vision workers: images encoded (misses) / served from the cache (hits)
    vision_cache_hits: int = 0
    # the longest sequence (prompt + output, tokens) the worker's engine runs (0 = not said): the
    # gateway holds requests to the smallest among live workers (``Gateway.max_model_len``)
    max_model_len: int = 0
    # since start: requests this worker stopped on an abort (client gone, stop string, moved away)
    aborted_requests: int = 0
    # sequences the engine runs at once (``--max-num-seqs``; 0 = not said): a decode worker with
    # that many running queues the rest, which the router and admission count against it
    max_num_seqs: int = 0
    # the storage tier this worker reads and writes (``kvstore.store.tier_id``; "" = not said): the
    # gateway leaves a worker on another tier than the others' out of routing
    tier_id: str = ""


@message
class ErrorReply:
    """Any request/reply that failed: ``kind`` is "bad_request" or "internal"."""

    error: str
    kind: str = "internal"


@message
class KVEvent:
    """prefill worker -> kvindex (JetStream stream ``DEEPINFER_KV_EVENTS``): the storage tier changed.

    kind: "stored" (``block_hashes`` were written, or found already there,
    under ``traffic_class``), "removed" (they are gone or corrupt: drop them
    from the index) or "cleared" (the tier of ``fingerprint`` changed
    wholesale: re-sync the index from the files).
    worker_id / epoch / event_id: the sender, its process incarnation
    (random per start) and a per-incarnation counter starting at 1, +1 per
    event; a jump tells the index it missed events (it then re-syncs from
    the files).
    block_hashes: hex chained block hashes (``deepinfer.kvstore.hashing``).
    block_bytes: payload bytes of each block file; block_tokens: tokens per
    block; fingerprint: the model fingerprint (the files' directory).
    """

    kind: str
    worker_id: str
    event_id: int
    block_hashes: list[str] = field(default_factory=list)
    traffic_class: str = "chat"
    block_bytes: int = 0
    block_tokens: int = 0
    fingerprint: str = ""
    epoch: str = ""


@message
class KVLookupRequest:
    """worker -> kvindex (queue group): how many leading blocks of this chain are stored?

    hashes: the request's chained block hashes, in order. traffic_class: the
    request's class (blocks of other classes do not count). num_tokens: the
    prompt tokens the caller will use (hit statistics are kept in tokens:
    hit tokens / queried tokens, per class).
    """

    hashes: list[str]
    traffic_class: str = "chat"
    num_tokens: int = 0


@message
class KVLookupReply:
    """kvindex -> worker: the longest stored prefix, in blocks (0 = miss, also when Redis is down).

    num_tokens: the tokens those blocks hold, capped at the request's
    ``num_tokens``. redis_ok: False when the index could not be consulted.
    """

    num_blocks: int
    num_tokens: int = 0
    redis_ok: bool = True


@message
class PrefillBooked:
    """gateway -> other gateways (``deepinfer.router.booked``): ``gateway_id`` sent request
    ``request_id`` to prefill worker ``worker_id``, predicting ``seconds`` of compute for
    ``tokens`` prompt tokens. The others count it in that worker's queue until its next load
    report (which then shows it), as they do their own."""

    gateway_id: str
    worker_id: str
    request_id: str
    seconds: float
    tokens: int


@message
class KVIndexHealthRequest:
    """anyone -> kvindex: report your state (``KVIndexHealth``)."""


@message
class KVIndexHealth:
    """kvindex -> anyone: index state and hit statistics.

    redis_ok: the index answers from Redis (False: every lookup is a miss).
    num_blocks / total_bytes: blocks indexed and their payload bytes (-1 when
    Redis is down). capacity_bytes: the eviction limit (0 = none).
    events_applied / gaps / replays: KV events applied, gaps in a worker's
    event ids seen, re-syncs from the storage tier done.
    hit_stats: traffic class -> {"lookups", "queried_tokens", "hit_tokens"}
    (counts since the index was created; see ``hit_rate``).
    lookup_timeouts: lookups answered as a miss because Redis was slower than the
    kvindex's ``lookup_timeout_s`` (since start).
    leading: this replica holds the leader lease (applies KV events, runs sweeps);
    leader: the replica that holds it ("" when none or Redis is down).
    """

    worker_id: str
    redis_ok: bool
    num_blocks: int = -1
    total_bytes: int = -1
    capacity_bytes: int = 0
    events_applied: int = 0
    gaps: int = 0
    replays: int = 0
    hit_stats: dict[str, dict] = field(default_factory=dict)
    lookup_timeouts: int = 0
    leading: bool = False
    leader: str = ""

    def hit_rate(self, traffic_class: str) -> float:
        """Cached prompt tokens / prompt tokens looked up for ``traffic_class`` (0 when none)."""
        s = self.hit_stats.get(traffic_class) or {}
        q = s.get("queried_tokens", 0)
        return s.get("hit_tokens", 0) / q if q else 0.0


@message
class ExpertStats:
    """MoE worker -> balancer (``deepinfer.experts.stats``): tokens routed since its last report.

    model: the balance domain, the weights' fingerprint (workers of one model share placements).
    counts: [L][E] (token, expert) pairs routed per MoE layer and logical expert in the window.
    rank_counts: [L][P] pairs computed per EP rank (P = ``num_ranks``), under the placement
    ``placement_version`` with ``num_slots`` slots. window_s: seconds the window covers.
    expert_bytes / replica_bytes: the worker's bytes of logical expert weights and the extra
    bytes its replicas cost (over all MoE layers).
    """

    model: str
    worker_id: str
    role: str
    counts: list[list[int]]
    rank_counts: list[list[int]]
    num_ranks: int
    num_slots: int
    placement_version: int = 0
    window_s: float = 0.0
    expert_bytes: int = 0
    replica_bytes: int = 0


@message
class ExpertPlacementUpdate:
    """balancer -> MoE workers (``deepinfer.experts.placement``, latest kept in the KV bucket).

    phy2log [L][R], log2phy [L][E][M] (-1 padded), logcnt [L][E]: the placement
    (``deepinfer.models.expert_placement``); rank p holds slots [p*R/P, (p+1)*R/P), P = num_ranks.
    version: increases by one per placement of a model; workers apply only a newer one.
    num_nodes / num_groups / policy ("hierarchical" or "global"): how it was computed.
    imbalance_before / imbalance_after: predicted max/mean tokens per EP rank (mean over
    layers) of the previous placement and of this one, on the balancer's moving average.
    """

    model: str
    version: int
    phy2log: list[list[int]]
    log2phy: list[list[list[int]]]
    logcnt: list[list[int]]
    num_ranks: int
    num_nodes: int = 1
    num_groups: int = 1
    policy: str = "global"
    imbalance_before: float = 0.0
    imbalance_after: float = 0.0


@message
class BalancerStatusRequest:
    """anyone -> balancer: report your state (``BalancerStatus``)."""


@message
class BalancerStatus:
    """balancer -> anyone. models: one map per model seen: ``model``, ``version`` (current
    placement, 0 = none published), ``workers`` (ids reporting), ``measured_imbalance`` (max/mean
    tokens per EP rank of the last window under the current placement, mean over layers; 0 =
    no data), ``predicted_imbalance`` (of the current placement on the moving average),
    ``rebalances``, ``replica_bytes`` (largest reported by a worker)."""

    worker_id: str
    models: list[dict] = field(default_factory=list)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _to_dict(msg) -> dict[str, Any]:
    # shallow: msgpack copies the field values into bytes at once (``dataclasses.asdict`` would
    # deep-copy every list first: about half of a token chunk's pack + unpack time); nested messages
    # (``NESTED``) turn into maps themselves
    d = {name: getattr(msg, name) for name in _field_names(type(msg))}
    for name in getattr(type(msg), "NESTED", {}):
        value = getattr(msg, name)
        d[name] = None if value is None else value.to_dict()
    d["v"] = SCHEMA_VERSION
    d["t"] = type(msg).__name__
    return d


def pack(msg) -> bytes:
    """Encode a registered message dataclass to msgpack bytes."""
    if type(msg).__name__ not in _REGISTRY:
        raise ProtocolError(f"not a protocol message: {type(msg).__name__}")
    return msgpack.packb(_to_dict(msg), use_bin_type=True)


def unpack(data: bytes, expect: type | tuple[type, ...] | None = None):
    """Decode msgpack bytes into its message dataclass.

    Raises ProtocolError on undecodable bytes, a schema version other than
    ``SCHEMA_VERSION``, an unknown type, or a type not in ``expect``.
    """
    try:
        d = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {e}") from e
    if not isinstance(d, dict):
        raise ProtocolError("message is not a map")
    if d.get("v") != SCHEMA_VERSION:
        raise ProtocolError(f"schema version {d.get('v')!r} != {SCHEMA_VERSION}")
    cls = _REGISTRY.get(d.get("t"))
    if cls is None:
        raise ProtocolError(f"unknown message type {d.get('t')!r}")
    if expect is not None and not issubclass(cls, expect):
        raise ProtocolError(f"expected {expect}, got {cls.__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in d.items() if k in names}
    for name, sub in getattr(cls, "NESTED", {}).items():
        kwargs[name] = sub.from_dict(kwargs.get(name))
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ProtocolError(f"bad {cls.__name__}: {e}") from e
