"""Reliability on a mesh of mock workers: cancellation, overload, tenant isolation. Each test prints
its figures (``-s`` shows them) and asserts on them.

One mesh for the module (``launcher.Mesh``, the code ``deepinfer up`` runs): tokenizer, kvindex,
2 prefill and 2 decode workers on the mock engine (the real scheduler, block manager, prefix cache
and storage tier; steps that sleep by a timing model), and the gateway. Prefill costs 0.3 ms a
token (a 2,000-token prompt: ~0.6 s), decode 20 ms a step, so a request that nobody aborted
runs on for 30 s and more at its 1,500 output tokens: far past the bounds below.

- cancellation: 1,000 streaming requests over the four APIs, dropped by the client at random
  points (a random time, or after a random number of SSE events); then every worker's KV blocks
  in use, running and waiting requests (their Prometheus metrics) are back to the idle baseline,
  the gateway has no stream open, and it still answers. (It found a decode worker running a
  handoff whose abort had come first: ``test_reliability_handoff``.)
- overload: a second gateway with a TTFT SLO and an in-flight limit, arrivals at 5x what the
  prefill workers can do: the excess gets 429 + Retry-After in each API's error shape, every
  admitted request completes within the stated bounds, the gateway's RSS stays bounded.
- the longest prompt (context - 1 tokens, max_tokens 1): answered through the official client,
  not refused or timed out (the real engine's time for it: benchmarks/bench_long_prompt.py).
- tenant isolation: prefix-cache probes under other ``cache_salt`` values get 0 cached tokens (the
  same salt gets a hit, also from the other prefill worker through the storage tier); TTFT of
  cold, same-salt and other-salt probes reported, other-salt asserted no faster than cold.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from collections import Counter
import time

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.launcher import Mesh
from deepinfer.models.convert import DEFAULT_MODEL_NAME

pytestmark = [pytest.mark.acceptance, pytest.mark.timeout(300)]

MODEL = DEFAULT_MODEL_NAME
PREFILL_COST = "0.004,3e-4,1e-9,1e-7"  # a, b, d, e (s/step, s/token, s/token pair, s/key)
DECODE_COST = "0.02,1e-4,1e-9,1e-7"
MOCK = ["--engine", "mock", "--heartbeat-s", "0.5"]
VOCAB_IDS = (300, 40000)  # plain-text token ids of SmolLM2's vocabulary
WORDS = ("queue", "worker", "block", "cache", "tenant", "stream", "token", "prefix", "decode", "river",
         "mountain", "lantern", "harbor", "copper", "violet", "signal", "garden", "thunder", "marble", "echo")
WORKER_GAUGES = ("deepinfer_kv_blocks_used", "deepinfer_requests_running", "deepinfer_requests_waiting")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = Mesh(workdir=tmp_path_factory.mktemp("reliability-mesh"),
             services=("tokenizer", "kvindex", "prefill", "decode", "gateway"),
             replicas={"prefill": 2, "decode": 2},
             extra_args={"prefill": [*MOCK, "--mock-cost", PREFILL_COST],
                         "decode": [*MOCK, "--mock-cost", DECODE_COST]})
    m.start(timeout=300)
    yield m
    m.stop()


# --- helpers ----------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """A /metrics page's unlabelled samples (and labelled ones summed by name)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def worker_state(mesh: Mesh) -> dict[str, tuple[float, ...]]:
    """Per prefill / decode worker: (KV blocks used, requests running, requests waiting)."""
    state = {}
    for worker, url in mesh.metrics_urls.items():
        if worker.startswith(("prefill", "decode")):
            m = scrape(url)
            state[worker] = tuple(m[g] for g in WORKER_GAUGES)
    return state


def text_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def token_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(*VOCAB_IDS) for _ in range(n)]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


# --- 3. cancellation --------------------------------------------------------------------------

CANCEL_N = 1000
CANCEL_CONCURRENCY = 64
CANCEL_MAX_TOKENS = 1500  # ~30 s of decode at 20 ms a step: a leak outlives the drain bound
DRAIN_BOUND_S = 15.0


