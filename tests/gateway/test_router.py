"""Routing and admission: scoring on synthetic load reports, the submit fallbacks, 429 shapes, and
overload through two gateways on a mesh of mock workers."""

from __future__ import annotations

import asyncio
import json

import pytest

from deepinfer.gateway.pipeline.admission import Admission, AdmissionConfig, rate_limited
from deepinfer.gateway.pipeline.dispatch import submit_prompt
from deepinfer.gateway.pipeline.registry import WorkerRegistry
from deepinfer.gateway.pipeline.router import BIAS_MAX_AGE_S, PromptShape, Router, RouterConfig
from deepinfer.models.convert import DEFAULT_MODEL_NAME
from deepinfer.mesh import NoResponders, RemoteError, RequestTimeout
from deepinfer.protocol import (AbortRequest, Attempt, ErrorReply, LoadReport, PrefillRequest, SamplingParams,
                                SubmitReply, subjects)

COST = dict(cost_a=0.01, cost_b=1e-4, cost_d=1e-9, cost_e=1e-6)  # seconds: step, token, token pair, key


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def prefill(wid: str, **kw) -> LoadReport:
    kw = {**COST, **kw}
    return LoadReport(role="prefill", worker_id=wid, block_size=16, **kw)


def decode(wid: str, **kw) -> LoadReport:
    return LoadReport(role="decode", worker_id=wid, block_size=16, **kw)


def setup(*reports: LoadReport, policy: str = "predicted", clock=None):
    clock = clock or Clock()
    reg = WorkerRegistry(clock=clock)
    for r in reports:
        reg.observe(r)
    return reg, Router(reg, RouterConfig(prefill_policy=policy), clock=clock), clock


def first(router: Router, n: int = 100, rid: str = "r") -> str:
    return router.plan(rid, PromptShape(num_tokens=n)).candidates[0].worker_id


# --- one placement function ----------------------------------------------------------------
def test_place_is_the_first_submits_choice_less_the_workers_a_request_left():
    """``Router.place`` (a failover's or a retry's placement) ranks and chooses as a first submit does,
    leaving out the workers the request left; None when no live worker qualifies."""
    busy = prefill("p-busy", queued_prefill_s=2.0)
    idle = prefill("p-idle")
    full = decode("d-full", kv_tokens_used=900, kv_tokens_capacity=1000)
    roomy = decode("d-roomy", kv_tokens_used=100, kv_tokens_capacity=1000)
    _, router, _ = setup(busy, idle, full, roomy)
    shape = PromptShape(num_tokens=50, max_tokens=20)
    assert router.place(shape, "prefill") == first(router, 50) == "p-idle"
    assert router.place(shape, "prefill", exclude={"p-idle"}) == "p-busy"
    assert router.place(shape, "prefill", exclude={"p-idle", "p-busy"}) is None
    assert router.place(shape, "decode", request_id="r1") == "d-roomy"
    assert router.sent_counts().get("d-roomy") == 1  # booked, as a first submit's decode worker is
    assert router.place(shape, "decode", exclude={"d-roomy"}, request_id="r2") == "d-full"
    assert router.place(shape, "decode", exclude={"d-roomy", "d-full"}, request_id="r3") is None


# --- prefill scoring -------------------------------------------------------------------------
def test_predicted_finish_picks_the_worker_that_finishes_first_even_with_more_requests():
    busy = prefill("p-busy", active_requests=6, waiting_requests=4, queued_prefill_s=0.05)
    few = prefill("p-few", active_requests=1, waiting_requests=0, queued_prefill_s=3.0)  # one huge prompt
    _, router, _ = setup(busy, few)
    plan = router.plan("r", PromptShape(num_tokens=200))
    assert plan.candidates[0].worker_id == "p-busy"
    own = 1e-4 * 200 + 1e-9 * 200 * 100 + 1e-6 * 200
    assert plan.predicted_ttft_s == pytest.approx(0.05 + own + 0.01)
    assert [c.worker_id for c in plan.candidates] == ["p-busy", "p-few"]
    # the request-count baseline goes the other way
    _, ll, _ = setup(busy, few, policy="least_loaded")
    assert first(ll) == "p-few"


def test_predicted_finish_uses_each_workers_own_coefficients_and_the_stored_prefix():
    slow = prefill("p-slow", cost_b=1e-3, queued_prefill_s=0.0)
    fast = prefill("p-fast", cost_b=1e-4, queued_prefill_s=0.5)
    _, router, _ = setup(slow, fast)
    # 2000 new tokens: 2 s on the slow one, 0.2 + 0.5 s on the fast one
    assert first(router, 2000) == "p-fast"
    # 1984 of 2000 tokens stored: 16 new tokens, the idle slow worker wins; load time is priced
    stored = PromptShape(num_tokens=2000, cached_tokens=1984, stored_blocks=124)
    slow.kv_block_bytes = fast.kv_block_bytes = 1 << 20
    plan = router.plan("r2", stored)
    assert plan.candidates[0].worker_id == "p-slow"
    load = 124 * (1 << 20) / 2e9
    assert plan.predicted_ttft_s == pytest.approx(1e-3 * 16 + 1e-9 * 16 * (1984 + 8) + 1e-6 * 2000 + 0.01 + load)


def test_step_time_budget_adds_the_per_step_cost_of_every_step_the_queue_takes():
    r = prefill("p", queued_prefill_s=1.0, step_time_budget_s=0.25)
    _, router, _ = setup(r)
    plan = router.plan("r", PromptShape(num_tokens=1))
    assert plan.predicted_ttft_s == pytest.approx(1.0 + plan.candidates[0].compute_s + 5 * 0.01)  # ceil(1.0x / .25)


def burst(router: Router, n: int, tokens: int = 3000, accept: bool = False) -> list[str]:
    chosen = []
    for i in range(n):
        plan = router.plan(f"r{i}", PromptShape(num_tokens=tokens))
        router.commit(plan)
        if accept:
            router.accepted(plan, plan.candidates[0].worker_id)
        chosen.append(plan.candidates[0].worker_id)
    return chosen


