"""The mock engine: the real scheduler and prefix cache, steps that sleep by the timing model,
deterministic tokens, KV handoff and the storage tier, and a mock mesh served through the gateway
with the official openai client."""

from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.mock import MockConfig, MockEngine
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.kvstore import BlockStore, block_hashes, model_fingerprint
from deepinfer.models.config import ModelConfig
from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model
from deepinfer.protocol import LoadReport, SamplingParams, subjects, unpack
from waiting import eventually

SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
FAST = MockConfig(cost=(0.001, 1e-6, 0.0, 0.0))  # ~1 ms steps: tests that do not time


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model(progress=False)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def run(engine, reqs, overlapped=False) -> dict[str, list[int]]:
    out = {rid: [] for rid, *_ in reqs}
    for rid, ids, sp in reqs:
        engine.add_request(rid, ids, sp)
    while engine.has_unfinished():
        for o in (engine.step_async() if overlapped else engine.step()):
            out[o.request_id] += o.new_token_ids
    return out


def schedule_trace(engine, waves, overlapped):
    """Per step: (request, tokens out, finish reason, cached tokens) of each output; then the counters."""
    steps = []
    for wave in waves:
        for rid, ids, sp in wave:
            engine.add_request(rid, ids, sp)
        while engine.has_unfinished():
            outs = engine.step_async() if overlapped else engine.step()
            steps.append(sorted((o.request_id, len(o.new_token_ids), o.finish_reason, o.num_cached_tokens)
                                for o in outs))
    bm = engine.block_manager
    return steps, (engine.num_steps, engine.num_computed_tokens_total, engine.scheduler.num_preemptions,
                   bm.num_hit_tokens, bm.num_queried_tokens, engine.peak_batch_size)


# --- the engine -----------------------------------------------------------------------------
@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_mock_schedules_chunks_preempts_and_hits_the_prefix_cache_like_the_real_engine(model_dir, overlapped):
    shared = prompt(0, 80)
    waves = [[("a", shared + prompt(1, 30), SP), ("b", prompt(2, 180), SP), ("c", shared + prompt(3, 50), SP)],
             [("d", shared + prompt(1, 30), SP), ("e", shared + prompt(4, 20), SP)]]
    # 20 blocks of 16 tokens (the real model's block bytes): three prompts do not fit at once
    block_bytes = ModelRunner.block_bytes(ModelConfig.from_dir(model_dir), 16, torch.float32)
    cfg = EngineConfig(kv_cache_bytes=20 * block_bytes, max_num_batched_tokens=64)
    real_steps, real_counts = schedule_trace(LLMEngine(model_dir, cfg), waves, overlapped)
    mock = MockEngine(model_dir, cfg, FAST)
    mock_steps, mock_counts = schedule_trace(mock, waves, overlapped)
    assert mock.kv_tokens_capacity == 20 * 16
    assert mock_counts == real_counts
    assert mock_steps == real_steps
    steps, computed, preemptions, hits, queried, peak = real_counts
    # the trace exercised chunking, batching, prefix hits and (without a step in flight) preemption
    assert computed < queried and hits >= 80 and peak >= 2 and (preemptions > 0 or overlapped)


def test_steps_are_chunked_by_the_time_budget(model_dir):
    """Untimed: with the cost model held at the timing model (no refits from measured, load-dependent
    step times), every step's predicted cost fits the 0.06 s budget, the prefill chunks fill it, and
    the 600-token prompt is cut into chunks (``test_step_time_follows_the_timing_model`` times the steps)."""
    timing = (0.02, 2e-4, 1e-7, 2e-5)
    e = MockEngine(model_dir, EngineConfig(step_time_budget_s=0.06, calibrate=True), MockConfig(cost=timing))
    e.cost_model.refit_every, e.cost_model.refit_error = 10**9, float("inf")  # chunks by the timing model alone
    run(e, [("a", prompt(1, 600), SP), ("b", prompt(2, 200), SP), ("c", prompt(3, 40), SP)])
    model = StepCostModel(*timing)
    predicted = [model.a * f[0] + model.b * f[1] + model.d * f[2] + model.e * f[3] for f, _ in e.cost_model.samples]
    assert len(predicted) > 8 and max(f[1] for f, _ in e.cost_model.samples) < 600  # chunked by time
    assert all(p <= 0.06 + 1e-9 for p in predicted), predicted  # within the budget
    assert max(predicted) > 0.9 * 0.06, predicted  # ... and cut by it (chunks fill the budget)
    assert e.cost_model.num_fits == 0


