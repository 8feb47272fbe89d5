"""Prometheus metrics: the metrics module, and /metrics of a whole mesh started by the launcher.

Unit tests: subject families, the NATS timing decorators, the families built from a
``LoadReport`` / ``StoreStats`` / ``SpecDecoder`` / ``KVIndexHealth`` / ``BalancerStatus``
(naming conventions: ``deepinfer_`` prefix, unit suffixes, ``_total`` counters), a worker's
metrics server collecting on its service's event loop, and the gateway's middleware and
per-choice hooks. Integration: a mock-engine mesh (``deepinfer up``'s launcher), every
process's /metrics scraped before and after two chat requests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.kvstore.stats import StoreStats
from deepinfer.launcher import free_port
from deepinfer.protocol import BalancerStatus, KVIndexHealth, LoadReport, TokenChunk
from deepinfer.telemetry import metrics as m

MOCK = ["--engine", "mock", "--heartbeat-s", "0.5", "--kv-cache-gb", "0.25"]


# --- helpers ------------------------------------------------------------------------------------
def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """Exposition text -> {(sample name, labels): value}."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def has(samples: dict, name: str) -> bool:
    return any(n == name for n, _ in samples)


class _Families:
    def __init__(self, fams):
        self.fams = fams

    def describe(self):
        return []

    def collect(self):
        return self.fams


def render(fams) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Families(fams))
    return m.exposition(reg).decode()


def check_names(text: str) -> None:
    """Prometheus conventions on every deepinfer_ family of an exposition."""
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("deepinfer_"):
            continue
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples), fam.name
        if fam.type == "histogram":
            assert fam.name.endswith("_seconds"), fam.name
        assert not fam.name.endswith("_ms") and "milliseconds" not in fam.name, fam.name


# --- unit tests -----------------------------------------------------------------------------------
def test_subject_families_drop_worker_and_request_ids():
    f = m.subject_family
    assert f("deepinfer.prefill.submit") == "deepinfer.prefill.submit"
    assert f("deepinfer.prefill.prefill-3.submit") == "deepinfer.prefill.submit"
    assert f("deepinfer.decode.decode-0.abort") == "deepinfer.decode.abort"
    assert f("deepinfer.stream.0123abcd") == "deepinfer.stream"
    assert f("deepinfer.load.decode.decode-1") == "deepinfer.load.decode"
    assert f("deepinfer.kv.events.prefill-0") == "deepinfer.kv.events"
    assert f("deepinfer.tokenizer.encode_chat") == "deepinfer.tokenizer.encode_chat"
    assert f("$JS.API.STREAM.INFO.X") == "$JS"
    assert f("prefill.submit") == "prefill.submit"  # a handler's span name stays as it is


def test_request_and_handler_timing_by_subject_family_and_outcome():
    class Timeout(Exception):
        pass

    Timeout.__name__ = "RequestTimeout"

    class Client:
        @m.timed_request
        async def request(self, subject, msg, timeout=1.0):
            await asyncio.sleep(0.01)
            if msg == "late":
                raise Timeout("no reply")
            return msg

    def count(outcome):
        return m.REGISTRY.get_sample_value("deepinfer_nats_request_seconds_count",
                                           {"subject": "deepinfer.decode.submit", "outcome": outcome}) or 0

    async def handler(msg):
        await asyncio.sleep(0.01)
        return msg

    async def run():
        c = Client()
        assert await c.request("deepinfer.decode.decode-7.submit", "hi") == "hi"
        with pytest.raises(Timeout):
            await c.request("deepinfer.decode.submit", "late")
        assert await m.timed_handler(handler, "test.handler")("x") == "x"

    ok, late = count("ok"), count("timeout")
    handled = m.REGISTRY.get_sample_value("deepinfer_nats_handler_seconds_count", {"handler": "test.handler"}) or 0
    asyncio.run(run())
    assert (count("ok"), count("timeout")) == (ok + 1, late + 1)
    labels = {"handler": "test.handler"}
    assert m.REGISTRY.get_sample_value("deepinfer_nats_handler_seconds_count", labels) == handled + 1
    assert m.REGISTRY.get_sample_value("deepinfer_nats_handler_seconds_sum", labels) >= 0.01


