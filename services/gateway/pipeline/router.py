"""Prefill and decode routing in the gateway (docs/architecture.md, "Routing and admission").

Prefill, policy ``predicted`` (the default): the worker with the smallest predicted
finish time for this request, in seconds from now (Mooncake's Conductor picks its prefill
instance by predicted TTFT the same way, from a regression model: Qin et al., "Mooncake",
FAST '25, §6)::

    finish_w = queue_w + compute_w(n, c) + steps_w · a_w + load(c)

    queue_w    LoadReport.queued_prefill_s (the worker's predicted compute still queued)
               + the predicted compute of the requests this gateway sent w since that
               report: reports are up to one heartbeat stale, and without this a burst all
               lands on the worker that looked idle
    compute_w  b·n + d·n(c + n/2) + e·(c + n) with w's own fitted coefficients (its engine
               cost model, ``engine.cost_model``), n uncached prompt tokens after c cached ones
    steps_w·a  the per-step cost over the steps queue + request take at w's step time
               budget (ceil(work / budget); one step without a budget)
    load(c)    stored prefix blocks × kv_block_bytes / kv_load_bytes_per_s
    c          tokens of the longest stored prefix: the prompt's chained block hashes (the
               workers' fingerprint and the request's cache_salt) looked up in the kvindex;
               at the worker this gateway sent a request with the same leading blocks that
               has no first token yet, the blocks shared with it if more: the engine makes a
               prompt wait for blocks a running request is computing and then hits them
               (in-flight prefix sharing), so that worker computes them once

Ties go to the worker that computes less: the score is ``finish_w + compute_weight · compute_w``
(default weight 0.1), so where a worker already computing the prompt's prefix would finish about
as soon as an idle one that would compute it again, it gets the request and the capacity is kept.

Not by cache locality: any prefill worker loads any stored prefix from the shared tier, so a
prefix shortens every worker's compute alike and costs every worker the same load time. Only a
prefix still being computed is local, until its blocks are stored: then the worker computing it
is predicted to finish the request sooner, and gets it when that is the earliest finish.

Baselines (``--prefill-router``): ``round_robin``; ``least_loaded`` (fewest active + waiting
requests, counting those sent since the report); ``dynamo``, the cost of NVIDIA Dynamo's KV
router ``w·prefill_blocks + decode_blocks`` (Dynamo docs, "Router design": potential prefill
blocks = prompt blocks not overlapping the cache, potential active blocks = blocks held + the
request's), with the stored prefix as the overlap (every worker can load it; 0 without a
kvindex) and the worker's queued prefill tokens counted as prefill blocks. Ties go round robin.

Decode: among decode workers whose free KV holds the request (prompt +
``decode_reserve_tokens`` of output, plus what was sent them since their report), the lowest
``(kv_used + sent + need) / capacity + decode_active_weight · requests / decode_max_seqs``;
never one beyond capacity (none fits: None, and prefill hands off to the queue group, where a
worker's scheduler makes the request wait).

The router only ranks: ``admission`` filters and rejects, ``commit`` books the choice,
``dispatch.submit_prompt`` tries the ranked workers and reports back ``accepted`` / ``failed``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Collection

from deepinfer.gateway.pipeline.registry import WorkerInfo, WorkerRegistry
from deepinfer.kvstore.hashing import block_hashes
from deepinfer.protocol import LoadReport
from deepinfer.telemetry import get_logger

PREFILL_POLICIES = ("predicted", "round_robin", "least_loaded", "dynamo")
log = get_logger(__name__)

BIAS_WINDOW = 64  # recent requests whose TTFT prediction errors ``ttft_bias_s`` takes the median of
BIAS_MIN_SAMPLES = 8
BIAS_MAX_AGE_S = 30.0  # an error older than this no longer counts (first tokens, seconds)
MAX_COMPUTING = 4096  # prompts per worker remembered as being computed (oldest dropped beyond)


@dataclass
class RouterConfig:
    """prefill_policy: one of ``PREFILL_POLICIES``.
    kv_load_bytes_per_s: storage-tier read rate for stored prefix blocks, bytes/s (default 2 GB/s:
    verified page-cache reads here, docs/architecture.md "Storage tier").
    dynamo_overlap_weight: Dynamo's ``overlap_score_weight`` w (its default: 1).
    decode_active_weight / decode_max_seqs: weight of a decode worker's requests, normalised
    by the sequences it batches: its reported ``max_num_seqs``, else ``decode_max_seqs`` (the
    engine's ``--max-num-seqs`` default).
    decode_reserve_tokens: output tokens a decode worker must hold room for beyond the prompt.
    decode_max_waiting: requests a decode worker may have queued beyond one full batch (running,
    waiting and booked to it, minus its batch) before it takes no more.
    max_targeted: chosen prefill workers tried in turn before the queue group.
    targeted_timeout_s: how long one targeted submit may take before the next is tried.
    report_margin_s: a request accepted this long before a worker's report is in that report
    (work sent since a report is counted until then).
    compute_weight: the predicted policy's score adds this times the request's own compute
    seconds to its finish time: near ties go to the worker that computes less.
    prefill_role: the workers that compute prompts: "prefill" (disaggregated serving), or
    "decode" (aggregated: each worker prefills and decodes its requests; a plan's decode worker
    is then its first candidate)."""

    prefill_policy: str = "predicted"
    kv_load_bytes_per_s: float = 2e9
    dynamo_overlap_weight: float = 1.0
    decode_active_weight: float = 1.0
    decode_max_seqs: int = 64
    decode_reserve_tokens: int = 256
    decode_max_waiting: int = 64
    max_targeted: int = 2
    targeted_timeout_s: float = 2.0
    report_margin_s: float = 0.1
    compute_weight: float = 0.1
    prefill_role: str = "prefill"

    def __post_init__(self):
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill policy {self.prefill_policy!r}: expected one of {', '.join(PREFILL_POLICIES)}")
        if self.prefill_role not in ("prefill", "decode"):
            raise ValueError(f"prefill role {self.prefill_role!r}: expected prefill or decode")


@dataclass
class PromptShape:
    """What routing needs of a request: prompt tokens, the stored prefix, output budget."""

    num_tokens: int
    cached_tokens: int = 0  # tokens of the longest stored prefix (kvindex)
    stored_blocks: int = 0
    max_tokens: int = 16
    block_hashes: tuple[str, ...] = ()  # the prompt's full blocks' chained hashes (empty: not hashed)
    block_size: int = 0  # tokens per hashed block

    @property
    def new_tokens(self) -> int:
        """Tokens to compute (at least one: its logits give the first token)."""
        return max(1, self.num_tokens - self.cached_tokens)


@dataclass
class Candidate:
    """A prefill worker for one request. Seconds from now: ``finish_s`` (= predicted TTFT there),
    ``queue_s`` (its queued compute before this request), ``compute_s`` (this request's)."""

    worker_id: str
    finish_s: float
    queue_s: float
    compute_s: float
    score: float


@dataclass
class Plan:
    """One request's routing: prefill candidates best first, the decode worker, what is booked."""

    request_id: str
    shape: PromptShape
    candidates: list[Candidate]
    decode_worker: str | None = None
    router: "Router | None" = field(default=None, repr=False)
    started_at: float | None = None  # router clock, s: the request's receipt (TTFT is measured from here)
    waited_s: float = 0.0  # seconds from the request's receipt to its routing (parsing, tokenizing, images)

    @property
    def predicted_ttft_s(self) -> float | None:
        return self.candidates[0].finish_s if self.candidates else None


@dataclass
class _Sent:
    seconds: float  # predicted prefill compute (prefill) / 0 (decode)
    tokens: int  # prompt tokens to compute (prefill) / KV tokens needed (decode)
    until: float  # dropped after this (a safety net; decode: the expected handoff)
    accepted_at: float | None = None


def piece_cost(r: LoadReport, n: int, c: int) -> float:
    """Seconds worker ``r`` predicts for computing n tokens after c cached ones (its step cost model)."""
    return r.cost_b * n + r.cost_d * n * (c + n / 2) + r.cost_e * (c + n)


def finish_time(r: LoadReport, queue_s: float, shape: PromptShape, load_bytes_per_s: float) -> tuple[float, float]:
    """(predicted finish, own compute) in seconds for ``shape`` at a worker with ``queue_s`` queued."""
    compute = piece_cost(r, shape.new_tokens, shape.num_tokens - shape.new_tokens)
    work = queue_s + compute
    steps = math.ceil(work / r.step_time_budget_s) if r.step_time_budget_s > 0 else 1
    load = shape.stored_blocks * r.kv_block_bytes / load_bytes_per_s if load_bytes_per_s > 0 else 0.0
    return work + max(1, steps) * r.cost_a + load, compute


class InflightPrefixes:
    """Per worker, the prompts being computed there (sent by this gateway, no first token yet):
    each one's full-block chained hashes, and how many of those prompts hold each hash. Chained
    hashes make a hash at position i stand for the whole prefix up to i, so the blocks a new
    prompt shares with any of them is its leading run of counted hashes: O(shared blocks)."""

    def __init__(self, limit: int = MAX_COMPUTING):
        self.limit = limit  # prompts per worker (oldest forgotten beyond: a safety net)
        self._prompts: dict[str, dict[str, tuple[str, ...]]] = {}  # worker -> request id -> hashes
        self._blocks: dict[str, Counter] = {}  # worker -> hash -> prompts holding it

    def add(self, worker_id: str, request_id: str, hashes: tuple[str, ...]) -> None:
        """``request_id``'s prompt (``hashes``) is computed at ``worker_id`` now, nowhere else."""
        self.remove(request_id)
        prompts = self._prompts.setdefault(worker_id, {})
        prompts[request_id] = hashes
        self._blocks.setdefault(worker_id, Counter()).update(hashes)
        if len(prompts) > self.limit:
            self.remove(next(iter(prompts)), worker_id)

    def remove(self, request_id: str, worker_id: str | None = None) -> None:
        """``request_id`` is no longer computed at ``worker_id`` (None: anywhere)."""
        for wid in [worker_id] if worker_id is not None else list(self._prompts):
            hashes = self._prompts.get(wid, {}).pop(request_id, None)
            if hashes is not None:
                blocks = self._blocks[wid]
                blocks.subtract(hashes)
                for h in hashes:
                    if h in blocks and blocks[h] <= 0:
                        del blocks[h]

    def shared_blocks(self, worker_id: str, hashes: tuple[str, ...]) -> int:
        """Leading blocks of ``hashes`` that a prompt being computed at ``worker_id`` has too."""
        blocks = self._blocks.get(worker_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def keep_only(self, workers: set[str]) -> None:
        """Forget the workers not in ``workers`` (dead)."""
        for wid in [w for w in self._prompts if w not in workers]:
            del self._prompts[wid]
            self._blocks.pop(wid, None)

    def __len__(self) -> int:
        return sum(len(p) for p in self._prompts.values())


class Router:
    """Ranks prefill workers and picks decode workers from the registry's live ``LoadReport`` s."""

    def __init__(self, registry: WorkerRegistry, config: RouterConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.config = config or RouterConfig()
        self.clock = clock
        self._prefill_sent: dict[str, dict[str, _Sent]] = {}
        self._decode_sent: dict[str, dict[str, _Sent]] = {}
        # worker -> request id -> its TTFT deadline (monotonic s), while a TTFT SLO is set
        self._awaiting: dict[str, dict[str, float]] = {}
        self._computing = InflightPrefixes()  # prompts booked or accepted, until their first token
        self._turn = 0  # round robin and tie-breaking
        self._off_tier: set[str] = set()  # workers found on another storage tier (logged once)
        # called with (worker id, request id, seconds, tokens) on each prefill booking (the gateway
        # tells the other gateways: ``peer_booked``); None: nobody to tell
        self.on_booked: Callable[[str, str, float, int], None] | None = None
        # (when, measured - predicted TTFT), seconds
        self._errors: deque[tuple[float, float]] = deque(maxlen=BIAS_WINDOW)
        # request id -> when its first token is predicted (router clock, s), until it arrives or ends
        self._expected: dict[str, float] = {}

    # --- the request ---------------------------------------------------------------------
    def hash_params(self) -> tuple[str, int] | None:
        """(fingerprint, block size) the live prefill workers hash prompts with, or None if unknown."""
        for info in self._live(self.config.prefill_role):
            if info.report.fingerprint and info.report.block_size > 0:
                return info.report.fingerprint, info.report.block_size
        return None

    async def shape(self, index, prompt_ids: list[int], traffic_class: str = "chat",
                    cache_salt: str | None = None, max_tokens: int = 16, images=()) -> PromptShape:
        """The request's shape; ``index`` (a ``KVIndexClient``, or None: no lookup) gives the
        stored prefix, counted as prefill does (the last prompt token is always computed);
        images: the prompt's [offset, length, content hash], keys of the blocks they overlap."""
        shape = PromptShape(num_tokens=len(prompt_ids), max_tokens=max_tokens)
        params = self.hash_params() if index is not None else None
        if params is None:
            return shape
        fingerprint, bs = params
        hashes = block_hashes(prompt_ids[: (len(prompt_ids) - 1) // bs * bs], bs, fingerprint,
                              (cache_salt or "").encode(), [tuple(i) for i in images or ()])
        shape.block_hashes, shape.block_size = tuple(hashes), bs
        if hashes:
            # num_tokens=0: the index keeps hit statistics for the workers' lookups, not for ours
            shape.stored_blocks = await index.lookup(hashes, traffic_class, num_tokens=0)
            shape.cached_tokens = shape.stored_blocks * bs
        return shape

    def plan(self, request_id: str, shape: PromptShape) -> Plan:
        """Rank the live prefill workers for ``shape`` (no side effects but the round-robin turn)."""
        return Plan(request_id, shape, self.rank(shape, self.config.prefill_role), router=self)

    def place(self, shape: PromptShape, role: str, exclude: Collection[str] = (), request_id: str = "") -> str | None:
        """The one placement decision, for a retry or a failover as for a first submit (``plan`` and
        ``commit`` rank and choose the same way): the worker of ``role`` a request of ``shape`` goes
        to, leaving out ``exclude`` (workers the request left). "decode": ``choose_decode``'s pick,
        booked for ``request_id``; any other role (a prompt to compute): the best of ``rank``.
        None when no live worker qualifies (the caller submits to the role's queue group)."""
        if role == "decode":
            return self.choose_decode(shape, request_id, self.clock() + 2 * self._interval(), exclude)
        ranked = [c for c in self.rank(shape, role) if c.worker_id not in exclude]
        return ranked[0].worker_id if ranked else None

    def rank(self, shape: PromptShape, role: str) -> list[Candidate]:
        """The live, non-draining workers of ``role`` that would compute ``shape``'s prompt, best first
        (``RouterConfig.prefill_policy``; ties by a rotating turn)."""
        workers = sorted(self._live(role), key=lambda i: i.report.worker_id)
        turn, self._turn = self._turn, self._turn + 1
        ranked = []
        for pos, info in enumerate(workers):
            r, sent = info.report, self._pending(self._prefill_sent, info)
            queue_s = r.queued_prefill_s + sum(s.seconds for s in sent)
            finish, compute = finish_time(r, queue_s, self._with_inflight(shape, r.worker_id),
                                          self.config.kv_load_bytes_per_s)
            score = self._score(r, sent, shape, finish, compute, (pos - turn) % len(workers))
            ranked.append((score, (pos - turn) % len(workers), Candidate(r.worker_id, finish, queue_s, compute, score)))
        ranked.sort(key=lambda t: (t[0], t[1]))
        return [c for _, _, c in ranked]

    def _note_computing(self, plan: Plan, worker_id: str) -> None:
        """``plan``'s prompt is being computed at ``worker_id`` (and nowhere else) until its first token."""
        if plan.shape.block_hashes:
            self._computing.add(worker_id, plan.request_id, plan.shape.block_hashes)

    def _with_inflight(self, shape: PromptShape, worker_id: str) -> PromptShape:
        """``shape`` as ``worker_id`` would compute it: its cached tokens count the leading blocks
        it shares with a request this gateway sent there that has no first token yet (that worker
        computes them once; in-flight prefix sharing), where more than the stored prefix."""
        shared = self._computing.shared_blocks(worker_id, shape.block_hashes)
        cached = min(shared * shape.block_size, shape.num_tokens - 1)  # the last token is computed
        if cached <= shape.cached_tokens:
            return shape
        return dataclasses.replace(shape, cached_tokens=cached)

    def _score(self, r: LoadReport, sent: list[_Sent], shape: PromptShape, finish: float, compute: float,
               rotation: int) -> float:
        policy = self.config.prefill_policy
        if policy == "predicted":
            return finish + self.config.compute_weight * compute
        if policy == "round_robin":
            return rotation
        if policy == "least_loaded":
            return r.active_requests + r.waiting_requests + len(sent)
        bs = r.block_size or 16  # dynamo
        prefill_blocks = (r.queued_prefill_tokens + sum(s.tokens for s in sent) + shape.new_tokens) / bs
        decode_blocks = r.kv_tokens_used / bs + math.ceil(shape.num_tokens / bs)
        return self.config.dynamo_overlap_weight * prefill_blocks + decode_blocks

    # --- booking ---------------------------------------------------------------------------
    def commit(self, plan: Plan, ttft_slo_s: float | None = None, started_at: float | None = None) -> None:
        """Book the plan's first prefill candidate and choose (and book) its decode worker.
        With ``ttft_slo_s``, the request's deadline (``started_at`` + SLO; default: now minus the
        plan's ``waited_s``, the request's receipt) is tracked until ``first_token`` (``slack``)."""
        now = self.clock()
        plan.started_at = now - plan.waited_s if started_at is None else started_at
        if self._turn % 256 == 0:
            self._forget_dead()
        if plan.candidates:
            cand = plan.candidates[0]
            entry = self._book_prefill(plan, cand.worker_id, now)
            if self.on_booked is not None:
                self.on_booked(cand.worker_id, plan.request_id, entry.seconds, entry.tokens)
            self._note_computing(plan, cand.worker_id)
            if ttft_slo_s is not None:
                self._awaiting.setdefault(cand.worker_id, {})[plan.request_id] = plan.started_at + ttft_slo_s
            self._expected[plan.request_id] = plan.started_at + plan.waited_s + cand.finish_s
            if len(self._expected) > MAX_COMPUTING:  # ends never reported: the oldest go
                del self._expected[next(iter(self._expected))]
        if self.config.prefill_role == "decode":  # aggregated: the worker that prefills decodes too
            plan.decode_worker = plan.candidates[0].worker_id if plan.candidates else None
            return
        ttft = plan.predicted_ttft_s or 0.0
        plan.decode_worker = self.choose_decode(plan.shape, plan.request_id, until=now + ttft + 2 * self._interval())

    def accepted(self, plan: Plan, worker_id: str) -> None:
        """``worker_id`` accepted the prefill (it may differ from the booked one: a fallback)."""
        now = self.clock()
        for wid, sent in self._prefill_sent.items():
            if wid != worker_id:
                sent.pop(plan.request_id, None)
        for wid, waiting in list(self._awaiting.items()):
            if wid != worker_id and plan.request_id in waiting:
                self._awaiting.setdefault(worker_id, {})[plan.request_id] = waiting.pop(plan.request_id)
        self._note_computing(plan, worker_id)
        entry = self._prefill_sent.get(worker_id, {}).get(plan.request_id)
        if entry is None:
            entry = self._book_prefill(plan, worker_id, now)
        entry.accepted_at = now

    def failed(self, plan: Plan, worker_id: str) -> None:
        """``worker_id`` refused the prefill or did not answer: unbook it there."""
        self._prefill_sent.get(worker_id, {}).pop(plan.request_id, None)
        self._computing.remove(plan.request_id, worker_id)

    def forget(self, plan: Plan) -> None:
        """No prefill worker took the request (or it was refused admission): unbook it everywhere."""
        for book in (self._prefill_sent, self._decode_sent, self._awaiting):
            for sent in book.values():
                sent.pop(plan.request_id, None)
        self._computing.remove(plan.request_id)
        self._expected.pop(plan.request_id, None)

    def first_token(self, plan: Plan, arrived: bool = False) -> None:
        """The request's first token ``arrived`` (or it ended without): no deadline to keep any more.
        An arrival also records the prediction's error (``ttft_bias_s``)."""
        for waiting in self._awaiting.values():
            waiting.pop(plan.request_id, None)
        self._computing.remove(plan.request_id)
        self._expected.pop(plan.request_id, None)
        if arrived and plan.started_at is not None and plan.predicted_ttft_s is not None:
            now = self.clock()
            self._errors.append((now, now - plan.started_at - plan.waited_s - plan.predicted_ttft_s))
            plan.started_at = None

    def ttft_bias_s(self) -> float:
        """How much later than predicted first tokens arrive here, seconds (>= 0): the median over
        the last ``BIAS_WINDOW`` requests of measured TTFT (gateway: routing to first chunk) minus
        predicted. It is what the model leaves out: the gateway's and the network's time, steps
        slower than the workers' fitted cost models (CPU contention), prefix loads. A request still
        awaiting its first token past its predicted time counts too, with its lateness so far (a
        lower bound of its error): in a burst the errors show while the requests wait, not seconds
        later when their first tokens come. 0 while fewer than ``BIAS_MIN_SAMPLES`` came in the
        last ``BIAS_MAX_AGE_S``: a bias that refuses every request gets no new samples, so it must
        age out or it would refuse everything for ever (admission then lets requests in again and
        measures anew). The median, not a high quantile: the scheduler lets later prompts overtake
        earlier ones, which spreads the errors both ways around it."""
        now = self.clock()
        since = now - BIAS_MAX_AGE_S
        recent = [error for when, error in self._errors if when >= since]
        recent += [now - at for at in self._expected.values() if since <= at < now]
        if len(recent) < BIAS_MIN_SAMPLES:
            return 0.0
        return max(0.0, statistics.median(recent[-BIAS_WINDOW:]))

    def slack(self, worker_id: str) -> float:
        """Seconds until the earliest TTFT deadline among the requests this gateway sent
        ``worker_id`` that await their first token (inf: none). A work-conserving worker that
        drains its queue within this meets every one of them, in whatever order its scheduler
        serves them (ours lets a new prompt's first chunk run ahead of the running ones).
        Entries past their deadline are dropped."""
        waiting = self._awaiting.get(worker_id)
        if not waiting:
            return math.inf
        now = self.clock()
        for rid in [rid for rid, deadline in waiting.items() if now > deadline]:
            del waiting[rid]  # late already (or its end was never reported): nothing left to protect
        return min(waiting.values(), default=math.inf) - now

    def peer_booked(self, worker_id: str, request_id: str, seconds: float, tokens: int) -> None:
        """Another gateway booked ``seconds`` of predicted compute (``tokens`` prompt tokens) on
        prefill worker ``worker_id``: count it in that worker's queue, as accepted now, so the
        worker's next load report (which shows it) retires it (``_pending``). Gateways sharing
        workers then double-book only within the message's trip, not a whole report period."""
        now = self.clock()
        self._prefill_sent.setdefault(worker_id, {})[request_id] = _Sent(seconds, tokens, until=now + 60.0,
                                                                          accepted_at=now)

    def _book_prefill(self, plan: Plan, worker_id: str, now: float) -> _Sent:
        cand = next((c for c in plan.candidates if c.worker_id == worker_id), None)
        seconds = cand.compute_s if cand else 0.0
        entry = _Sent(seconds, plan.shape.new_tokens, until=now + 60.0)
        self._prefill_sent.setdefault(worker_id, {})[plan.request_id] = entry
        return entry

    # --- decode ----------------------------------------------------------------------------
    def choose_decode(self, shape: PromptShape, request_id: str, until: float,
                      exclude: Collection[str] = ()) -> str | None:
        """The decode worker for ``shape`` (booked until ``until``), not one of ``exclude``, or None
        when none has room: free KV for the prompt and its reserve, and a queue within
        ``decode_max_waiting``."""
        cfg = self.config
        need = shape.num_tokens + min(shape.max_tokens, cfg.decode_reserve_tokens)
        workers = sorted((i for i in self._live("decode") if i.report.worker_id not in exclude),
                         key=lambda i: i.report.worker_id)
        best = None
        for pos, info in enumerate(workers):
            r, sent = info.report, self._pending(self._decode_sent, info)
            used = r.kv_tokens_used + sum(s.tokens for s in sent) + need
            if r.kv_tokens_capacity > 0 and used > r.kv_tokens_capacity:
                continue  # never beyond capacity
            requests, seqs = r.active_requests + r.waiting_requests + len(sent), self._max_seqs(r)
            if requests >= seqs + cfg.decode_max_waiting:
                continue  # a queue that long: the request would wait for whole generations to end
            kv = used / r.kv_tokens_capacity if r.kv_tokens_capacity > 0 else 0.0
            busy = requests / max(1, seqs)
            key = (kv + cfg.decode_active_weight * busy, (pos - self._turn) % len(workers))
            if best is None or key < best[0]:
                best = (key, r.worker_id)
        if best is None:
            return None
        self._decode_sent.setdefault(best[1], {})[request_id] = _Sent(0.0, need, until=until)
        return best[1]

    # --- helpers ---------------------------------------------------------------------------
    def decode_full(self, shape: PromptShape) -> bool:
        """Whether live decode workers report and, as their reports stand, none has room for
        ``shape``: free KV for the prompt and its reserve, a queue within ``decode_max_waiting``.
        (Bookings are left out: they hold room for requests still in prefill queues, which
        ``choose_decode`` spreads by, but which are not on any decode worker yet.)"""
        cfg, live = self.config, self._live("decode")
        need = shape.num_tokens + min(shape.max_tokens, cfg.decode_reserve_tokens)
        return bool(live) and not any(
            (r.kv_tokens_capacity <= 0 or r.kv_tokens_used + need <= r.kv_tokens_capacity)
            and r.active_requests + r.waiting_requests < self._max_seqs(r) + cfg.decode_max_waiting
            for r in (i.report for i in live))

    def _max_seqs(self, report: LoadReport) -> int:
        """The batch a decode worker runs: its reported ``--max-num-seqs``, else ``decode_max_seqs``."""
        return report.max_num_seqs or self.config.decode_max_seqs

    def tier(self) -> str:
        """The storage tier the mesh's workers share: the one most live prefill and decode workers
        report (on a tie, the one of the worker heard first); "" when none says."""
        tiers = Counter(i.report.tier_id for role in ("prefill", "decode") for i in self.registry.alive(role)
                        if i.report.tier_id)
        return tiers.most_common(1)[0][0] if tiers else ""

    def _live(self, role: str) -> list[WorkerInfo]:
        """Live workers of ``role`` that take new requests: not draining, and on the mesh's storage
        tier (a worker on another cannot read what the others store, nor they what it stores: its
        handoffs and resumes would fail; it is logged once and left out)."""
        tier, out = self.tier(), []
        for i in self.registry.alive(role):
            if i.report.tier_id and tier and i.report.tier_id != tier:
                if i.report.worker_id not in self._off_tier:
                    self._off_tier.add(i.report.worker_id)
                    log.warning("worker_on_another_storage_tier", worker=i.report.worker_id,
                                tier=i.report.tier_id, mesh_tier=tier)
            elif not i.report.draining:
                out.append(i)
        return out

    def _interval(self) -> float:
        return max((i.report.interval_s for i in self._live("decode")), default=1.0)

    def _pending(self, book: dict[str, dict[str, _Sent]], info: WorkerInfo) -> list[_Sent]:
        """What was sent ``info``'s worker and its last report does not show yet (prunes the rest)."""
        sent = book.get(info.report.worker_id)
        if not sent:
            return []
        now, margin = self.clock(), self.config.report_margin_s
        for rid in [rid for rid, s in sent.items()
                    if now > s.until or (s.accepted_at is not None and info.last_seen > s.accepted_at + margin)]:
            del sent[rid]
        return list(sent.values())

    def _forget_dead(self) -> None:
        alive = {i.report.worker_id for i in self.registry.alive()}
        for book in (self._prefill_sent, self._decode_sent, self._awaiting):
            for wid in [w for w in book if w not in alive]:
                del book[wid]
        self._computing.keep_only(alive)

    def sent_counts(self) -> dict[str, int]:
        """Requests booked per worker and not yet in its reports (for tests and /health)."""
        out = {}
        for book in (self._prefill_sent, self._decode_sent):
            for wid, sent in book.items():
                if sent:
                    out[wid] = out.get(wid, 0) + len(sent)
        return out