def streaming_body(api: str, rng: random.Random, i: int) -> tuple[str, dict]:
    """(path, body) of a streaming request of ``api`` with a prompt of 10-300 words (or token ids)."""
    words = rng.randint(10, 300)
    text = f"request {i}: " + text_prompt(rng, words)
    if api == "chat":
        return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}],
                                        "max_tokens": CANCEL_MAX_TOKENS, "stream": True, "ignore_eos": True}
    if api == "completions":
        return "/v1/completions", {"model": MODEL, "prompt": token_prompt(rng, words), "stream": True,
                                   "max_tokens": CANCEL_MAX_TOKENS, "ignore_eos": True}
    if api == "messages":
        return "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": text}],
                                "max_tokens": CANCEL_MAX_TOKENS, "stream": True}
    return "/v1/responses", {"model": MODEL, "input": text, "max_output_tokens": CANCEL_MAX_TOKENS,
                             "stream": True}


async def cancelled_streams(url: str, n: int, concurrency: int, seed: int = 13) -> dict[str, int]:
    """``n`` streaming requests, ``concurrency`` at a time, each dropped by the client at a random
    point: after a random time (0-1.5 s: before, during or after prefill and the handoff) or after a
    random number of SSE events (1-30). Returns counts of how each ended."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        api = rng.choice(("chat", "completions", "messages", "responses"))
        path, body = streaming_body(api, rng, i)
        if rng.random() < 0.5:
            plans.append((path, body, ("time", rng.uniform(0.0, 1.5))))
        else:
            plans.append((path, body, ("events", rng.randint(1, 30))))
    counts = {"cut_by_time": 0, "cut_after_events": 0, "events_seen": 0, "http_errors": 0, "ran_to_end": 0}
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def read(path: str, body: dict, stop_after: int | None) -> None:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    counts["http_errors"] += 1
                    await r.aread()
                    return
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        counts["events_seen"] += 1
                        if stop_after is not None and seen >= stop_after:
                            counts["cut_after_events"] += 1
                            return  # leaving the block closes the connection mid-stream
                counts["ran_to_end"] += 1

        async def one(path: str, body: dict, how: tuple[str, float]) -> None:
            async with sem:
                if how[0] == "time":
                    try:
                        await asyncio.wait_for(read(path, body, None), how[1])
                    except asyncio.TimeoutError:
                        counts["cut_by_time"] += 1
                else:
                    await read(path, body, int(how[1]))

        await asyncio.gather(*(one(*p) for p in plans))
    return counts


async def sample_peak(mesh: Mesh, stop: asyncio.Event, peak: dict) -> None:
    while not stop.is_set():
        state = await asyncio.to_thread(worker_state, mesh)
        for w, (used, running, waiting) in state.items():
            p = peak.setdefault(w, [0, 0, 0])
            peak[w] = [max(p[0], used), max(p[1], running), max(p[2], waiting)]
        await asyncio.sleep(0.5)


def test_a_thousand_streams_cancelled_at_random_points_leave_no_kv_or_request_behind(mesh):
    url = mesh.gateway_url
    baseline = worker_state(mesh)
    assert all(running == waiting == 0 for _, running, waiting in baseline.values()), baseline

    async def run():
        stop, peak = asyncio.Event(), {}
        sampler = asyncio.create_task(sample_peak(mesh, stop, peak))
        t0 = time.monotonic()
        counts = await cancelled_streams(url, CANCEL_N, CANCEL_CONCURRENCY)
        took = time.monotonic() - t0
        stop.set()
        await sampler
        return counts, took, peak

    counts, took, peak = asyncio.run(run())
    t_end = time.monotonic()
    deadline = t_end + DRAIN_BOUND_S
    while True:
        state = worker_state(mesh)
        gateway = scrape(mesh.metrics_urls["gateway"])
        drained = (all(state[w][0] <= baseline[w][0] and state[w][1:] == (0, 0) for w in state)
                   and gateway["deepinfer_gateway_requests_running"] == 0)
        if drained or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    drain_s = time.monotonic() - t_end
    finished = {k: v for k, v in gateway.items() if k.startswith("deepinfer_requests_finished_total")}
    print(f"\ncancellation: {CANCEL_N} streams ({CANCEL_CONCURRENCY} at a time) in {took:.1f} s: "
          f"{counts['cut_by_time']} cut at a random time, {counts['cut_after_events']} after 1-30 events "
          f"({counts['events_seen']} events read), {counts['http_errors']} HTTP errors, "
          f"{counts['ran_to_end']} ran to the end; peak per worker (KV blocks, running, waiting) "
          f"{ {w: tuple(int(x) for x in p) for w, p in sorted(peak.items())} }; baseline "
          f"{ {w: tuple(int(x) for x in s) for w, s in sorted(baseline.items())} }; after "
          f"{drain_s:.2f} s {({w: tuple(int(x) for x in s) for w, s in sorted(state.items())})}, gateway "
          f"streams open {int(gateway['deepinfer_gateway_requests_running'])}")
    assert counts["cut_by_time"] + counts["cut_after_events"] + counts["http_errors"] + counts["ran_to_end"] \
        == CANCEL_N
    assert counts["http_errors"] == 0 and counts["ran_to_end"] == 0
    assert max(p[0] for p in peak.values()) > 0  # the load did hold KV blocks
    assert drained, f"not back to idle within {DRAIN_BOUND_S} s: {state}, gateway {gateway}"
    # the gateway still answers normally, streaming and not
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 8,
        "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "and streaming?"}], "max_tokens": 8,
            "stream": True, "ignore_eos": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"


STORM_N = 200
STORM_CLOSE_S = (0.5, 8.0)  # each client leaves at a random time in this range (the prefill backlog: ~10 s)
STORM_DRAIN_S = 5.0


def failed_at_gateway(mesh: Mesh) -> float:
    """Choices the gateway counted as finished with an error (any endpoint)."""
    text = httpx.get(mesh.metrics_urls["gateway"], timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "deepinfer_requests_finished_total" and s.labels.get("finish_reason") == "error")


def engine_counters(mesh: Mesh, role: str, name: str) -> dict[str, float]:
    return {w: scrape(url).get(name, 0.0) for w, url in mesh.metrics_urls.items() if w.startswith(role)}


def test_a_storm_of_disconnects_stops_every_request_where_it_is(mesh):
    """200 streams at once (more than the decode workers batch comfortably), each closed by its
    client 0.5-8 s in: queued at the gateway, in prefill, in the handoff or decoding. Within a few
    seconds of the last close every worker is idle with its KV blocks free, no request decoded to
    its end (each would take ~30 s: the decode engines' finished counters stay put), and none
    failed on its way (the gateway counted no error finish)."""
    url = mesh.gateway_url
    baseline = worker_state(mesh)
    finished_before = engine_counters(mesh, "decode", "deepinfer_engine_requests_finished_total")
    errors_before = failed_at_gateway(mesh)
    rng = random.Random(29)
    plans = [(*streaming_body("chat", rng, i), rng.uniform(*STORM_CLOSE_S)) for i in range(STORM_N)]
    counts = Counter()

    async def run():
        limits = httpx.Limits(max_connections=STORM_N * 2, max_keepalive_connections=STORM_N)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

            async def one(path: str, body: dict, close_after: float) -> None:
                async def read():
                    async with client.stream("POST", path, json=body) as r:
                        counts[f"http {r.status_code}"] += 1
                        async for line in r.aiter_lines():
                            counts["events"] += line.startswith("data: ")
                        counts["ran to the end"] += 1
                try:
                    await asyncio.wait_for(read(), close_after)
                except asyncio.TimeoutError:
                    counts["closed"] += 1

            await asyncio.gather(*(one(*p) for p in plans))

    asyncio.run(run())
    t_end = time.monotonic()
    while True:
        state = worker_state(mesh)
        gateway = scrape(mesh.metrics_urls["gateway"])
        drained = (all(state[w][0] <= baseline[w][0] and state[w][1:] == (0, 0) for w in state)
                   and gateway["deepinfer_gateway_requests_running"] == 0)
        if drained or time.monotonic() > t_end + STORM_DRAIN_S:
            break
        time.sleep(0.25)
    drain_s = time.monotonic() - t_end
    finished = engine_counters(mesh, "decode", "deepinfer_engine_requests_finished_total")
    ran_to_end = {w: int(finished[w] - finished_before.get(w, 0)) for w in finished}
    print(f"\ndisconnect storm: {STORM_N} streams at once, closed after {STORM_CLOSE_S} s: {dict(counts)}; "
          f"idle after {drain_s:.2f} s: {drained} {({w: tuple(int(x) for x in s) for w, s in sorted(state.items())})}; "
          f"decoded to the end per decode worker {ran_to_end}")
    assert counts["closed"] == STORM_N and counts["http 200"] == counts.total() - counts["closed"] - counts["events"], \
        counts  # (the status comes with the first token: a client gone before it saw none)
    assert counts["events"] > 0  # some had tokens before leaving
    assert drained, f"not idle {STORM_DRAIN_S} s after the last close: {state}"
    assert sum(ran_to_end.values()) == 0, ran_to_end
    assert failed_at_gateway(mesh) == errors_before


# --- 4. overload ------------------------------------------------------------------------------

OVERLOAD_SLO_S = 2.0
OVERLOAD_MAX_INFLIGHT = 48
OVERLOAD_PROMPT = 2000  # tokens: ~0.6 s of prefill each (the mock's timing model)
_a, _b, _d, _e = (float(x) for x in PREFILL_COST.split(","))
CAPACITY = 2 / (_a + _b * OVERLOAD_PROMPT + _d * OVERLOAD_PROMPT**2 / 2 + _e * OVERLOAD_PROMPT)  # requests/s
OVERLOAD_RATE = 5 * CAPACITY  # arrivals a second
OVERLOAD_SECONDS = 4.0
TTFT_BOUND_S = 2 * OVERLOAD_SLO_S  # what an admitted request's first token may take (SLO plus the bias)
E2E_BOUND_S = TTFT_BOUND_S + 2.0  # ... and its whole answer (8 tokens at ~20 ms a step, plus slack)


async def timed_stream(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """One streaming request: status, Retry-After, error body, first-token and end times (s)."""
    t0 = time.perf_counter()
    out = {"path": path, "status": 0, "ttft": None, "e2e": None, "retry_after": None, "error": None, "tokens": 0}
    async with client.stream("POST", path, json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())
            out["retry_after"] = r.headers.get("retry-after")
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            text = ((event.get("choices") or [{}])[0].get("text") if "choices" in event
                    else (event.get("delta") or {}).get("text") if event.get("type") == "content_block_delta" else None)
            if text is not None:
                out["tokens"] += 1
                if out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - t0
            if event.get("error") or event.get("type") == "error":
                out["error"] = event
    out["e2e"] = time.perf_counter() - t0
    return out


async def overload_wave(url: str, seed: int) -> list[dict]:
    """Poisson arrivals at ``OVERLOAD_RATE`` for ``OVERLOAD_SECONDS``: 3 in 4 streaming completions of
    ``OVERLOAD_PROMPT`` random token ids, 1 in 4 Anthropic messages of as many words."""
    rng = random.Random(seed)
    t, plans = 0.0, []
    while (t := t + rng.expovariate(OVERLOAD_RATE)) < OVERLOAD_SECONDS:
        salt = f"overload-{seed}-{len(plans)}"
        if rng.random() < 0.75:
            plans.append((t, "/v1/completions", {"model": MODEL, "prompt": token_prompt(rng, OVERLOAD_PROMPT),
                                                 "max_tokens": 8, "ignore_eos": True, "stream": True,
                                                 "cache_salt": salt}))
        else:
            plans.append((t, "/v1/messages", {"model": MODEL, "max_tokens": 8, "stream": True, "cache_salt": salt,
                                              "messages": [{"role": "user",
                                                            "content": text_prompt(rng, OVERLOAD_PROMPT)}]}))
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(at: float, path: str, body: dict) -> dict:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await timed_stream(client, path, body)

        return list(await asyncio.gather(*(one(*p) for p in plans)))


@pytest.fixture(scope="module")
def overload(mesh) -> dict:
    """Two overload waves through a second gateway (SLO, in-flight limit), run once for the module:
    the responses and their figures (``res``, ``ok``, ``limited``, ``ttft``, ``e2e``, ``rss``), printed."""
    proc, url = mesh.start_gateway(["--ttft-slo-s", str(OVERLOAD_SLO_S), "--max-inflight", str(OVERLOAD_MAX_INFLIGHT)])
    gateway = psutil.Process(proc.pid)
    try:
        rss = {"baseline": gateway.memory_info().rss}
        waves = []
        for wave in (1, 2):
            samples: list[int] = []
            done = asyncio.Event()

            async def sample():
                while not done.is_set():
                    samples.append(gateway.memory_info().rss)
                    await asyncio.sleep(0.05)

            async def run(seed=wave):
                sampler = asyncio.create_task(sample())
                try:
                    return await overload_wave(url, seed)
                finally:
                    done.set()
                    await sampler

            waves.append(asyncio.run(run()))
            rss[f"wave {wave} peak"] = max(samples)
            time.sleep(1.0)
            rss[f"after wave {wave}"] = gateway.memory_info().rss
    finally:
        proc.stop()
    res = [r for w in waves for r in w]
    ok = [r for r in res if r["status"] == 200]
    limited = [r for r in res if r["status"] == 429]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    e2e = [r["e2e"] for r in ok if r["e2e"] is not None]
    reasons = Counter(r["error"]["error"].get("code") or r["error"]["error"].get("type") for r in limited)
    mib = {k: round(v / 2**20, 1) for k, v in rss.items()}
    nan = float("nan")
    print(f"\noverload: {len(res)} requests in 2 waves of {OVERLOAD_SECONDS:g} s at {OVERLOAD_RATE:.1f}/s (5x the "
          f"{CAPACITY:.1f}/s 2 prefill workers serve), SLO {OVERLOAD_SLO_S} s, max in flight {OVERLOAD_MAX_INFLIGHT}: {len(ok)} admitted, "
          f"{len(limited)} got 429 ({dict(reasons)}), {len(res) - len(ok) - len(limited)} other; admitted TTFT p50 "
          f"{percentile(ttft, 50) if ttft else nan:.3f} p99 {percentile(ttft, 99) if ttft else nan:.3f} "
          f"max {max(ttft, default=nan):.3f} s, E2E max {max(e2e, default=nan):.3f} s "
          f"(bounds {TTFT_BOUND_S:g} / {E2E_BOUND_S:g} s); Retry-After {sorted({r['retry_after'] for r in limited})}; "
          f"gateway RSS MiB {mib}")
    return {"res": res, "ok": ok, "limited": limited, "ttft": ttft, "e2e": e2e, "rss": rss}


def test_overload_at_5x_capacity_gets_429_with_retry_after_and_admitted_requests_stream_their_tokens(overload):
    """Untimed: every request is admitted (and streams its tokens) or refused with 429 + Retry-After in
    its API's error shape; most are refused, enough admitted (the next test times the admitted ones)."""
    res, ok, limited = overload["res"], overload["ok"], overload["limited"]
    assert len(ok) + len(limited) == len(res), [r for r in res if r["status"] not in (200, 429)][:3]
    assert len(limited) >= len(res) // 2 and len(ok) >= 10
    for r in ok:  # every admitted request streamed all its tokens
        assert r["error"] is None and r["tokens"] >= 1, r
    for r in limited:  # Retry-After, and each API's own error shape
        assert r["retry_after"] is not None and int(r["retry_after"]) >= 1
        if r["path"] == "/v1/messages":
            assert r["error"]["type"] == "error" and r["error"]["error"]["type"] == "rate_limit_error", r
        else:
            assert set(r["error"]["error"]) == {"message", "type", "param", "code"}, r
            assert r["error"]["error"]["type"] == "rate_limit_exceeded", r
    assert {r["path"] for r in limited} == {"/v1/completions", "/v1/messages"}


@pytest.mark.timing
def test_overload_at_5x_capacity_admitted_requests_finish_in_bound_and_gateway_memory_stays_bounded(overload):
    """Timed: the admitted requests' TTFT and E2E against the SLO and its bounds; the gateway's RSS."""
    ttft, e2e, rss = overload["ttft"], overload["e2e"], overload["rss"]
    assert ttft and e2e
    # the SLO itself for the typical admitted request; every one within twice it (a shared CPU's noise)
    assert percentile(ttft, 50) <= OVERLOAD_SLO_S
    assert max(ttft) <= TTFT_BOUND_S and max(e2e) <= E2E_BOUND_S
    # memory: bounded by the load, not growing wave after wave
    assert rss["wave 2 peak"] - rss["baseline"] < 200 << 20
    assert rss["wave 2 peak"] <= rss["wave 1 peak"] + (32 << 20)


# --- 7. tenant isolation ----------------------------------------------------------------------

TENANT_ROUNDS = 7
TENANT_PROMPT = 2000  # tokens: ~0.6 s of prefill cold, ~0 when all but the last block is cached


async def probe(client: httpx.AsyncClient, prompt: list[int], salt: str | None) -> tuple[float, int]:
    """(TTFT seconds, cached prompt tokens) of a streaming completion of ``prompt`` under ``salt``."""
    from deepinfer.bench.client import stream_completion

    r = await stream_completion(client, "/v1/completions", MODEL, prompt, 2, time.perf_counter(),
                                {} if salt is None else {"cache_salt": salt})
    assert r.ok, r.error
    return r.ttft, r.cached_tokens


def test_a_prompt_of_the_whole_context_but_one_token_gets_its_one_token(mesh):
    context = 8192  # SmolLM2-135M-Instruct's max_position_embeddings
    client = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key="t", max_retries=0, timeout=120)
    ids = token_prompt(random.Random(8191), context - 1)
    started = time.monotonic()
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    print(f"\n{context - 1}-token prompt, 1 token: {time.monotonic() - started:.1f} s (mock workers)")
    assert r.usage.prompt_tokens == context - 1 and r.usage.completion_tokens == 1
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:  # one token more leaves no room for the answer
        client.completions.create(model=MODEL, prompt=ids + ids[:1], max_tokens=1)
    assert e.value.code == "context_length_exceeded"