def test_work_sent_since_the_last_report_spreads_a_burst_until_a_report_shows_it():
    reports = lambda: [prefill("p0")] + [prefill(f"p{i}", queued_prefill_s=0.01) for i in (1, 2, 3)]  # noqa: E731
    reg, router, clock = setup(*reports())
    chosen = burst(router, 8, accept=True)  # a burst between two heartbeats: the reports say "idle"
    assert sorted(chosen) == sorted([f"p{i}" for i in range(4)] * 2)
    assert router.sent_counts() == {f"p{i}": 2 for i in range(4)}
    # p0's next report (which holds its two) replaces its bookings
    clock.t += 1.0
    reg.observe(prefill("p0", queued_prefill_s=0.7))
    plan = router.plan("x", PromptShape(num_tokens=10))
    assert "p0" not in router.sent_counts()
    assert next(c for c in plan.candidates if c.worker_id == "p0").queue_s == pytest.approx(0.7)
    # without the compensation (bookings taken as already reported) the whole burst goes to p0
    _, blind, _ = setup(*reports())
    blind.config.report_margin_s = -1e9
    assert burst(blind, 8, accept=True) == ["p0"] * 8


def test_another_gateways_bookings_count_until_the_workers_report_shows_them():
    """Two gateways over the same workers: each tells the other its bookings (``on_booked`` ->
    ``peer_booked``), so a burst split over both spreads as it would through one gateway."""
    reg_a, a, clock = setup(prefill("p0"), prefill("p1"))
    reg_b, b, _ = setup(prefill("p0"), prefill("p1"), clock=clock)
    told = []
    a.on_booked = lambda *booking: told.append(booking)
    plan = a.plan("r1", PromptShape(num_tokens=3000))
    a.commit(plan)
    assert told == [(plan.candidates[0].worker_id, "r1", plan.candidates[0].compute_s, 3000)]
    assert first(b, 3000) == plan.candidates[0].worker_id  # b has not heard of it: the same worker
    b.peer_booked(*told[0])
    assert first(b, 3000) != plan.candidates[0].worker_id  # now it counts a's work there
    clock.t += 1.0  # the worker's next report shows the request: the booking is retired
    reg_b.observe(prefill(told[0][0], queued_prefill_s=told[0][2]))
    b.plan("x", PromptShape(num_tokens=10))
    assert told[0][0] not in b.sent_counts()


def test_a_refusal_moves_the_booking_to_the_worker_that_accepted():
    _, router, _ = setup(prefill("p0"), prefill("p1"))
    plan = router.plan("r", PromptShape(num_tokens=500))
    router.commit(plan)
    booked = plan.candidates[0].worker_id
    other = plan.candidates[1].worker_id
    router.failed(plan, booked)
    router.accepted(plan, other)
    assert router.sent_counts() == {other: 1}
    router.forget(plan)
    assert router.sent_counts() == {}


def test_draining_and_silent_workers_are_not_candidates():
    clock = Clock()
    reg, router, _ = setup(prefill("p0"), prefill("p1", draining=True), clock=clock)
    clock.t += 10
    reg.observe(prefill("p2"))
    assert [c.worker_id for c in router.plan("r", PromptShape(num_tokens=10)).candidates] == ["p2"]