def test_a_request_added_again_while_its_aborted_copy_is_in_flight_keeps_its_own_state(model_dir):
    """A decode worker that takes a resume of a request it was running (same request id) while the
    aborted copy's step is still in flight: when that step comes back and the old copy's blocks are
    freed, the new copy's per-request state (its seeded sampler) stays."""
    e = MockEngine(model_dir, EngineConfig(), FAST)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    e.add_request("r", prompt(1, 20), seeded)
    assert e.step_async() == [] and e.has_unfinished()  # the prompt's step is in flight
    e.abort("r")
    e.add_request("r", prompt(1, 20), seeded)  # the resume lands before that step is back
    new = e.generators["r"]
    e.step_async()  # the old copy's step comes back: its blocks are freed, not the new copy's state
    assert e.generators.get("r") is new
    out = []
    while e.has_unfinished():
        out += [o for o in e.step_async() if o.request_id == "r"]
    assert sum(len(o.new_token_ids) for o in out) == 4 and out[-1].finish_reason == "length"
    assert "r" not in e.generators and e.block_manager.num_used_blocks == 0


@pytest.mark.timing
@pytest.mark.quiet  # the mock sleeps the modelled time: another test's load shows as its error
def test_step_time_follows_the_timing_model(model_dir):
    timing = (0.02, 2e-4, 1e-7, 2e-5)
    e = MockEngine(model_dir, EngineConfig(step_time_budget_s=0.06, calibrate=True), MockConfig(cost=timing))
    run(e, [("a", prompt(1, 600), SP), ("b", prompt(2, 200), SP), ("c", prompt(3, 40), SP)])
    model = StepCostModel(*timing)
    errors = []
    for f, measured in e.cost_model.samples:
        predicted = model.a * f[0] + model.b * f[1] + model.d * f[2] + model.e * f[3]
        errors.append((measured - predicted) / predicted)
    assert len(errors) >= 8 and max(f[1] for f, _ in e.cost_model.samples) < 600  # chunked by time
    assert min(errors) > -0.01  # never shorter than the model (sleep overshoots, never undershoots)
    assert statistics.median(errors) < 0.05 and max(errors) < 0.5
    fitted = (e.cost_model.a, e.cost_model.b)
    assert fitted[0] == pytest.approx(timing[0], rel=0.5) and fitted[1] == pytest.approx(timing[1], rel=0.5)


def test_outputs_are_deterministic_whatever_the_batch_chunking_or_scheduling(model_dir):
    reqs = [(str(i), prompt(i, 40 + 30 * i), SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True))
            for i in range(4)]
    alone = {rid: run(MockEngine(model_dir, EngineConfig(), FAST), [(rid, ids, sp)])[rid] for rid, ids, sp in reqs}
    chunked = MockEngine(model_dir, EngineConfig(max_num_batched_tokens=32), FAST)
    assert run(chunked, reqs, overlapped=True) == alone
    assert len({tuple(v) for v in alone.values()}) == 4  # different prompts, different outputs
    eos = set(chunked.model_config.eos_token_ids)
    assert all(len(v) == 12 and not eos & set(v) for v in alone.values())
    assert chunked.runner.num_kv_mismatches == 0