def test_worker_families_from_load_report_store_stats_and_spec_decoder():
    r = LoadReport(role="prefill", worker_id="prefill-0", active_requests=3, waiting_requests=5,
                   kv_tokens_used=32, kv_tokens_capacity=160, block_size=16, steps=7, busy_s=1.5,
                   prefix_hit_tokens=48, prefix_queried_tokens=100, kv_block_bytes=4096, finished_requests=2,
                   computed_tokens=52, prefix_paths={"hit": 1, "cold": 1}, queued_prefill_tokens=10)
    stats = StoreStats()
    stats.add(reads=3, hits=2, misses=1, bytes_read=8192, writes=4, bytes_written=16384, write_errors=1)
    spec = SimpleNamespace(num_draft_tokens=40, num_accepted_tokens=30, num_spec_seqs=10)
    text = render([*m.service_families("prefill", "prefill-0", False), *m.load_report_families(r),
                   *m.store_families(stats.snapshot()), *m.spec_decode_families(spec)])
    check_names(text)
    s = parse(text)
    assert value(s, "deepinfer_service_info", role="prefill", worker_id="prefill-0") == 1
    assert value(s, "deepinfer_requests_running") == 3
    assert value(s, "deepinfer_requests_waiting") == 5
    assert value(s, "deepinfer_kv_blocks_used") == 2 and value(s, "deepinfer_kv_blocks_free") == 8
    assert value(s, "deepinfer_kv_cache_usage_ratio") == pytest.approx(0.2)
    assert value(s, "deepinfer_engine_prefix_hit_tokens_total") == 48
    assert value(s, "deepinfer_prefix_admissions_total", path="hit") == 1
    assert value(s, "deepinfer_kvstore_reads_total", result="hit") == 2
    assert value(s, "deepinfer_kvstore_writes_total", result="error") == 1
    assert value(s, "deepinfer_kvstore_read_bytes_total") == 8192
    assert value(s, "deepinfer_kvstore_write_bytes_total") == 16384
    assert value(s, "deepinfer_spec_decode_draft_tokens_total") == 40
    assert value(s, "deepinfer_spec_decode_accepted_tokens_total") == 30


def test_kvindex_and_balancer_families():
    h = KVIndexHealth(worker_id="kvindex-0", redis_ok=True, num_blocks=12, total_bytes=12 * 4096, events_applied=5,
                      hit_stats={"chat": {"lookups": 4, "queried_tokens": 400, "hit_tokens": 96},
                                 "agent": {"lookups": 1, "queried_tokens": 50, "hit_tokens": 0}})
    status = BalancerStatus(worker_id="balancer-0", models=[{
        "model": "abc123", "version": 2, "workers": ["prefill-0", "decode-0"], "measured_imbalance": 1.8,
        "predicted_imbalance": 1.05, "rebalances": 2, "replica_bytes": 1 << 20}])
    text = render([*m.kvindex_families(h), *m.balancer_families(status)])
    check_names(text)
    s = parse(text)
    assert value(s, "deepinfer_kvindex_redis_up") == 1
    assert value(s, "deepinfer_kvstore_bytes") == 12 * 4096 and value(s, "deepinfer_kvstore_blocks") == 12
    assert value(s, "deepinfer_kvindex_hit_tokens_total", traffic_class="chat") == 96
    assert value(s, "deepinfer_kvindex_queried_tokens_total", traffic_class="agent") == 50
    assert value(s, "deepinfer_expert_imbalance_ratio", model="abc123") == pytest.approx(1.8)
    assert value(s, "deepinfer_expert_rebalances_total", model="abc123") == 2
    assert value(s, "deepinfer_expert_workers", model="abc123") == 2
    # Redis down: sizes unknown, not reported as 0
    down = parse(render(m.kvindex_families(KVIndexHealth(worker_id="k", redis_ok=False))))
    assert value(down, "deepinfer_kvindex_redis_up") == 0 and not has(down, "deepinfer_kvstore_bytes")


def test_metrics_server_collects_on_the_services_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    seen = []

    class FakeService:
        async def metric_families(self):
            seen.append(threading.current_thread())
            return m.service_families("tokenizer", "tokenizer-7", False)

    reg = CollectorRegistry(auto_describe=True)
    port = free_port()
    server = m.start_metrics_server(port, m.ServiceCollector(FakeService(), loop), addr="127.0.0.1", registry=reg)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert value(parse(text), "deepinfer_service_info", worker_id="tokenizer-7") == 1
        assert seen == [thread]  # collected on the loop's thread, not the server's
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        assert not has(parse(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text), "deepinfer_service_info")
    finally:
        server.shutdown()