def test_round_robin_cycles_over_the_workers_whatever_their_load():
    _, router, _ = setup(prefill("a", queued_prefill_s=9), prefill("b"), prefill("c"), policy="round_robin")
    assert [first(router, rid=str(i)) for i in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_counts_requests_including_those_sent_since_the_report():
    _, router, _ = setup(prefill("a", active_requests=1), prefill("b", active_requests=1, waiting_requests=2),
                         prefill("c", active_requests=3, queued_prefill_s=0), policy="least_loaded")
    picks = []
    for i in range(5):
        plan = router.plan(str(i), PromptShape(num_tokens=10))
        router.commit(plan)
        picks.append(plan.candidates[0].worker_id)
    assert picks[:2] == ["a", "a"]  # 1, then 2 (one sent since the report), then all three tie at 3
    assert sorted(picks[2:]) == ["a", "b", "c"]


def test_dynamo_cost_is_weighted_prefill_blocks_plus_decode_blocks():
    # a: 320 queued tokens (20 blocks), 0 held; b: nothing queued, 480 tokens held (30 blocks)
    a = prefill("a", queued_prefill_tokens=320, kv_tokens_used=0)
    b = prefill("b", queued_prefill_tokens=0, kv_tokens_used=480)
    _, router, _ = setup(a, b, policy="dynamo")
    plan = router.plan("r", PromptShape(num_tokens=160, cached_tokens=64, stored_blocks=4))
    scores = {c.worker_id: c.score for c in plan.candidates}
    assert scores == {"a": pytest.approx((320 + 96) / 16 + 10), "b": pytest.approx(96 / 16 + 30 + 10)}
    assert plan.candidates[0].worker_id == "a"
    router.config.dynamo_overlap_weight = 2.0  # prefill-heavier weighting flips it
    assert first(router, 160) == "b"


# --- decode --------------------------------------------------------------------------------
def test_decode_prefers_fewer_requests_and_less_kv_and_never_exceeds_capacity():
    full = decode("d-full", kv_tokens_used=9_500, kv_tokens_capacity=10_000, active_requests=1)
    busy = decode("d-busy", kv_tokens_used=2_000, kv_tokens_capacity=10_000, active_requests=20)
    idle = decode("d-idle", kv_tokens_used=1_000, kv_tokens_capacity=10_000, active_requests=2)
    _, router, _ = setup(full, busy, idle)
    shape = PromptShape(num_tokens=1_000, max_tokens=64)
    assert router.choose_decode(shape, "r0", until=2e9) == "d-idle"
    # a burst: bookings count against capacity until the workers' reports catch up
    picks = [router.choose_decode(shape, f"r{i}", until=2e9) for i in range(1, 40)]
    assert "d-full" not in picks  # 500 tokens free < 1064 needed
    held = {w: picks.count(w) + (w == "d-idle") for w in ("d-busy", "d-idle")}
    assert held["d-idle"] * 1064 + 1000 <= 10_000 and held["d-busy"] * 1064 + 2000 <= 10_000
    assert picks[-1] is None  # everyone is full: admission refuses (``Admission.check_decode``)


def test_decode_takes_no_more_than_a_batch_and_its_queue_bound():
    _, router, _ = setup(decode("d", kv_tokens_capacity=10**6, active_requests=60, waiting_requests=2))
    router.config.decode_max_seqs, router.config.decode_max_waiting = 64, 4
    shape = PromptShape(num_tokens=10, max_tokens=8)
    picks = [router.choose_decode(shape, f"r{i}", until=2e9) for i in range(8)]
    assert picks == ["d"] * 6 + [None] * 2  # 62 in its report + 6 booked = 64 + 4


def test_a_decode_worker_batch_is_the_max_num_seqs_it_reports():
    """A worker started with ``--max-num-seqs 4`` is full at 4 running + ``decode_max_waiting``
    queued, for the router and for admission, whatever the gateway's default batch (64)."""
    _, router, _ = setup(prefill("p"), decode("d", kv_tokens_capacity=10**6, active_requests=4, waiting_requests=3,
                                              max_num_seqs=4))
    router.config.decode_max_seqs, router.config.decode_max_waiting = 64, 4
    shape = PromptShape(num_tokens=10, max_tokens=8)
    assert [router.choose_decode(shape, f"r{i}", until=2e9) for i in range(2)] == ["d", None]  # 4 + 3 + 1 = 4 + 4
    admission = Admission(AdmissionConfig())
    for said, full in ((4, True), (0, False)):  # 0: an older worker that does not say (64 + 4)
        _, router, _ = setup(prefill("p"), decode("d", kv_tokens_capacity=10**6, active_requests=4,
                                                  waiting_requests=4, max_num_seqs=said))
        router.config.decode_max_waiting = 4
        if full:
            with pytest.raises(Exception, match="every decode worker is full"):
                admission.check_decode(router.plan("r", shape))
        else:
            admission.check_decode(router.plan("r", shape))


def test_a_worker_on_another_storage_tier_is_left_out_of_routing():
    """Two prefill and one decode worker report tier "A", one prefill and one decode worker "B" (a
    forgotten DEEPINFER_KV_ROOT): the mesh's tier is A and the B workers get no request; a worker
    that does not say (an older one) is taken."""
    _, router, _ = setup(prefill("p-a1", tier_id="A"), prefill("p-a2", tier_id="A"), prefill("p-b", tier_id="B"),
                         prefill("p-old"), decode("d-a", tier_id="A", kv_tokens_capacity=10**6),
                         decode("d-b", tier_id="B", kv_tokens_capacity=10**6))
    assert router.tier() == "A"
    plan = router.plan("r", PromptShape(num_tokens=100))
    assert {c.worker_id for c in plan.candidates} == {"p-a1", "p-a2", "p-old"}
    assert {router.choose_decode(PromptShape(num_tokens=10), f"r{i}", until=2e9) for i in range(4)} == {"d-a"}


def test_admission_refuses_up_front_when_no_decode_worker_has_room():
    _, router, _ = setup(prefill("p"), decode("d", kv_tokens_used=900, kv_tokens_capacity=1000))
    admission = Admission(AdmissionConfig())
    plan = router.plan("r", PromptShape(num_tokens=200, max_tokens=16))
    admission.check(plan)
    with pytest.raises(Exception) as e:
        admission.check_decode(plan)
    assert e.value.status == 429 and e.value.code == "decode_full" and e.value.headers == {"Retry-After": "1"}
    assert admission.rejected == {"decode_full": 1}
    for i in range(3):  # 50 + 16 fit: admitted, however many are booked (they are still in prefill)
        roomy = router.plan(f"r{i}", PromptShape(num_tokens=50, max_tokens=16))
        admission.check_decode(roomy)
        router.commit(roomy)
    _, queued, _ = setup(prefill("p"), decode("d", kv_tokens_capacity=10**6, active_requests=64, waiting_requests=64))
    with pytest.raises(Exception, match="every decode worker is full"):
        admission.check_decode(queued.plan("r", PromptShape(num_tokens=10)))
    _, no_reports, _ = setup(prefill("p"))  # no decode worker reports: left to the queue group
    admission.check_decode(no_reports.plan("r3", PromptShape(num_tokens=200)))


def test_decode_bookings_expire():
    clock = Clock()
    _, router, _ = setup(decode("d", kv_tokens_used=0, kv_tokens_capacity=2000), clock=clock)
    shape = PromptShape(num_tokens=1500, max_tokens=16)
    assert router.choose_decode(shape, "a", until=clock.t + 2) == "d"
    assert router.choose_decode(shape, "b", until=clock.t + 2) is None
    clock.t += 3
    assert router.choose_decode(shape, "c", until=clock.t + 2) == "d"


def test_commit_passes_the_decode_choice_in_the_plan():
    _, router, _ = setup(prefill("p"), decode("d0", kv_tokens_capacity=5000, active_requests=3),
                         decode("d1", kv_tokens_capacity=5000))
    plan = router.plan("r", PromptShape(num_tokens=100))
    router.commit(plan)
    assert plan.decode_worker == "d1"


# --- the load report the router relies on ------------------------------------------------------
def _prefill_mock():
    """A prefill-only mock engine (chunks of ~0.1 s, 0.4 s alone) with a 2,500-token prompt queued."""
    from deepinfer.engine.interface import EngineConfig
    from deepinfer.engine.mock import MockConfig, MockEngine
    from deepinfer.models.convert import ensure_default_model

    e = MockEngine(ensure_default_model(progress=False),
                   EngineConfig(prefill_only=True, step_time_budget_s=0.1, calibrate=True),
                   MockConfig(cost=(0.004, 2e-4, 1e-9, 1e-7)))
    e.add_request("a", [1000 + i % 5000 for i in range(2500)], SamplingParams(max_tokens=2))
    return e


def test_queued_prefill_counts_chunks_in_flight_so_a_busy_worker_never_reads_idle():
    """With async scheduling up to two chunks are launched (and counted computed) ahead; the
    report must still show their compute until it is done, else a worker mid-prompt looks idle.
    Untimed: the report is read before each step, by hand, until the request's first token comes
    back (``test_queued_prefill_follows_the_clock_while_chunks_run`` times it against the clock)."""
    e = _prefill_mock()
    total = e.queued_prefill()[1]
    assert 0.45 < total < 0.6
    readings, first_token = [], False
    while e.has_unfinished() and not first_token:
        readings.append(e.queued_prefill())  # the prompt is unfinished: its first token is not out
        first_token = any(o.request_id == "a" and o.new_token_ids for o in e.step_async())
    assert first_token
    # before the first step, while the first chunk runs, while the last one runs (launched ahead)
    assert len(readings) >= 3, readings
    assert all(tok > 0 and sec > 0 for tok, sec in readings), readings  # never idle mid-prompt
    # what is left never grows (up to re-reading the computed context in the next chunk: e·c, 0.2 ms)
    secs = [sec for _, sec in readings]
    assert all(later <= earlier + 1e-3 for earlier, later in zip(secs, secs[1:])), readings


@pytest.mark.timing
@pytest.mark.quiet  # the mock sleeps the modelled time: another test's load shows as its error
def test_queued_prefill_follows_the_clock_while_chunks_run():
    """Timed: read from another thread while the engine steps, the queued prefill seconds drain one
    second of compute per second, and never read idle mid-prompt."""
    import threading
    import time

    e = _prefill_mock()
    total = e.queued_prefill()[1]
    samples, done = [], threading.Event()

    def watch():
        t0 = time.monotonic()
        while not done.is_set():
            samples.append((time.monotonic() - t0, *e.queued_prefill()))
            time.sleep(0.02)

    th = threading.Thread(target=watch)
    th.start()
    t0 = time.monotonic()
    while e.has_unfinished():
        e.step_async()
    elapsed = time.monotonic() - t0
    done.set()
    th.join()
    assert 0.45 < total < 0.6 and elapsed > total
    running = [(t, tok, sec) for t, tok, sec in samples if t < elapsed - 0.15]
    assert running and all(tok > 0 and sec > 0 for _, tok, sec in running)  # never idle mid-prompt
    # what is left follows the clock (a queue drains one second of compute per second)
    assert all(abs(sec - (total - t)) < 0.15 for t, _, sec in running), running


# --- admission -------------------------------------------------------------------------------
def test_slo_rejects_with_retry_after_when_the_best_prediction_is_too_late():
    _, router, _ = setup(prefill("a", queued_prefill_s=4.2), prefill("b", queued_prefill_s=6.0))
    adm = Admission(AdmissionConfig(ttft_slo_s=1.0))
    plan = router.plan("r", PromptShape(num_tokens=100))
    with pytest.raises(Exception) as e:
        adm.check(plan)
    err = e.value
    assert err.status == 429 and err.code == "ttft_slo" and err.headers == {"Retry-After": "4"}  # ceil(4.23 - 1)
    ok = router.plan("r", PromptShape(num_tokens=100))
    Admission(AdmissionConfig(ttft_slo_s=5.0)).check(ok)
    assert ok.candidates[0].worker_id == "a"


def test_slo_skips_workers_that_would_push_an_earlier_request_past_its_deadline():
    clock = Clock()
    _, router, _ = setup(prefill("a"), prefill("b", queued_prefill_s=0.45), clock=clock)
    adm = Admission(AdmissionConfig(ttft_slo_s=1.0))
    r1 = router.plan("r1", PromptShape(num_tokens=4000))  # ~0.41 s on a
    adm.check(r1)
    router.commit(r1, ttft_slo_s=1.0)
    assert r1.candidates[0].worker_id == "a"
    clock.t += 0.5  # r1's deadline is 0.5 s away; a's queue (the booking) takes ~0.41 s plus the next one
    r2 = router.plan("r2", PromptShape(num_tokens=1000))
    assert r2.candidates[0].worker_id == "a"  # a finishes r2 first (0.53 s vs 0.56 s on b)...
    adm.check(r2)
    assert [c.worker_id for c in r2.candidates] == ["b"]  # ...but r1 could then miss its deadline
    router.commit(r2, ttft_slo_s=1.0)
    clock.t += 0.3  # deadlines: r1 in 0.2 s (a), r2 in 0.7 s (b)
    r3 = router.plan("r3", PromptShape(num_tokens=3000))  # 0.73 s on a, 0.87 s on b: within the SLO...
    assert max(c.finish_s for c in r3.candidates) < 1.0
    with pytest.raises(Exception) as e:  # ...but each would make an earlier request late
        adm.check(r3)
    assert e.value.status == 429 and e.value.code == "ttft_slo" and e.value.headers == {"Retry-After": "1"}
    router.first_token(r1)  # r1 has its first token: a may take more
    r4 = router.plan("r4", PromptShape(num_tokens=2000))
    adm.check(r4)
    assert [c.worker_id for c in r4.candidates] == ["a"]


def test_measured_lateness_of_first_tokens_is_added_to_predictions_before_the_slo():
    clock = Clock()
    reg, router, _ = setup(prefill("a"), clock=clock)
    adm = Admission(AdmissionConfig(ttft_slo_s=1.0))
    shape = PromptShape(num_tokens=7000)  # ~0.74 s predicted
    for i in range(8):
        plan = router.plan(f"r{i}", shape)
        adm.check(plan)
        router.commit(plan, ttft_slo_s=1.0)
        router.accepted(plan, "a")
        clock.t += plan.predicted_ttft_s + (0.4 if i % 2 else 0.3)  # first tokens come 0.3-0.4 s late
        reg.observe(prefill("a"))  # done: its report shows an empty queue again
        router.first_token(plan, arrived=True)
        assert router.ttft_bias_s() == (0.0 if i < 7 else pytest.approx(0.35))
    with pytest.raises(Exception) as e:
        adm.check(router.plan("late", shape))  # 0.73 + 0.35 > 1.0
    assert e.value.code == "ttft_slo"
    adm.check(router.plan("ok", PromptShape(num_tokens=5000)))  # 0.53 + 0.35
    failed = router.plan("failed", shape)
    router.commit(failed)
    router.first_token(failed)  # ended without a first token: no sample
    assert len(router._errors) == 8


def test_requests_still_waiting_past_their_predicted_first_token_count_as_late_at_once():
    """A burst: eight requests admitted together, none has its first token yet. Once they are
    overdue, their lateness so far (a lower bound of their errors) is counted before a single
    first token arrives."""
    clock = Clock()
    reg, router, _ = setup(prefill("a"), prefill("b"), clock=clock)
    adm = Admission(AdmissionConfig(ttft_slo_s=4.0))
    shape = PromptShape(num_tokens=7000)  # ~0.74 s predicted alone
    plans = []
    for i in range(8):
        plans.append(plan := router.plan(f"r{i}", shape))
        adm.check(plan)
        router.commit(plan, ttft_slo_s=4.0)
        router.accepted(plan, plan.candidates[0].worker_id)
    latest = max(p.started_at + p.predicted_ttft_s for p in plans)
    clock.t = latest - 0.01
    assert router.ttft_bias_s() == 0.0  # not all due yet: too few samples
    clock.t = latest + 4.0  # all eight overdue by 4 s or more, and past their deadlines
    reg.observe(prefill("a"))  # the workers' queues are empty again (as reported)
    reg.observe(prefill("b"))
    assert router.ttft_bias_s() >= 4.0
    with pytest.raises(Exception, match="exceeds the 4s SLO") as e:
        adm.check(router.plan("next", shape))  # 0.74 s predicted, 4 s late
    assert e.value.code == "ttft_slo"
    for plan in plans:  # they end without a first token: no lateness is left pending
        router.first_token(plan)
    assert router.ttft_bias_s() == 0.0 and not router._expected
    adm.check(router.plan("after", shape))


def test_a_lateness_that_refuses_everything_ages_out():
    """First tokens 26 s late (a burst the model did not see coming) make every prediction miss the
    SLO, so nothing is admitted and no new sample comes: after ``BIAS_MAX_AGE_S`` without one the
    bias is 0 again and requests are admitted (and measured) anew, instead of 429s for ever."""
    clock = Clock()
    reg, router, _ = setup(prefill("a"), clock=clock)
    adm = Admission(AdmissionConfig(ttft_slo_s=5.0))
    shape = PromptShape(num_tokens=1000)
    plans = []
    for i in range(8):  # sent together, their first tokens all 26 s late
        plans.append(plan := router.plan(f"r{i}", shape))
        router.commit(plan, ttft_slo_s=5.0)
        router.accepted(plan, "a")
    clock.t += plans[0].predicted_ttft_s + 26.0
    reg.observe(prefill("a"))
    for plan in plans:
        router.first_token(plan, arrived=True)
    assert router.ttft_bias_s() > 20.0
    with pytest.raises(Exception, match="exceeds the 5s SLO"):
        adm.check(router.plan("refused", shape))
    clock.t += BIAS_MAX_AGE_S - 1.0  # still recent
    assert router.ttft_bias_s() > 20.0
    clock.t += 2.0  # all older than the age limit
    assert router.ttft_bias_s() == 0.0
    adm.check(router.plan("admitted", shape))


def _hashed(n_tokens: int, blocks: list[str]) -> PromptShape:
    return PromptShape(num_tokens=n_tokens, block_hashes=tuple(blocks), block_size=16)


def test_a_prompt_whose_prefix_is_being_computed_goes_where_it_is_computed_and_is_predicted_cheaper():
    reg, router, clock = setup(prefill("a"), prefill("b"))
    prefix = [f"p{i}" for i in range(400)]  # 6,400 shared tokens
    r1 = router.plan("r1", _hashed(6500, prefix + ["x1", "x2", "x3", "x4", "x5", "x6"]))
    router.commit(r1)
    where = r1.candidates[0].worker_id
    other = "b" if where == "a" else "a"
    r2 = router.plan("r2", _hashed(6500, prefix + ["y1", "y2", "y3", "y4", "y5", "y6"]))
    by = {c.worker_id: c for c in r2.candidates}
    assert r2.candidates[0].worker_id == where  # computes 100 tokens there, 6,500 on the other
    assert by[where].compute_s < 0.05 * by[other].compute_s
    assert r2.shape.cached_tokens == 0  # the shape itself is not changed: the sharing is one worker's
    unrelated = router.plan("r3", _hashed(6500, [f"q{i}" for i in range(406)]))
    assert {c.worker_id: round(c.compute_s, 6) for c in unrelated.candidates} == {
        "a": round(by[other].compute_s, 6), "b": round(by[other].compute_s, 6)}
    router.accepted(r1, other)  # the fallback took it: the prefix is computed there now
    moved = {c.worker_id: c for c in router.plan("r4", r2.shape).candidates}
    assert moved[other].compute_s < 0.05 * moved[where].compute_s
    router.first_token(r1, arrived=True)  # its blocks are stored now: every worker loads them alike
    after = router.plan("r5", r2.shape)
    assert after.candidates[0].compute_s == pytest.approx(after.candidates[1].compute_s)
    router.commit(after)
    router.forget(after)  # refused or never taken: nothing of it stays
    assert len(router._computing) == 0


def test_inflight_prefixes_count_shared_leading_blocks_per_worker_until_removed():
    from deepinfer.gateway.pipeline.router import InflightPrefixes

    inflight = InflightPrefixes(limit=2)
    inflight.add("a", "r1", ("h0", "h1", "h2", "h3"))
    inflight.add("a", "r2", ("h0", "h1", "k2"))
    assert inflight.shared_blocks("a", ("h0", "h1", "h2", "z")) == 3
    assert inflight.shared_blocks("a", ("x0", "h1")) == 0  # chained: a different first block shares nothing
    assert inflight.shared_blocks("b", ("h0",)) == 0
    inflight.remove("r1")
    assert inflight.shared_blocks("a", ("h0", "h1", "h2")) == 2  # r2 still holds h0, h1
    inflight.add("b", "r2", ("h0", "h1", "k2"))  # moved: computed at b now, not at a
    assert inflight.shared_blocks("a", ("h0",)) == 0 and inflight.shared_blocks("b", ("h0", "h1")) == 2
    for i in range(3):  # over the limit the oldest is forgotten
        inflight.add("b", f"s{i}", (f"s{i}",))
    assert len(inflight) == 2 and inflight.shared_blocks("b", ("h0",)) == 0
    inflight.keep_only({"a"})
    assert len(inflight) == 0


def test_time_spent_before_routing_counts_against_the_slo_and_not_as_model_error():
    clock = Clock()
    reg, router, _ = setup(prefill("a"), clock=clock)
    adm = Admission(AdmissionConfig(ttft_slo_s=1.0))
    shape = PromptShape(num_tokens=5000)  # ~0.53 s predicted
    fresh = router.plan("fresh", shape)
    adm.check(fresh)  # just received: 0.53 s fits
    late = router.plan("late", shape)
    late.waited_s = 0.6  # tokenizing took 0.6 s of its TTFT already
    with pytest.raises(Exception) as e:
        adm.check(late)
    assert e.value.code == "ttft_slo"
    for i in range(8):  # first tokens exactly as predicted after routing, each 0.6 s after receipt
        plan = router.plan(f"r{i}", shape)
        plan.waited_s = 0.6
        router.commit(plan, ttft_slo_s=10.0)
        assert plan.started_at == pytest.approx(clock.t - 0.6)  # the deadline runs from receipt
        assert router._awaiting["a"][plan.request_id] == pytest.approx(clock.t - 0.6 + 10.0)
        router.accepted(plan, "a")
        clock.t += plan.predicted_ttft_s
        reg.observe(prefill("a"))
        router.first_token(plan, arrived=True)
    assert router.ttft_bias_s() == pytest.approx(0.0)  # the wait is the request's own, not the model's error


def test_queue_limit_counts_the_measured_lateness_of_first_tokens():
    clock = Clock()
    reg, router, _ = setup(prefill("a"), clock=clock)
    shape = PromptShape(num_tokens=7000)
    for i in range(8):  # first tokens arrive 0.35 s later than predicted (a host slower than its fit)
        plan = router.plan(f"r{i}", shape)
        router.commit(plan)
        router.accepted(plan, "a")
        clock.t += plan.predicted_ttft_s + 0.35
        reg.observe(prefill("a"))
        router.first_token(plan, arrived=True)
    assert router.ttft_bias_s() == pytest.approx(0.35)
    reg.observe(prefill("a", queued_prefill_s=1.0))
    plan = router.plan("q", shape)
    a = plan.candidates[0]
    fits = a.queue_s + a.compute_s + 0.2  # as predicted it fits; with the lateness it does not
    with pytest.raises(Exception) as e:
        Admission(AdmissionConfig(max_queued_prefill_s=fits)).check(plan)
    assert e.value.status == 429 and e.value.code == "prefill_queue_full"
    Admission(AdmissionConfig(max_queued_prefill_s=fits + 0.2)).check(router.plan("q2", shape))


def test_queue_limit_skips_full_workers_and_rejects_when_none_is_left():
    _, router, _ = setup(prefill("a", queued_prefill_s=2.5), prefill("b", queued_prefill_s=0.0, cost_b=1e-2),
                         policy="round_robin")
    adm = Admission(AdmissionConfig(max_queued_prefill_s=2.0))
    plan = router.plan("r", PromptShape(num_tokens=100))  # round robin says a first
    adm.check(plan)
    assert [c.worker_id for c in plan.candidates] == ["b"]
    huge = router.plan("r2", PromptShape(num_tokens=400))  # 4 s on b: b is idle, so it may still take it
    adm.check(huge)
    assert [c.worker_id for c in huge.candidates] == ["b"]
    _, busy, _ = setup(prefill("a", queued_prefill_s=2.5), prefill("b", queued_prefill_s=3.1))
    with pytest.raises(Exception) as e:
        adm.check(busy.plan("r3", PromptShape(num_tokens=100)))
    assert e.value.status == 429 and e.value.code == "prefill_queue_full" and e.value.headers["Retry-After"] == "1"


def test_inflight_limit_counts_unfinished_streams():
    from deepinfer.gateway.stream.request_stream import Phase

    class S:
        phase = Phase.DECODE

    adm = Admission(AdmissionConfig(max_inflight=2))
    a, b, c = S(), S(), S()
    adm.enter([a, b])
    with pytest.raises(Exception) as e:
        adm.enter([c])
    assert e.value.status == 429 and e.value.code == "max_inflight" and e.value.headers == {"Retry-After": "1"}
    a.phase = Phase.FINISHED
    adm.enter([c])
    assert adm.inflight() == 2 and adm.rejected == {"max_inflight": 1}


def test_429_in_each_apis_shape():
    from deepinfer.gateway.api.messages import error_response

    err = rate_limited("too slow", "ttft_slo", 0.2)
    r = err.response()
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    body = json.loads(r.body)
    assert body["error"]["type"] == "rate_limit_exceeded" and body["error"]["code"] == "ttft_slo"
    a = error_response(err)
    assert a.status_code == 429 and a.headers["retry-after"] == "1"
    assert json.loads(a.body) == {"type": "error", "error": {"type": "rate_limit_error", "message": "too slow"}}


async def test_every_api_answers_429_with_retry_after_in_its_own_shape(redis_url):
    import asyncio
    import time

    import httpx

    from deepinfer.mesh import MeshClient
    from gateway_harness import ConfiguredGateway
    from test_gateway import FakeWorkers, start_nats_server

    proc, url = start_nats_server()
    mesh = await MeshClient.connect(url, name="fake-workers")
    fakes = FakeWorkers(mesh)
    await fakes.start()
    try:
        async with ConfiguredGateway(url, redis_url=redis_url, admission=AdmissionConfig(max_inflight=0)) as gw:
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
                deadline = time.monotonic() + 5
                while (await c.get("/health")).status_code != 200:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                msgs = [{"role": "user", "content": "hi"}]
                for path, body in [("/v1/chat/completions", {"messages": msgs}),
                                   ("/v1/chat/completions", {"messages": msgs, "stream": True}),
                                   ("/v1/completions", {"prompt": "hi"}),
                                   ("/v1/responses", {"input": "hi", "stream": True}),
                                   ("/v1/messages", {"messages": msgs, "max_tokens": 8})]:
                    r = await c.post(path, json={"model": gw.model, **body})
                    assert r.status_code == 429 and r.headers["retry-after"] == "1", (path, r.text)
                    err = r.json()
                    if path == "/v1/messages":
                        assert err["type"] == "error" and err["error"]["type"] == "rate_limit_error"
                    else:
                        assert err["error"]["type"] == "rate_limit_exceeded" and err["error"]["code"] == "max_inflight"
        assert fakes.prefill_requests == []  # nothing was submitted
    finally:
        await fakes.stop()
        await mesh.close()
        proc.stop()


# --- dispatch ------------------------------------------------------------------------------
class FakeMesh:
    """Answers ``request`` from a script keyed by subject; records every call and publish."""

    def __init__(self, script: dict):
        self.script = script
        self.calls: list[str] = []
        self.requests: list = []  # the messages sent, in order
        self.published: list[tuple[str, object]] = []

    async def request(self, subject, msg, timeout, expect=None):
        self.calls.append(subject)
        self.requests.append(msg)
        out = self.script[subject]
        if isinstance(out, Exception):
            raise out
        return out

    async def publish(self, subject, msg):
        self.published.append((subject, msg))


def _req() -> PrefillRequest:
    return PrefillRequest("r", [1, 2, 3], SamplingParams(), "deepinfer.stream.r")


async def test_submit_falls_back_from_the_chosen_workers_to_the_queue_group():
    _, router, _ = setup(prefill("a"), prefill("b", queued_prefill_s=1), prefill("c", queued_prefill_s=2))
    plan = router.plan("r", PromptShape(num_tokens=3))
    router.commit(plan)
    mesh = FakeMesh({subjects.prefill_submit("a"): NoResponders("gone"),
                     subjects.prefill_submit("b"): SubmitReply(False, "b", "draining"),
                     subjects.PREFILL_SUBMIT: SubmitReply(True, "c")})
    reply = await submit_prompt(mesh, _req(), plan, timeout_s=5)
    assert reply.accepted and reply.worker_id == "c"
    assert mesh.calls == [subjects.prefill_submit("a"), subjects.prefill_submit("b"), subjects.PREFILL_SUBMIT]
    assert router.sent_counts() == {"c": 1}


async def test_a_chosen_worker_that_does_not_answer_is_aborted_before_the_next_is_tried():
    _, router, _ = setup(prefill("a"), prefill("b", queued_prefill_s=1))
    plan = router.plan("r", PromptShape(num_tokens=3))
    mesh = FakeMesh({subjects.prefill_submit("a"): RequestTimeout("slow"),
                     subjects.prefill_submit("b"): SubmitReply(True, "b")})
    req = _req()
    reply = await submit_prompt(mesh, req, plan, timeout_s=5)
    assert reply.worker_id == "b" and req.attempt == Attempt(1)  # the accepted copy's
    # that attempt only (the first: submit 0); the queue group's try is the next submit
    assert mesh.published == [(subjects.abort("prefill", "a"), AbortRequest("r", attempt=Attempt(0)))]


async def test_a_prefill_worker_answers_at_once_and_drops_only_the_aborted_attempt(tmp_path):
    """A timed-out targeted submit is aborted for its attempt only: the queue group's next attempt
    may land on the same worker and must be taken; an abort of any attempt drops the request."""
    from types import SimpleNamespace

    from deepinfer.engine.interface import EngineConfig
    from deepinfer.engine.mock import MockConfig
    from deepinfer.models.convert import ensure_default_model
    from deepinfer.prefill.service import PrefillService

    svc = PrefillService("nats://unused", str(ensure_default_model(progress=False)), EngineConfig(prefill_only=True), str(tmp_path),
                         mock=MockConfig())
    admitted, aborted = [], []

    async def admit(job):
        admitted.append((job.req.request_id, job.attempt.submit))

    svc.load_and_queue = admit
    svc.async_engine = SimpleNamespace(abort=aborted.append)

    def attempt(n: int, prompt=(1, 2, 3)) -> PrefillRequest:
        return PrefillRequest("r", list(prompt), SamplingParams(), "deepinfer.stream.r", attempt=Attempt(n))

    await svc.on_abort(AbortRequest("r", attempt=Attempt(1)))  # the late copy of attempt 1, not here yet
    assert (await svc.on_submit(attempt(1))).error == "aborted"
    assert (await svc.on_submit(attempt(2))).accepted
    await asyncio.sleep(0)
    assert admitted == [("r", 2)] and "r" in svc.requests
    await svc.on_abort(AbortRequest("r", attempt=Attempt(1)))  # a stale attempt's abort leaves attempt 2 alone
    assert "r" in svc.requests and aborted == []
    held = svc.requests["r"]
    # the gateway timed attempt 2 out and sent attempt 3, which lands here too: the work goes on as 3
    assert (await svc.on_submit(attempt(3))).accepted
    await asyncio.sleep(0)
    assert admitted == [("r", 2)] and svc.requests["r"].attempt == Attempt(3)
    assert svc.requests["r"] is held  # the object ``admit`` holds: it must still find it registered
    await svc.on_abort(AbortRequest("r", attempt=Attempt(2)))  # the abort of the attempt it gave up on
    assert "r" in svc.requests and aborted == []
    assert (await svc.on_submit(attempt(3))).error == "request already running here"  # a duplicate
    await svc.on_abort(AbortRequest("r"))  # any attempt: the client left
    assert "r" not in svc.requests and aborted == ["r"]
    too_long = await svc.on_submit(PrefillRequest("q", [1] * svc.engine.max_model_len, SamplingParams(), "s"))
    # checked before the answer; the request's own fault: the gateway answers the client 400 at once
    assert isinstance(too_long, ErrorReply) and too_long.kind == "bad_request" and "max model length" in too_long.error


async def test_a_bad_request_is_not_retried_and_no_plan_means_the_queue_group():
    _, router, _ = setup(prefill("a"), prefill("b"))
    plan = router.plan("r", PromptShape(num_tokens=3))
    mesh = FakeMesh({subjects.prefill_submit("a"): RemoteError("prompt too long", "bad_request")})
    with pytest.raises(RemoteError):
        await submit_prompt(mesh, _req(), plan, timeout_s=5)
    assert len(mesh.calls) == 1
    plain = FakeMesh({subjects.PREFILL_SUBMIT: SubmitReply(True, "x")})
    assert (await submit_prompt(plain, _req(), None, timeout_s=5)).worker_id == "x"
    assert plain.calls == [subjects.PREFILL_SUBMIT]


async def test_prefill_hands_off_to_the_chosen_decode_worker_else_the_queue_group():
    from types import SimpleNamespace

    from deepinfer.prefill.service import PrefillJob, PrefillService
    from deepinfer.protocol import DecodeRequest

    def service(mesh):
        return SimpleNamespace(mesh=mesh, was_aborted=lambda job: False)

    def job(req):
        return PrefillJob(req, req.attempt, None)

    handoff = DecodeRequest("r", [1, 2], [3], SamplingParams(), "deepinfer.stream.r", [], 2, 16, attempt=Attempt(4))
    chosen = PrefillRequest("r", [1, 2], SamplingParams(), "deepinfer.stream.r", decode_worker="d1")
    ok = FakeMesh({subjects.decode_submit("d1"): SubmitReply(True, "d1")})
    assert (await PrefillService.hand_off(service(ok), job(chosen), handoff)).worker_id == "d1"
    assert ok.calls == [subjects.decode_submit("d1")]
    for failure in (SubmitReply(False, "d1", "draining"), NoResponders("gone"), RequestTimeout("slow")):
        mesh = FakeMesh({subjects.decode_submit("d1"): failure, subjects.DECODE_SUBMIT: SubmitReply(True, "d2")})
        assert (await PrefillService.hand_off(service(mesh), job(chosen), handoff)).worker_id == "d2"
        assert mesh.calls == [subjects.decode_submit("d1"), subjects.DECODE_SUBMIT]
        timed_out = isinstance(failure, RequestTimeout)
        # the abort names the timed-out handoff (submit 4's handoff 0) only: the retry (its handoff 1)
        # may land on d1 again
        assert mesh.published == ([(subjects.abort("decode", "d1"), AbortRequest("r", Attempt(4, 0)))]
                                  if timed_out else [])
        assert [a.attempt for a in mesh.requests] == [Attempt(4, 0), Attempt(4, 1)]
    unchosen = FakeMesh({subjects.DECODE_SUBMIT: SubmitReply(True, "d2")})
    no_choice = PrefillRequest("r", [1, 2], SamplingParams(), "deepinfer.stream.r")
    assert (await PrefillService.hand_off(service(unchosen), job(no_choice), handoff)).worker_id == "d2"
    assert unchosen.calls == [subjects.DECODE_SUBMIT]


# --- a mesh of mock workers: 4 prefill, one decode --------------------------------------------------
# (TTFT by policy, the admitted requests' TTFT against the SLO and one gateway against two are
# measured side by side by benchmarks/bench_router.py; the tests here check what happens, not how fast)
MOCK_COST = "0.004,2e-4,1e-9,1e-7"  # a (s/step), b (s/token), d, e: ~5k prompt tokens/s per worker
MOCK_ARGS = ["--engine", "mock", "--mock-cost", MOCK_COST, "--heartbeat-s", "0.5"]
VOCAB_IDS = (1000, 30000)  # plain tokens of the SmolLM2 vocabulary


@pytest.fixture(scope="module")
def mock_mesh(tmp_path_factory):
    from deepinfer.launcher import Mesh

    # decode's KV holds the whole overload (64 prompts of up to 6k tokens), so admission refusals
    # come from the prefill side, not from a full decode worker
    m = Mesh(workdir=tmp_path_factory.mktemp("router-mesh"), replicas={"prefill": 4, "decode": 1},
             extra_args={"prefill": MOCK_ARGS, "decode": [*MOCK_ARGS, "--kv-cache-gb", "24"]})
    m.start(timeout=300)
    yield m
    m.stop()


@pytest.mark.acceptance
@pytest.mark.timeout(300)
def test_two_gateways_overloaded_answer_429_with_retry_after_and_finish_every_admitted_request(mock_mesh):
    """16 prompts/s of 4-6k tokens for 4 s (~1 s of prefill each: 4x what the 4 workers do),
    alternate requests through two gateways with a TTFT SLO sharing the workers: each request is
    admitted and completes, or gets a 429 in the OpenAI shape with a Retry-After; some of each. Each
    gateway tells the other every prefill booking it makes (``PrefillBooked``)."""
    import random

    from deepinfer.bench.replay import replay
    from deepinfer.bench.trace import TraceRequest
    from deepinfer.mesh import MeshClient
    from deepinfer.protocol import PrefillBooked, unpack

    rng = random.Random(11)
    load = sorted((TraceRequest(rng.uniform(0, 4.0), rng.randint(4000, 6000), 4, ()) for _ in range(64)),
                  key=lambda r: r.arrival_s)
    gateways = [mock_mesh.start_gateway(["--ttft-slo-s", "2.5"])[1] for _ in range(2)]
    booked: list[PrefillBooked] = []

    async def both():
        mc = await MeshClient.connect(mock_mesh.nats_url, "test-bookings")

        async def on_booked(msg):
            booked.append(unpack(msg.data, PrefillBooked))

        await mc.nc.subscribe(subjects.ROUTER_BOOKED, cb=on_booked)
        try:
            halves = [load[0::2], load[1::2]]
            return await asyncio.gather(*(
                replay(url, DEFAULT_MODEL_NAME, half, [[rng.randint(*VOCAB_IDS) for _ in range(r.input_length)]
                                                       for r in half], timeout_s=120,
                       body={"cache_salt": f"overload-{i}"})
                for i, (url, half) in enumerate(zip(gateways, halves))))
        finally:
            await mc.close()

    res = [r for results, _ in asyncio.run(both()) for r in results]
    ok = [r for r in res if r.status == 200]
    limited = [r for r in res if r.status == 429]
    print(f"\noverload through two gateways: {len(ok)} admitted, {len(limited)} got 429, "
          f"{len(booked)} bookings shared")
    assert len(ok) + len(limited) == len(res), [r for r in res if r.status not in (200, 429)][:3]
    assert ok and limited
    # every admitted request's prefill booking was announced, by both gateways
    assert len({b.request_id for b in booked}) >= len(ok) and len({b.gateway_id for b in booked}) == 2
    assert all(r.ok and r.output_tokens == 4 for r in ok), [r for r in ok if not r.ok][:3]
    for r in limited:
        assert r.retry_after_s >= 1
        body = json.loads(r.error)
        assert body["error"]["type"] == "rate_limit_exceeded" and body["error"]["code"] == "ttft_slo"