def test_eos_only_when_configured_and_never_before_min_tokens(model_dir):
    e = MockEngine(model_dir, EngineConfig(), MockConfig(cost=FAST.cost, eos_rate=0.5))
    out = run(e, [(str(i), prompt(i, 30), SamplingParams(max_tokens=64, min_tokens=5)) for i in range(8)])
    eos = e.model_config.eos_token_ids[0]
    assert all(v[-1] == eos and eos not in v[:-1] and 6 <= len(v) < 64 for v in out.values())


def test_kv_handoff_from_a_prefill_mock_to_a_decode_mock_equals_one_engine(model_dir):
    ids = prompt(5, 90)
    whole = run(MockEngine(model_dir, EngineConfig(), FAST), [("a", ids, SP)])["a"]
    pre = MockEngine(model_dir, EngineConfig(prefill_only=True), FAST)
    pre.add_request("a", ids, SP)
    (first,) = pre.step()
    assert first.finish_reason == "handoff" and first.num_kv_tokens == 90
    assert tuple(first.kv_blocks.shape) == (6, 1, 2, 16, 1, 1)  # 6 blocks, 128 bytes each
    dec = MockEngine(model_dir, EngineConfig(), FAST)
    dec.add_request("a", ids, SP, output_token_ids=first.new_token_ids, kv_blocks=first.kv_blocks,
                    num_kv_tokens=first.num_kv_tokens)
    rest = []
    while dec.has_unfinished():
        rest += [t for o in dec.step() for t in o.new_token_ids]
    assert first.new_token_ids + rest == whole
    assert dec.num_steps == SP.max_tokens - 1 and dec.runner.num_kv_mismatches == 0  # no prefill: KV imported
    # recomputing from tokens (the decode worker's path when a block is missing) gives the same
    again = MockEngine(model_dir, EngineConfig(), FAST)
    assert run(again, [("a", ids, SP)]) == {"a": whole}
    again.add_request("r", ids, SP, output_token_ids=first.new_token_ids)  # no KV: a prefill of 91 tokens
    recomputed = []
    while again.has_unfinished():
        recomputed += [t for o in again.step() for t in o.new_token_ids]
    assert recomputed == rest
    # and the outputs really come from the imported KV: a damaged block changes them
    bad = first.kv_blocks.clone()
    bad[-1, 0, 0] += 1
    dmg = MockEngine(model_dir, EngineConfig(), FAST)
    dmg.add_request("a", ids, SP, output_token_ids=first.new_token_ids, kv_blocks=bad, num_kv_tokens=90)
    damaged = []
    while dmg.has_unfinished():
        damaged += [t for o in dmg.step() for t in o.new_token_ids]
    assert damaged != rest


def test_mock_blocks_go_through_the_storage_tier_into_another_engines_prefix_cache(model_dir, tmp_path):
    shared = prompt(6, 160)
    other = shared[:-4] + [901, 902, 903, 904]
    a = MockEngine(model_dir, EngineConfig(prefill_only=True), FAST)
    a.add_request("a", shared, SP)
    (out,) = a.step()
    store = BlockStore(tmp_path, a.fingerprint)
    hashes = block_hashes(shared, 16, a.fingerprint)
    for h, block in zip(hashes, out.kv_blocks):
        store.put(h, block, num_tokens=16)
    assert all(store.path(h, "chat").stat().st_size < 1024 for h in hashes)  # small files
    cold = run(MockEngine(model_dir, EngineConfig(), FAST), [("b", other, SP)])["b"]
    b = MockEngine(model_dir, EngineConfig(), FAST)
    assert b.load_prefix(hashes[:9], torch.stack([store.get(h) for h in hashes[:9]])) == 9
    assert run(b, [("b", other, SP)])["b"] == cold
    assert b.block_manager.num_hit_tokens == 9 * 16
    assert a.fingerprint != model_fingerprint(model_dir, "float32", 16)  # never mixed with real blocks