def test_gateway_middleware_and_choice_hooks():
    from deepinfer.gateway import metrics as gm

    async def app(scope, receive, send):
        # a handler: one choice gets a first token, then 2 more in one chunk, then finishes
        choice = SimpleNamespace(timing=gm.ChoiceTiming(), stream=SimpleNamespace(traffic_class="agent"),
                                 proc=SimpleNamespace(finish_reason=None))
        await asyncio.sleep(0.02)
        gm.on_chunk(choice, TokenChunk(request_id="r", token_ids=[1], role="prefill", worker_id="p",
                                       num_prompt_tokens=40, num_cached_tokens=32))
        await asyncio.sleep(0.02)
        gm.on_chunk(choice, TokenChunk(request_id="r", token_ids=[2, 3], role="decode", worker_id="d",
                                       finish_reason="length"))
        choice.proc.finish_reason = "length"
        gm.on_finished([choice])
        gm.on_finished([choice])  # counted once
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def get(name, **labels):
        return m.REGISTRY.get_sample_value(name, labels) or 0

    ep = {"endpoint": "completions"}
    before = {k: get(k, **ep) for k in ("deepinfer_time_to_first_token_seconds_count",
                                        "deepinfer_inter_token_latency_seconds_count",
                                        "deepinfer_e2e_request_latency_seconds_count",
                                        "deepinfer_generation_tokens_total")}
    done = get("deepinfer_requests_finished_total", finish_reason="length", **ep)
    ok = get("deepinfer_http_requests_total", status="200", **ep)
    cached = get("deepinfer_prompt_cached_tokens_total", traffic_class="agent")

    async def receive():
        return {"type": "http.disconnect"}

    async def send(_message):
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(gm.MetricsMiddleware(app)(scope, receive, send))
    assert get("deepinfer_time_to_first_token_seconds_count", **ep) == before[
        "deepinfer_time_to_first_token_seconds_count"] + 1
    assert get("deepinfer_time_to_first_token_seconds_sum", **ep) >= 0.02
    assert get("deepinfer_inter_token_latency_seconds_count", **ep) == before[
        "deepinfer_inter_token_latency_seconds_count"] + 2
    assert get("deepinfer_e2e_request_latency_seconds_count", **ep) == before[
        "deepinfer_e2e_request_latency_seconds_count"] + 1
    assert get("deepinfer_generation_tokens_total", **ep) == before["deepinfer_generation_tokens_total"] + 3
    assert get("deepinfer_requests_finished_total", finish_reason="length", **ep) == done + 1
    assert get("deepinfer_http_requests_total", status="200", **ep) == ok + 1
    assert get("deepinfer_prompt_cached_tokens_total", traffic_class="agent") == cached + 32
    assert gm.endpoint_label("GET", "/v1/responses/resp_123") == "responses_stored"
    assert gm.endpoint_label("GET", "/nope/123") == "other"


# --- integration: a whole mesh ------------------------------------------------------------------
def scrape(urls: dict[str, str]) -> dict[str, dict]:
    out = {}
    with httpx.Client(timeout=10) as client:
        for name, url in urls.items():
            r = client.get(url)
            assert r.status_code == 200, (name, r.status_code)
            check_names(r.text)
            out[name] = parse(r.text)
    return out


