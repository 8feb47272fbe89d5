"""Prometheus metrics: their names, what feeds them, and the workers' /metrics server.

Names follow Prometheus conventions: the ``deepinfer_`` prefix, the unit in the
name (``_seconds``, ``_bytes``, ``_tokens``; ``_ratio`` for unitless ratios) and
``_total`` on counters. docs/observability.md lists every metric.

Two kinds, so no hot loop gets metric code:

* instruments updated where their event happens, in the process's default
  registry: NATS request and handler latency (``MeshClient``), the gateway's
  per-request histograms and counters (``deepinfer.gateway.metrics``) and the
  prefill workers' prefix-cache counters per traffic class (once per request);
* values read at scrape time from what the services keep anyway: a worker's
  ``ServiceCollector`` asks its service for ``metric_families()`` on the
  service's event loop (where ``load_report()`` and the handlers run) and the
  ``*_families`` functions below turn a ``LoadReport``, the storage tier's
  ``StoreStats``, the speculative decoder's counters, a vision worker's counters,
  ``KVIndexHealth`` or ``BalancerStatus`` into metric families.

Workers serve ``/metrics`` on ``--metrics-port`` (env ``DEEPINFER_METRICS_PORT``;
0, the default, serves none, so many workers can share a host) through
``start_metrics_server``, beside ``/health`` (the process and its event loop answer) and
``/ready`` (connected, set up, not draining); the gateway serves them on its HTTP port.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from typing import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, disable_created_metrics, \
    generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from deepinfer.telemetry.logs import get_logger

log = get_logger(__name__)

disable_created_metrics()  # no ``*_created`` series next to every counter

# --- buckets (seconds) ---------------------------------------------------------------
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0)
NATS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# --- every process: the mesh -----------------------------------------------------------
NATS_REQUEST_SECONDS = Histogram(
    "deepinfer_nats_request_seconds",
    "NATS request/reply latency as the requester sees it (MeshClient.request), by subject family and outcome "
    "(ok, timeout, no_responders, remote_error, protocol_error, cancelled, error)",
    ["subject", "outcome"], buckets=NATS_BUCKETS)
NATS_HANDLER_SECONDS = Histogram(
    "deepinfer_nats_handler_seconds",
    "Time a service spends handling one NATS message (MeshClient.subscribe handlers), by handler",
    ["handler"], buckets=NATS_BUCKETS)

# --- the gateway (deepinfer.gateway.metrics feeds them) ------------------------------------
TIME_TO_FIRST_TOKEN = Histogram(
    "deepinfer_time_to_first_token_seconds",
    "From the HTTP request's arrival at the gateway to the first generated token of a choice, by API endpoint",
    ["endpoint"], buckets=TTFT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram(
    "deepinfer_inter_token_latency_seconds",
    "Time between consecutive generated tokens of a choice at the gateway (a chunk of n tokens counts n "
    "gaps of its delay / n), by API endpoint",
    ["endpoint"], buckets=ITL_BUCKETS)
E2E_REQUEST_LATENCY = Histogram(
    "deepinfer_e2e_request_latency_seconds",
    "From the HTTP request's arrival to its last response byte, for generation requests answered 2xx/3xx, "
    "by API endpoint",
    ["endpoint"], buckets=E2E_BUCKETS)
HTTP_REQUESTS = Counter(
    "deepinfer_http_requests_total",
    "HTTP requests the gateway answered, by endpoint and status code (429: admission refused, "
    "503: no worker, 499: client gone before the answer)",
    ["endpoint", "status"])
REQUESTS_FINISHED = Counter(
    "deepinfer_requests_finished_total",
    "Generation choices that streamed, by endpoint and finish reason (stop, length, ...; error / abort: "
    "the worker failed or dropped it; incomplete: the stream failed or the client left first)",
    ["endpoint", "finish_reason"])
GENERATION_TOKENS = Counter(
    "deepinfer_generation_tokens_total", "Tokens generated and received by the gateway, by endpoint", ["endpoint"])
PROMPT_TOKENS = Counter(
    "deepinfer_prompt_tokens_total", "Prompt tokens of the choices that got a first token, by traffic class",
    ["traffic_class"])
PROMPT_CACHED_TOKENS = Counter(
    "deepinfer_prompt_cached_tokens_total",
    "Of deepinfer_prompt_tokens_total, the tokens prefill did not recompute (prefix cache or storage tier), "
    "by traffic class", ["traffic_class"])

# --- prefill workers --------------------------------------------------------------------
PREFIX_CACHE_HIT_TOKENS = Counter(
    "deepinfer_prefix_cache_hit_tokens_total",
    "Prompt tokens a prefill worker took from its prefix cache (including blocks it loaded from the storage "
    "tier), by traffic class", ["traffic_class"])
PREFIX_CACHE_QUERIED_TOKENS = Counter(
    "deepinfer_prefix_cache_queried_tokens_total",
    "Prompt tokens admitted by a prefill worker's engine (hit rate = hit / queried), by traffic class",
    ["traffic_class"])


# --- helpers: the mesh ----------------------------------------------------------------------
def subject_family(subject: str) -> str:
    """A NATS subject without its per-worker or per-request part (a low-cardinality label):
    ``deepinfer.prefill.<worker>.submit`` -> ``deepinfer.prefill.submit``,
    ``deepinfer.stream.<request>`` -> ``deepinfer.stream``,
    ``deepinfer.load.<role>.<worker>`` -> ``deepinfer.load.<role>``,
    ``deepinfer.kv.events.<worker>`` -> ``deepinfer.kv.events``, ``$JS.API...`` -> ``$JS``."""
    parts = subject.split(".")
    if parts[0] != "deepinfer":  # JetStream API, inboxes: their first token; a handler's name as it is
        return parts[0] if subject.startswith(("$", "_INBOX")) else subject
    if len(parts) < 3:
        return subject
    if parts[1] == "stream":
        return "deepinfer.stream"
    if parts[1] in ("load", "kv"):
        return ".".join(parts[:3])
    if len(parts) >= 4:  # deepinfer.<role>.<worker_id>.<verb>
        return ".".join([parts[0], parts[1], parts[-1]])
    return subject


_OUTCOMES = {"RequestTimeout": "timeout", "NoResponders": "no_responders", "RemoteError": "remote_error",
             "ProtocolError": "protocol_error", "CancelledError": "cancelled"}


def timed_request(fn):
    """Decorator of ``MeshClient.request(self, subject, ...)``: observe deepinfer_nats_request_seconds."""

    @functools.wraps(fn)
    async def wrapper(self, subject: str, *args, **kwargs):
        start, outcome = time.perf_counter(), "ok"
        try:
            return await fn(self, subject, *args, **kwargs)
        except BaseException as e:
            outcome = _OUTCOMES.get(type(e).__name__, "error")
            raise
        finally:
            NATS_REQUEST_SECONDS.labels(subject_family(subject), outcome).observe(time.perf_counter() - start)

    return wrapper


def timed_handler(handler, name: str):
    """``handler`` (an async message handler) observing deepinfer_nats_handler_seconds{handler=name}."""
    hist = NATS_HANDLER_SECONDS.labels(subject_family(name))

    @functools.wraps(handler)
    async def wrapper(msg):
        start = time.perf_counter()
        try:
            return await handler(msg)
        finally:
            hist.observe(time.perf_counter() - start)

    return wrapper


def count_prefix(traffic_class: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
    """A prefill worker admitted a prompt: its tokens and those served from the prefix cache."""
    cls = traffic_class or "chat"
    PREFIX_CACHE_QUERIED_TOKENS.labels(cls).inc(num_prompt_tokens)
    PREFIX_CACHE_HIT_TOKENS.labels(cls).inc(num_cached_tokens)


# --- families read at scrape time ------------------------------------------------------------
def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def service_families(role: str, worker_id: str, draining: bool) -> list:
    """Every worker: who it is, and whether it is draining."""
    info = GaugeMetricFamily("deepinfer_service_info", "Always 1: the service's role and worker id",
                             labels=["role", "worker_id"])
    info.add_metric([role, worker_id], 1)
    return [info, _gauge("deepinfer_service_draining", "1 while the service drains (SIGTERM), else 0", int(draining))]


def load_report_families(r) -> list:
    """An engine worker's ``LoadReport`` (``EngineWorker.load_report``)."""
    fams = [
        _gauge("deepinfer_requests_running", "Requests in the engine's running batch", r.active_requests),
        _gauge("deepinfer_requests_waiting", "Requests queued in the engine, not scheduled yet (queue depth)",
               r.waiting_requests),
        _gauge("deepinfer_kv_cache_usage_ratio", "Share of the engine's KV cache in use (0-1)",
               r.kv_tokens_used / r.kv_tokens_capacity if r.kv_tokens_capacity else 0.0),
        _gauge("deepinfer_kv_block_size_tokens", "Tokens per KV block", r.block_size),
        _gauge("deepinfer_kv_block_bytes", "Bytes of one KV block over all layers", r.kv_block_bytes),
        _gauge("deepinfer_queued_prefill_tokens", "Prompt tokens still to compute over waiting and running requests",
               r.queued_prefill_tokens),
        _gauge("deepinfer_queued_prefill_seconds", "The cost model's predicted compute for those tokens",
               r.queued_prefill_s),
        _gauge("deepinfer_engine_peak_batch_size", "Most sequences in one forward step since start",
               r.peak_batch_size),
        _counter("deepinfer_engine_steps_total", "Engine steps (forward passes)", r.steps),
        _counter("deepinfer_engine_busy_seconds_total", "Seconds spent in forward passes", r.busy_s),
        _counter("deepinfer_engine_requests_finished_total", "Requests finished (or handed off) by the engine",
                 r.finished_requests),
        _counter("deepinfer_requests_aborted_total", "Requests stopped on an abort (client gone, stop string, moved)",
                 r.aborted_requests),
        _counter("deepinfer_engine_computed_tokens_total", "Tokens fed through the model (not cache hits)",
                 r.computed_tokens),
        _counter("deepinfer_engine_prefix_hit_tokens_total",
                 "Prompt tokens served from this engine's prefix cache, every traffic class", r.prefix_hit_tokens),
        _counter("deepinfer_engine_prefix_queried_tokens_total",
                 "Prompt tokens this engine looked up in its prefix cache, every traffic class",
                 r.prefix_queried_tokens),
        _counter("deepinfer_prefix_replayed_tokens_total", "Prefix tokens fed again by bounded SWA replays",
                 r.replayed_tokens),
        _gauge("deepinfer_swa_cache_bytes", "Bytes held by the SWA state cache (hybrid models)", r.swa_cache_bytes),
        _counter("deepinfer_swa_cache_hits_total", "SWA state cache block lookups that hit", r.swa_cache_hits),
        _counter("deepinfer_swa_cache_misses_total", "SWA state cache block lookups that missed", r.swa_cache_misses),
    ]
    paths = CounterMetricFamily("deepinfer_prefix_admissions_total",
                                "Requests admitted by the engine, by how their cached prefix was reused",
                                labels=["path"])
    for path, n in sorted((r.prefix_paths or {}).items()):
        paths.add_metric([path], n)
    bs = r.block_size or 1
    blocks = [_gauge("deepinfer_kv_blocks_used", "KV cache blocks in use (referenced by requests)",
                     r.kv_tokens_used // bs),
              _gauge("deepinfer_kv_blocks_free", "KV cache blocks free (unreferenced prefix-cache blocks included)",
                     (r.kv_tokens_capacity - r.kv_tokens_used) // bs)]
    return [*fams, *blocks, paths]


def store_families(s: dict) -> list:
    """A worker's storage-tier traffic (``StoreStats.snapshot()``)."""
    reads = CounterMetricFamily("deepinfer_kvstore_reads_total", "Storage-tier block reads by result (hit, miss)",
                                labels=["result"])
    reads.add_metric(["hit"], s["hits"])
    reads.add_metric(["miss"], s["misses"])
    writes = CounterMetricFamily("deepinfer_kvstore_writes_total", "Storage-tier block writes by result (ok: "
                                 "written, error: failed, skipped: already there, dropped: write-behind queue full)",
                                 labels=["result"])
    for label, key in (("ok", "writes"), ("error", "write_errors"), ("skipped", "writes_skipped"),
                       ("dropped", "writes_dropped")):
        writes.add_metric([label], s[key])
    return [
        reads, writes,
        _counter("deepinfer_kvstore_corrupt_reads_total", "Block reads whose file failed verification (misses)",
                 s["corrupt"]),
        _counter("deepinfer_kvstore_read_bytes_total", "Payload bytes of verified storage-tier block reads",
                 s["bytes_read"]),
        _counter("deepinfer_kvstore_write_bytes_total", "Payload bytes of completed storage-tier block writes",
                 s["bytes_written"]),
    ]


def spec_decode_families(spec) -> list:
    """A decode engine's ``SpecDecoder`` counters (speculative decoding on)."""
    return [
        _counter("deepinfer_spec_decode_draft_tokens_total", "Draft tokens verified", spec.num_draft_tokens),
        _counter("deepinfer_spec_decode_accepted_tokens_total", "Draft tokens accepted (acceptance rate = "
                 "accepted / draft)", spec.num_accepted_tokens),
        _counter("deepinfer_spec_decode_draft_sequences_total", "Request-steps verified with drafts (tokens "
                 "emitted = accepted + this)", getattr(spec, "num_spec_seqs", 0)),
    ]


def vision_families(s) -> list:
    """A vision worker's counters (``VisionService``): forward passes of the vision tower, images
    encoded, and lookups of images' embeddings in the storage tier (cache hits and misses)."""
    return [
        _gauge("deepinfer_vision_images_in_flight", "Images being encoded (the in-flight table)",
               len(s.inflight)),
        _counter("deepinfer_vision_requests_total", "Encode requests answered (bad images excluded)", s.requests),
        _counter("deepinfer_vision_forwards_total", "Forward passes of the vision tower and projector", s.forwards),
        _counter("deepinfer_vision_images_encoded_total", "Images encoded by a forward pass", s.images_encoded),
        _counter("deepinfer_vision_cache_hits_total", "Images whose embeddings were found in the storage tier "
                 "(hit rate = hits / (hits + misses))", s.cache_hits),
        _counter("deepinfer_vision_cache_misses_total", "Images whose embeddings were not in the storage tier "
                 "(encoded, or waited for another request's forward)", s.cache_misses),
        _counter("deepinfer_vision_damaged_embeddings_total", "Stored embeddings found damaged (encoded again)",
                 s.damaged),
    ]


def kvindex_families(h) -> list:
    """The kvindex's ``KVIndexHealth``: the storage tier's size and lookups by traffic class."""
    fams = [
        _gauge("deepinfer_kvindex_redis_up", "1 when the index answers from Redis, else 0 (every lookup misses)",
               int(h.redis_ok)),
        _gauge("deepinfer_kvstore_capacity_bytes", "The storage tier's eviction limit in bytes (0 = none)",
               h.capacity_bytes),
        _counter("deepinfer_kvindex_events_applied_total", "KV events applied", h.events_applied),
        _counter("deepinfer_kvindex_event_gaps_total", "Gaps in a worker's KV event ids", h.gaps),
        _counter("deepinfer_kvindex_replays_total", "Re-syncs of the index from the storage tier", h.replays),
        _counter("deepinfer_kvindex_lookup_timeouts_total", "Lookups answered as a miss because Redis was slow",
                 h.lookup_timeouts),
    ]
    if h.num_blocks >= 0:  # -1: unknown (Redis down or slow)
        fams.append(_gauge("deepinfer_kvstore_blocks", "Blocks the storage tier holds (indexed)", h.num_blocks))
    if h.total_bytes >= 0:
        fams.append(_gauge("deepinfer_kvstore_bytes", "Payload bytes the storage tier holds (indexed)",
                           h.total_bytes))
    names = {"lookups": ("deepinfer_kvindex_lookups_total", "Prefix lookups, by traffic class"),
             "queried_tokens": ("deepinfer_kvindex_queried_tokens_total", "Prompt tokens looked up, by traffic class"),
             "hit_tokens": ("deepinfer_kvindex_hit_tokens_total",
                            "Prompt tokens found in the storage tier (hit rate = hit / queried), by traffic class")}
    for key, (name, doc) in names.items():
        fam = CounterMetricFamily(name, doc, labels=["traffic_class"])
        for cls, stats in sorted(h.hit_stats.items()):
            fam.add_metric([cls], stats.get(key, 0))
        fams.append(fam)
    return fams


def balancer_families(status) -> list:
    """The balancer's ``BalancerStatus``: per MoE model (its weights' fingerprint)."""
    specs = [
        ("deepinfer_expert_imbalance_ratio", GaugeMetricFamily, "measured_imbalance",
         "Measured max/mean tokens per EP rank of the last window (mean over layers; 0 = no data)"),
        ("deepinfer_expert_predicted_imbalance_ratio", GaugeMetricFamily, "predicted_imbalance",
         "Predicted max/mean tokens per EP rank of the current placement on the moving average"),
        ("deepinfer_expert_placement_version", GaugeMetricFamily, "version", "Current placement version (0 = none)"),
        ("deepinfer_expert_rebalances_total", CounterMetricFamily, "rebalances", "Placements published"),
        ("deepinfer_expert_replica_bytes", GaugeMetricFamily, "replica_bytes",
         "Bytes of redundant expert replicas (largest reported by a worker)"),
    ]
    fams = []
    for name, kind, key, doc in specs:
        fam = kind(name, doc, labels=["model"])
        for m in status.models:
            fam.add_metric([str(m["model"])], float(m.get(key) or 0))
        fams.append(fam)
    workers = GaugeMetricFamily("deepinfer_expert_workers", "MoE workers reporting expert load", labels=["model"])
    for m in status.models:
        workers.add_metric([str(m["model"])], len(m.get("workers") or ()))
    return [*fams, workers]


# --- collectors and the server ------------------------------------------------------------------
class ServiceCollector:
    """Collects ``await service.metric_families()`` on the service's event loop at each scrape
    (the scrape runs on the HTTP server's thread); nothing if the loop does not answer in
    ``timeout_s`` or has stopped."""

    def __init__(self, service, loop: asyncio.AbstractEventLoop, timeout_s: float = 2.0):
        self.service = service
        self.loop = loop
        self.timeout_s = timeout_s

    def describe(self):
        return []  # no names to check at registration (collect() needs the running loop)

    def collect(self) -> Iterable:
        try:
            if asyncio.get_running_loop() is self.loop:  # called on the loop itself: it cannot answer now
                return []
        except RuntimeError:
            pass
        if self.loop.is_closed():
            return []
        try:
            fut = asyncio.run_coroutine_threadsafe(self.service.metric_families(), self.loop)
            return fut.result(self.timeout_s)
        except Exception as e:  # stopping, or a slow loop: the instruments are still served
            log.warning("metrics_collect_failed", error=f"{type(e).__name__}: {e}")
            return []


def start_metrics_server(port: int, *collectors, addr: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY,
                         probes: Callable[[str], tuple[bool, dict]] | None = None):
    """Register ``collectors`` and serve ``registry`` on ``http://addr:port/metrics`` (a daemon
    thread), and with ``probes`` the paths ``/health`` and ``/ready``: ``probes(path)`` ->
    (ok, JSON body), answered 200 or 503 (a Kubernetes liveness and readiness probe). Returns the
    server (``shutdown()`` stops it)."""
    for c in collectors:
        registry.register(c)
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if probes is None or path not in ("/health", "/ready"):
            return metrics_app(environ, start_response)
        ok, body = probes(path)
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
        return [json.dumps(body).encode()]

    server = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-server").start()
    log.info("metrics_server_started", port=port, addr=addr)
    return server


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # scrapes and probes every few seconds: not logged
        pass


def exposition(*registries: CollectorRegistry) -> bytes:
    """The text format of ``registries`` (default: the process's) one after another."""
    return b"".join(generate_latest(r) for r in (registries or (REGISTRY,)))