def test_a_prefill_that_ends_at_its_first_token_still_exports_its_whole_blocks(model_dir):
    shared = prompt(7, 100)  # 6 whole blocks + 4 tokens
    handoff = MockEngine(model_dir, EngineConfig(prefill_only=True), FAST)
    handoff.add_request("h", shared, SP)
    (h,) = handoff.step()
    done = MockEngine(model_dir, EngineConfig(prefill_only=True), FAST)
    done.add_request("d", shared, SamplingParams(max_tokens=1))
    (d,) = done.step()
    assert (h.finish_reason, d.finish_reason) == ("handoff", "length")
    assert h.kv_blocks.shape[0] == 7 and d.kv_blocks.shape[0] == 6  # whole blocks only: for the storage tier
    assert torch.equal(d.kv_blocks, h.kv_blocks[:6]) and d.num_kv_tokens == 100
    short = MockEngine(model_dir, EngineConfig(prefill_only=True), FAST)
    short.add_request("s", prompt(8, 10), SamplingParams(max_tokens=1))
    assert short.step()[0].kv_blocks is None


async def test_a_failing_step_ends_every_live_request_with_an_error_even_those_it_had_finished(model_dir):
    """A step that raises after the scheduler took its finished requests out of the queues must
    still end them (they would hang their clients otherwise)."""
    from deepinfer.engine.async_engine import AsyncEngine

    engine = MockEngine(model_dir, EngineConfig(prefill_only=True), FAST)
    real_update = engine.scheduler.update

    def update_then_fail(*args):
        real_update(*args)
        raise RuntimeError("bookkeeping bug after the update")

    engine.scheduler.update = update_then_fail
    got: dict[str, str] = {}
    done = asyncio.Event()

    def on_outputs(outputs):
        for out in outputs:
            got[out.request_id] = out.finish_reason
        if len(got) == 3:
            done.set()

    ae = AsyncEngine(engine, on_outputs)
    ae.start()
    try:
        for i, n in enumerate((40, 70, 20)):
            await ae.add_request(request_id=f"r{i}", prompt_token_ids=prompt(i, n), sampling=SP)
        await asyncio.wait_for(done.wait(), 10)
    finally:
        ae.stop()
    assert got == {"r0": "error", "r1": "error", "r2": "error"}
    assert engine.block_manager.num_used_blocks == 0


# --- a mock mesh ---------------------------------------------------------------------------
MESH_COST = "0.004,2e-5,1e-9,1e-7"
MOCK_ARGS = ["--engine", "mock", "--mock-cost", MESH_COST, "--heartbeat-s", "0.5"]


@pytest.fixture(scope="module")
def mock_mesh(tmp_path_factory):
    from deepinfer.launcher import Mesh

    m = Mesh(workdir=tmp_path_factory.mktemp("mock-mesh"), replicas={"prefill": 2, "decode": 2},
             extra_args={"prefill": MOCK_ARGS, "decode": MOCK_ARGS})
    m.start(timeout=300)
    yield m
    m.stop()


def _chat(client, content, **kw):
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def serve_many(mesh, n: int = 16, max_tokens: int = 20) -> list:
    """``n`` concurrent chat requests of growing length through the gateway."""
    import openai

    client = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key="t", max_retries=0, timeout=60)
    prompts = [f"Request number {i}: " + "tell me a story. " * (i * 8) for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(lambda p: _chat(client, p, max_tokens=max_tokens), prompts))
    client.close()
    return outs


def test_a_request_the_prefill_engine_refuses_is_a_400_naming_why(mock_mesh):
    """A feature the worker's engine lacks (here the mock engine and a grammar) is the client's
    error, answered at once: not a 503 after every prefill worker was tried."""
    import openai

    client = openai.OpenAI(base_url=mock_mesh.gateway_url + "/v1", api_key="t", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="cannot enforce a grammar"):
        _chat(client, "Give me JSON.", response_format={"type": "json_object"})
    assert _chat(client, "Still serving?").choices[0].finish_reason == "length"