def test_every_process_of_a_mesh_serves_metrics_that_move_with_traffic(make_mesh):
    t0 = time.monotonic()
    mesh = make_mesh(extra_args={"prefill": MOCK, "decode": MOCK})
    started = time.monotonic() - t0
    workers = {"tokenizer-0", "kvindex-0", "balancer-0", "prefill-0", "decode-0"}
    assert set(mesh.metrics_ports) == workers
    assert set(mesh.metrics_urls) == workers | {"gateway"}
    before = scrape(mesh.metrics_urls)

    model = httpx.get(mesh.gateway_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    prompt = "Summarise the following notes about queues and batching. " * 12  # several KV blocks
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "ignore_eos": True}
    with httpx.Client(base_url=mesh.gateway_url, timeout=60) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            assert "[DONE]" in "".join(s.iter_text())
    after = scrape(mesh.metrics_urls)

    def grew(proc: str, name: str, **labels) -> float:
        return value(after[proc], name, **labels) - value(before[proc], name, **labels)

    chat = {"endpoint": "chat_completions"}
    gw = "gateway"
    assert grew(gw, "deepinfer_time_to_first_token_seconds_count", **chat) == 2
    assert grew(gw, "deepinfer_inter_token_latency_seconds_count", **chat) == 2 * 7
    assert grew(gw, "deepinfer_e2e_request_latency_seconds_count", **chat) == 2
    assert grew(gw, "deepinfer_http_requests_total", status="200", **chat) == 2
    assert grew(gw, "deepinfer_requests_finished_total", finish_reason="length", **chat) == 2
    assert grew(gw, "deepinfer_generation_tokens_total", **chat) == 16
    assert grew(gw, "deepinfer_prompt_tokens_total", traffic_class="chat") == 2 * prompt_tokens
    assert grew(gw, "deepinfer_nats_request_seconds_count", subject="deepinfer.tokenizer.encode_chat",
                outcome="ok") == 2
    assert grew(gw, "deepinfer_nats_request_seconds_count", subject="deepinfer.prefill.submit") >= 2
    assert value(after[gw], "deepinfer_gateway_workers", role="prefill") == 1
    assert value(after[gw], "deepinfer_gateway_requests_running") == 0
    assert has(after[gw], "deepinfer_gateway_admission_queue_depth")

    for w in workers:
        assert value(after[w], "deepinfer_service_info", worker_id=w) == 1
        assert has(after[w], "process_cpu_seconds_total")

    assert grew("tokenizer-0", "deepinfer_nats_handler_seconds_count") >= 2

    p = "prefill-0"
    assert grew(p, "deepinfer_prefix_cache_queried_tokens_total", traffic_class="chat") == 2 * prompt_tokens
    assert grew(p, "deepinfer_prefix_cache_hit_tokens_total", traffic_class="chat") > 0  # the second one hit
    assert grew(p, "deepinfer_engine_requests_finished_total") == 2
    assert grew(p, "deepinfer_kvstore_write_bytes_total") > 0
    assert grew(p, "deepinfer_nats_handler_seconds_count", handler="prefill.submit") == 2
    assert grew(p, "deepinfer_nats_request_seconds_count", subject="deepinfer.decode.submit", outcome="ok") == 2

    d = "decode-0"
    assert grew(d, "deepinfer_kvstore_read_bytes_total") > 0
    assert grew(d, "deepinfer_engine_requests_finished_total") == 2
    for w in (p, d):
        assert value(after[w], "deepinfer_kv_blocks_free") > 0 and has(after[w], "deepinfer_kv_blocks_used")
        assert value(after[w], "deepinfer_requests_running") == 0 and has(after[w], "deepinfer_requests_waiting")

    k = "kvindex-0"
    assert value(after[k], "deepinfer_kvindex_redis_up") == 1
    assert grew(k, "deepinfer_kvindex_queried_tokens_total", traffic_class="chat") > 0
    assert has(after[k], "deepinfer_kvstore_bytes")
    print(f"\nmesh started in {started:.1f}s, test took {time.monotonic() - t0:.1f}s")


def test_health_and_ready_probes_beside_the_metrics():
    """A service's metrics port answers ``/health`` (its loop runs) and ``/ready`` (connected, set
    up, not draining) with 200 or 503: Kubernetes' liveness and readiness probes."""
    import tempfile
    from pathlib import Path

    from deepinfer.launcher import start_nats
    from deepinfer.mesh import Service

    nats = start_nats(Path(tempfile.mkdtemp(prefix="probes-")))
    port = free_port()

    async def run():
        loop = asyncio.get_running_loop()
        svc = Service(nats.url, worker_id="probe-1")
        server = m.start_metrics_server(port, addr="127.0.0.1", registry=CollectorRegistry(),
                                        probes=lambda path: svc.probe(path, loop))

        async def get(path):
            r = await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}{path}", timeout=5)
            return r.status_code, (r.json() if path != "/metrics" else r.text)

        try:
            assert (await get("/health"))[0] == 200
            code, body = await get("/ready")
            assert code == 503 and body["started"] is False  # not connected yet
            await svc.start()
            assert (await get("/ready"))[0] == 200
            svc.draining = True
            code, body = await get("/ready")
            assert code == 503 and body["draining"] and (await get("/health"))[0] == 200
            assert (await get("/metrics"))[0] == 200
        finally:
            await svc.stop()
            server.shutdown()

    try:
        asyncio.run(run())
    finally:
        nats.stop()