@pytest.fixture(scope="module")
def tenant_probes(mesh) -> dict:
    """Per round the same fresh prompt is sent cold (salt A), repeated (salt A: a hit), then under salt B
    and with no salt (must miss), then under salt B again (its own hit); run once for the module:
    ``times`` (TTFTs), ``hits`` (cached tokens) and ``med`` (median TTFTs) per kind of probe, printed."""
    rng = random.Random(7)
    times = {"cold": [], "same salt": [], "other salt": [], "no salt": []}
    hits = {k: [] for k in times}

    async def run():
        async with httpx.AsyncClient(base_url=mesh.gateway_url, timeout=60) as client:
            for k in range(TENANT_ROUNDS):
                prompt = token_prompt(rng, TENANT_PROMPT)
                a, b = f"tenant-a-{k}", f"tenant-b-{k}"
                for name, salt in (("cold", a), ("same salt", a), ("other salt", b), ("no salt", None)):
                    if name == "same salt":  # the write-behind store and its kvindex event: let them land
                        deadline = time.monotonic() + 10
                        while True:
                            await asyncio.sleep(0.3)
                            ttft, cached = await probe(client, prompt, salt)
                            if cached > 0 or time.monotonic() > deadline:
                                break
                    else:
                        ttft, cached = await probe(client, prompt, salt)
                    times[name].append(ttft)
                    hits[name].append(cached)
                _, again = await probe(client, prompt, b)  # salt B's own repeat hits its own blocks
                hits.setdefault("other salt, repeated", []).append(again)

    asyncio.run(run())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\ntenant isolation: {TENANT_ROUNDS} rounds of a {TENANT_PROMPT}-token prompt; cached tokens "
          f"{ {k: v for k, v in hits.items()} }; median TTFT s "
          f"{ {k: round(v, 3) for k, v in med.items()} } (every TTFT: "
          f"{ {k: [round(x, 3) for x in v] for k, v in times.items()} })")
    return {"times": times, "hits": hits, "med": med}


def test_other_salts_never_hit_the_prefix_cache(tenant_probes):
    """Cached-token counts, exactly: 0 across salts (and with no salt), a hit under the same salt."""
    hits = tenant_probes["hits"]
    assert all(c == 0 for c in hits["cold"] + hits["other salt"] + hits["no salt"]), hits
    assert all(c > 0 for c in hits["same salt"]) and all(c > 0 for c in hits["other salt, repeated"]), hits


@pytest.mark.timing
def test_other_salts_are_not_faster_than_cold(tenant_probes):
    """Robust timing assertion: over ``TENANT_ROUNDS`` rounds the median other-salt TTFT must be nearer
    the median cold TTFT than the median warm one (a hit would save ~0.6 s of the mock's prefill; the
    noise of a loaded 2-core machine is well below half that)."""
    med = tenant_probes["med"]
    assert med["same salt"] < med["cold"]  # the probe sees a hit when there is one
    midpoint = (med["cold"] + med["same salt"]) / 2
    assert med["other salt"] > midpoint and med["no salt"] > midpoint, med