def test_a_mock_mesh_serves_the_openai_client_deterministically(mock_mesh):
    import openai

    client = openai.OpenAI(base_url=mock_mesh.gateway_url + "/v1", api_key="t", max_retries=0, timeout=60)
    first = _chat(client, "Tell me about queues.")
    assert first.usage.completion_tokens == 12 and first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content
    again = _chat(client, "Tell me about queues.")
    assert again.choices[0].message.content == first.choices[0].message.content
    stream = _chat(client, "Tell me about queues.", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == first.choices[0].message.content
    assert _chat(client, "Tell me about stacks.").choices[0].message.content != first.choices[0].message.content
    long = "Summarise: " + "queues hold requests until a worker is free. " * 30
    cold = _chat(client, long)
    # warm: this prefill's own cache at once, or the other's through the storage tier once the write-behind
    # store and its kvindex event have landed (a short window in which a warm request on the other worker
    # legitimately misses), so ask again for a while before calling it a miss
    deadline = time.monotonic() + 20
    while True:
        warm = _chat(client, long)
        assert warm.choices[0].message.content == cold.choices[0].message.content
        if warm.usage.prompt_tokens_details.cached_tokens >= warm.usage.prompt_tokens - 32 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert warm.usage.prompt_tokens_details.cached_tokens >= warm.usage.prompt_tokens - 32
    client.close()
    assert all(o.usage.completion_tokens == 20 for o in serve_many(mock_mesh))


def test_mock_workers_report_their_engine_cost_model_and_work(mock_mesh):
    from deepinfer.mesh import MeshClient

    serve_many(mock_mesh)  # spread over the workers by the queue groups

    async def collect() -> dict[str, LoadReport]:
        mc = await MeshClient.connect(mock_mesh.nats_url, "test-observer")
        reports: dict[str, LoadReport] = {}
        heard: dict[str, int] = {}

        async def on_load(msg):
            r = unpack(msg.data)
            if isinstance(r, LoadReport) and r.role in ("prefill", "decode"):
                reports[r.worker_id] = r
                heard[r.worker_id] = heard.get(r.worker_id, 0) + 1

        await mc.nc.subscribe(subjects.LOAD_ALL, cb=on_load)
        try:  # each of the 4 workers' reports, and one more each (the first heard may predate the work's end)
            await eventually(lambda: len(heard) >= 4 and min(heard.values()) >= 2, timeout=10)
        finally:
            await mc.close()
        return reports

    reports = asyncio.run(collect())
    assert sorted(reports) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    for r in reports.values():
        assert r.engine == "mock" and r.interval_s == 0.5 and r.block_size == 16
        # the engine's cost model, refitted online: non-negative, not all zero (which terms carry the
        # time varies: a prefill worker's chunks at context 0 make the per-token and per-key terms
        # collinear, and the non-negative fit has given a = b = 0 with d, e > 0)
        assert r.kv_tokens_capacity > 0 and min(r.cost_a, r.cost_b, r.cost_d, r.cost_e) >= 0
        assert max(r.cost_a, r.cost_b, r.cost_d, r.cost_e) > 0
        assert r.queued_prefill_tokens == 0 and r.active_requests == 0  # all served
    assert all(r.steps > 0 for r in reports.values()), {w: r.steps for w, r in reports.items()}
    assert sum(r.prefix_queried_tokens for w, r in reports.items() if w.startswith("prefill")) > 0


# --- trace replay ---------------------------------------------------------------------------
def conversation_trace(n_conv: int = 5, turns: int = 4) -> list[dict]:
    """Multi-turn conversations sharing a 4-block system prompt: turn k extends turn k-1."""
    rows, next_id = [], 100
    convs = [[0, 1, 2, 3] for _ in range(n_conv)]
    for k in range(turns):
        for c in range(n_conv):
            convs[c] = convs[c] + [next_id, next_id + 1]
            next_id += 2
            # odd conversations ask for 2 tokens (1 once scaled): they end at prefill, whose
            # blocks must reach the storage tier all the same
            rows.append({"timestamp": 2000 * k + 150 * c, "input_length": 512 * len(convs[c]) - 100,
                         "output_length": 40 if c % 2 == 0 else 2, "hash_ids": list(convs[c])})
    return rows


def test_trace_replay_through_a_mock_mesh_reaches_the_ideal_hit_rate_and_writes_its_report(mock_mesh, tmp_path):
    """``deepinfer bench replay`` against the mesh's gateway; every prefix a later turn reuses comes
    back from a prefill's cache or the storage tier."""
    import argparse
    import json

    from deepinfer.bench import replay
    from deepinfer.bench.trace import ideal_hit_rate

    trace = tmp_path / "conv.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in conversation_trace()) + "\n")
    p = argparse.ArgumentParser()
    replay.add_arguments(p)
    args = p.parse_args(["--trace", str(trace), "--url", mock_mesh.gateway_url, "--nats-url", mock_mesh.nats_url,
                         "--time-scale", "1", "--output-scale", "0.25", "--out", str(tmp_path / "out")])
    s = replay.run(args)
    assert s["requests"] == {"sent": 20, "completed": 20, "rejected_429": 0,
                             "rejected_429_without_retry_after": 0, "failed": 0}
    hit = s["hit_rate"]
    assert hit["ideal_engine"] > 0.5
    # turns 2 s apart leave no window for a miss: all but rounding (the target allows 5 points at scale)
    assert abs(hit["measured"] - hit["ideal_engine"]) <= 0.02, hit
    assert abs(hit["ideal_trace"] - ideal_hit_rate(conversation_trace())) < 1e-12
    d = s["ttft_s"]
    assert 0 < d["median"] <= d["p90"] <= d["p99"] and s["output_throughput"] > 0
    prefill = [w for w in s["workers"] if w["role"] == "prefill"]
    assert len(prefill) == 2 and sum(w["finished"] for w in prefill) == 20
    assert sum(w["finished"] for w in s["workers"] if w["role"] == "decode") == 12  # the others end at prefill
    saved = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert len(saved["requests"]) == 20 and saved["summary"]["hit_rate"] == hit
    png = (tmp_path / "out" / "ttft_over_time.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "hit rate (tokens)" in replay.format_table(s)


async def test_outputs_of_an_aborted_sequence_never_reach_a_new_request_under_the_same_id():
    """A resume on the same worker: the gateway aborts the request's copy and submits it again under
    the same id. A step that ran before the engine thread applied the abort posts the old copy's
    tokens; they must not be delivered as the new copy's (they would stream at its offsets)."""
    import threading

    from deepinfer.engine.async_engine import AsyncEngine
    from deepinfer.engine.interface import StepOutput

    class Stepper:  # one sequence per id; step() waits for ``go`` and emits the sequence's marker
        config = EngineConfig(async_scheduling=False)

        def __init__(self):
            self.seqs: dict[str, int] = {}
            self.go = threading.Event()
            self.stepping = threading.Event()

        def has_unfinished(self):
            return bool(self.seqs)

        def add_request(self, request_id, prompt_token_ids):
            self.seqs[request_id] = prompt_token_ids[0]

        def abort(self, request_id):
            self.seqs.pop(request_id, None)

        def step(self):
            snapshot = dict(self.seqs)
            self.stepping.set()
            self.go.wait(5)
            self.go.clear()
            return [StepOutput(rid, [marker], None, 1) for rid, marker in snapshot.items()]

    engine = Stepper()
    got: list[int] = []
    ae = AsyncEngine(engine, lambda outs: got.extend(t for o in outs for t in o.new_token_ids))
    ae.start()
    try:
        await ae.add_request(request_id="r", prompt_token_ids=[1])  # the first copy
        await asyncio.get_running_loop().run_in_executor(None, engine.stepping.wait, 5)
        ae.abort("r")  # while its step runs: that step's token is the old copy's
        resumed = asyncio.ensure_future(ae.add_request(request_id="r", prompt_token_ids=[2]))
        engine.go.set()
        await resumed
        for _ in range(3):
            engine.go.set()
            await asyncio.sleep(0.05)
    finally:
        ae.stop()
    assert got and set(got) == {2}, got
