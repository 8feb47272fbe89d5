"""Worker failure through real meshes started by the launcher.

- a decode worker killed (-9) mid-stream: its requests resume on the other decode
  worker from the prompt's blocks in the storage tier plus the tokens already
  streamed; every text equals the no-failure run (the real model: greedy, and
  seeded sampling, whose draws are replayed);
- a prefill worker killed with requests queued: they are re-dispatched to the
  other prefill worker (mock workers, so prefill is slow enough to queue);
- the only decode worker killed: a clear error event, no hang;
- a request queued on an aggregated worker behind a full batch for longer than the gateway's
  inactivity limit: the worker's keep-alives keep it from timing out, and it is answered;
- SIGTERM: a prefill and a decode worker drain (no new work, in-flight work
  finishes, exit 0) while the mesh keeps serving, with no failover.

Each test prints what it measured (``-s`` shows it): the time from the kill to
the first token of a resumed stream is the failover's cost to a client.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from deepinfer.launcher import Mesh
from deepinfer.mesh import MeshClient
from deepinfer.models.convert import DEFAULT_MODEL_NAME
from deepinfer.protocol import LoadReport, subjects, unpack
from waiting import eventually

MODEL = DEFAULT_MODEL_NAME
FAST_START = ["--no-calibrate", "--kv-cache-gb", "0.25"]  # real workers: start in seconds, not minutes
MOCK = ["--engine", "mock", "--heartbeat-s", "0.5", "--kv-cache-gb", "0.25"]


def mock_args(cost: str) -> list[str]:
    return [*MOCK, "--mock-cost", cost]


class Reports:
    """The latest ``LoadReport`` of every worker, as the gateway sees them."""

    def __init__(self):
        self.latest: dict[str, LoadReport] = {}
        self.mc: MeshClient | None = None

    async def start(self, mesh: Mesh) -> "Reports":
        self.mc = await MeshClient.connect(mesh.nats_url, "test-observer")

        async def on_load(msg):
            r = unpack(msg.data)
            if isinstance(r, LoadReport):
                self.latest[r.worker_id] = r

        await self.mc.nc.subscribe(subjects.LOAD_ALL, cb=on_load)
        return self

    async def close(self) -> None:
        await self.mc.close()

    async def busiest(self, role: str, timeout: float = 10, busy: bool = False) -> LoadReport:
        """The ``role`` worker with the most requests (waits for a first report: the observer
        may have subscribed after the last heartbeat; with ``busy``, for one that shows a
        request: the reports heard first may predate the work)."""
        best = None
        for _ in range(int(timeout * 20)):
            reports = [r for r in self.latest.values() if r.role == role]
            if reports:
                best = max(reports, key=lambda r: (r.active_requests + r.waiting_requests, r.worker_id))
                if not busy or best.active_requests + best.waiting_requests > 0:
                    return best
            await asyncio.sleep(0.05)
        if best is not None:
            return best
        raise AssertionError(f"no {role} heartbeat within {timeout}s")


def process(mesh: Mesh, worker_id: str):
    role = worker_id.rsplit("-", 1)[0]
    return next(p for p in mesh.processes[role] if p.name == worker_id)


def log_count(mesh: Mesh, name: str, event: str) -> int:
    return process(mesh, name).log_path.read_text().count(f'"{event}"')


def decoding(mesh: Mesh, worker_id: str) -> set[str]:
    """The request ids a decode worker's log shows started and not finished: what it is
    decoding now. Its log is written as it goes (unbuffered); its load reports lag by up
    to a heartbeat and a busy step, so a worker chosen by them may have finished or not
    yet started the requests they count."""
    started, finished = set(), set()
    for line in process(mesh, worker_id).log_path.read_text().splitlines():
        if '"decode_started"' in line or '"decode_finished"' in line:
            try:
                rec = json.loads(line)
            except ValueError:  # the line being written as we read
                continue
            (started if rec["event"] == "decode_started" else finished).add(rec["request_id"])
    return started - finished


def busiest_decoding(mesh: Mesh) -> tuple[str, set[str]]:
    """The decode worker decoding the most requests now (by its log), and their ids."""
    return max(((p.name, decoding(mesh, p.name)) for p in mesh.processes["decode"]),
               key=lambda item: (len(item[1]), item[0]))


class Streams:
    """Concurrent streaming chat requests through the official client; texts and arrival times."""

    def __init__(self, mesh: Mesh, requests: list[dict]):
        self.client = openai.AsyncOpenAI(base_url=mesh.gateway_url + "/v1", api_key="t", max_retries=0, timeout=180)
        self.requests = requests
        self.arrivals: list[list[float]] = [[] for _ in requests]
        self.texts: list[str] = ["" for _ in requests]
        self.ended: list[float] = [float("inf") for _ in requests]  # when each stream's last chunk came

    async def one(self, i: int) -> str:
        stream = await self.client.chat.completions.create(model=MODEL, stream=True, **self.requests[i])
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                self.texts[i] += chunk.choices[0].delta.content
                self.arrivals[i].append(time.monotonic())
        self.ended[i] = time.monotonic()
        return self.texts[i]

    async def run(self) -> list:
        try:
            return await asyncio.gather(*(self.one(i) for i in range(len(self.requests))), return_exceptions=True)
        finally:
            await self.client.close()

    def min_chunks(self) -> int:
        return min(len(a) for a in self.arrivals)

    def resume_gaps(self, killed_at: float) -> list[float]:
        """Per stream still open at the kill: seconds from the kill to its first chunk after it
        (a stream that ended before the kill, e.g. on the surviving worker, has none)."""
        return [next((t for t in a if t > killed_at), float("inf")) - killed_at
                for a, end in zip(self.arrivals, self.ended) if end > killed_at]


async def until(predicate, timeout: float, what: str, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(poll)


# --- decode: resume on another worker (real model) ---------------------------------------------
TOPICS = ["lighthouses", "bread", "volcanoes", "chess", "bees", "trains", "glaciers", "violins"]


def story_requests(salt: str, max_tokens: int) -> list[dict]:
    reqs = []
    for i, topic in enumerate(TOPICS):
        kw = dict(messages=[{"role": "user", "content": f"Write a long, detailed story about {topic}."}],
                  max_tokens=max_tokens, extra_body={"ignore_eos": True, "cache_salt": salt})
        if i % 4 == 3:  # seeded sampling: the resumed worker must replay the seed's draws
            kw.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        else:
            kw.update(temperature=0)
        reqs.append(kw)
    return reqs


def test_decode_worker_killed_mid_stream_resumes_on_the_other_one_with_the_same_text(make_mesh):
    m = make_mesh(replicas={"decode": 2}, extra_args={"prefill": FAST_START, "decode": FAST_START})
    max_tokens = 40

    async def scenario():
        reference = await Streams(m, story_requests("reference", max_tokens)).run()
        assert all(isinstance(t, str) and t for t in reference), reference
        streams = Streams(m, story_requests("failover", max_tokens))
        run = asyncio.ensure_future(streams.run())
        await until(lambda: streams.min_chunks() >= 6 or run.done(), 120, "every stream to be under way")
        assert not run.done(), "the streams finished before the kill: lengthen them"
        victim, on_victim = busiest_decoding(m)
        assert on_victim, "no decode worker is decoding"
        await asyncio.to_thread(process(m, victim).kill)
        killed_at = time.monotonic()
        tokens_at_kill = [len(a) for a in streams.arrivals]
        got = await run
        return reference, got, streams.resume_gaps(killed_at), tokens_at_kill, victim, on_victim

    reference, got, gaps, at_kill, victim, on_victim = asyncio.run(scenario())
    errors = [g for g in got if isinstance(g, BaseException)]
    assert not errors, errors
    assert got == reference  # greedy and seeded, resumed or not: the no-failure text
    resumed = log_count(m, "gateway-0", "failover_done")
    survivor = next(p.name for p in m.processes["decode"] if p.name != victim)
    loaded = log_count(m, survivor, "kv_prefix_loaded")  # resumes read the prompt's blocks from the tier
    print(f"\nkilled {victim} ({len(on_victim)} decoding); {resumed} streams resumed, "
          f"{loaded} from stored blocks; tokens per stream at the kill {at_kill}; "
          f"kill -> next token per stream (s): {[round(g, 2) for g in gaps]}")
    assert resumed >= 1 and loaded >= 1
    assert gaps and max(gaps) < 15, gaps


# --- prefill: re-dispatch (mock workers) -------------------------------------------------------
SLOW_PREFILL = "0.004,4e-3,0,0"  # ~4 ms per prompt token (~1.4 s a prompt): a few requests make a queue
FAST_DECODE = "0.004,2e-5,1e-9,1e-7"


def long_requests(salt: str, n: int = 8) -> list[dict]:
    return [dict(messages=[{"role": "user", "content": f"Document {i}: " + "the queue grows and shrinks. " * 50}],
                 max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "cache_salt": salt})
            for i in range(n)]


def test_prefill_worker_killed_with_queued_requests_they_are_redispatched(make_mesh):
    m = make_mesh(replicas={"prefill": 2},
                  extra_args={"prefill": mock_args(SLOW_PREFILL), "decode": mock_args(FAST_DECODE)})

    async def scenario():
        reference = await Streams(m, long_requests("reference")).run()
        assert all(isinstance(t, str) and t for t in reference), reference
        reports = await Reports().start(m)
        streams = Streams(m, long_requests("failover"))
        run = asyncio.ensure_future(streams.run())

        def queued() -> bool:  # a worker holding at least three requests, two prompts' worth still to compute
            prefill = [r for r in reports.latest.values() if r.role == "prefill"]
            return any(r.active_requests + r.waiting_requests >= 3 and r.queued_prefill_tokens >= 700
                       for r in prefill) or run.done()

        await until(queued, 60, "a prefill worker with queued requests")
        assert not run.done()
        victim = await reports.busiest("prefill")
        await asyncio.to_thread(process(m, victim.worker_id).kill)
        killed_at = time.monotonic()
        got = await run
        await reports.close()
        return reference, got, victim, time.monotonic() - killed_at

    reference, got, victim, finish_s = asyncio.run(scenario())
    errors = [g for g in got if isinstance(g, BaseException)]
    assert not errors, errors
    assert got == reference
    redispatched = log_count(m, "gateway-0", "failover_done")
    print(f"\nkilled {victim.worker_id} with {victim.active_requests} running + {victim.waiting_requests} waiting "
          f"({victim.queued_prefill_tokens} prompt tokens to compute); {redispatched} requests re-dispatched; "
          f"all done {finish_s:.1f}s after the kill")
    assert redispatched >= 2


# --- decode: nowhere to resume ------------------------------------------------------------------
def test_only_decode_worker_killed_ends_the_stream_with_a_clear_error_event(make_mesh):
    m = make_mesh(extra_args={"prefill": mock_args(FAST_DECODE), "decode": mock_args("0.02,2e-5,1e-9,1e-7")})
    client = openai.OpenAI(base_url=m.gateway_url + "/v1", api_key="t", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a very long story."}], max_tokens=2000,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    received, killed_at = 0, None
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
            if received == 5 and killed_at is None:
                m.processes["decode"][0].kill()
                killed_at = time.monotonic()
    elapsed = time.monotonic() - killed_at
    message = str(e.value)
    print(f"\nerror event {elapsed:.1f}s after the kill: {message}")
    assert "decode-0 stopped responding" in message and "resuming on another decode worker failed" in message
    assert elapsed < 10, elapsed
    assert httpx.get(m.gateway_url + "/health").status_code == 503  # no decode worker: new requests 503 at once


def test_a_request_queued_behind_a_full_batch_outwaits_the_inactivity_limit(make_mesh):
    """An aggregated worker runs one sequence at a time: the second request waits in its queue for
    the first one's ~8 s, past the gateway's 4 s limit without output; the worker announces it again
    while its engine steps (every 5 heartbeats of 0.5 s), so both are answered in full, neither timed
    out nor moved."""
    m = make_mesh(mode="agg", extra_args={"decode": [*mock_args("0.02,2e-5,1e-9,1e-7"), "--max-num-seqs", "1"],
                                          "gateway": ["--request-timeout", "4"]})
    client = openai.AsyncOpenAI(base_url=m.gateway_url + "/v1", api_key="t", max_retries=0, timeout=60)
    max_tokens = 400  # ~8 s at 20 ms a step
    kw = dict(model=MODEL, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True},
              stream=True, stream_options={"include_usage": True})

    decoding = asyncio.Event()  # the first request's first token came

    async def one(i: int) -> tuple[int, float]:
        sent, first, tokens = time.monotonic(), None, 0
        async for c in await client.chat.completions.create(
                messages=[{"role": "user", "content": f"Story {i}, please."}], **kw):
            if first is None and c.choices and c.choices[0].delta.content:
                first = time.monotonic()
                if i == 0:
                    decoding.set()
            if c.usage:
                tokens = c.usage.completion_tokens
        return tokens, first - sent

    async def both():
        try:
            first = asyncio.ensure_future(one(0))
            await eventually(lambda: decoding.is_set() or first.done(), timeout=30)  # the first is decoding
            second = await one(1)
            return await first, second
        finally:
            await client.close()

    (n0, _), (n1, wait) = asyncio.run(both())
    print(f"\nqueued behind a full batch: first token after {wait:.1f} s (limit without output: 4 s)")
    assert (n0, n1) == (max_tokens, max_tokens)
    assert wait > 4.5  # it did wait in the queue past the limit: the test shows what it claims
    assert log_count(m, "decode-0", "decode_started") == 2  # answered where it queued, not resumed elsewhere


# --- graceful drain -----------------------------------------------------------------------------
def test_sigterm_drains_prefill_and_decode_workers_without_failing_a_request(make_mesh):
    slow_decode = "0.03,2e-5,1e-9,1e-7"  # ~30 ms a step: requests stay in flight for seconds
    m = make_mesh(replicas={"prefill": 2, "decode": 2},
                  extra_args={"prefill": mock_args("0.004,5e-4,0,0"), "decode": mock_args(slow_decode)})

    def requests(salt: str, items: range) -> list[dict]:
        return [dict(messages=[{"role": "user", "content": f"Item {i}: " + "drain me slowly. " * 30}],
                     max_tokens=60, temperature=0, extra_body={"ignore_eos": True, "cache_salt": salt})
                for i in items]

    async def scenario():
        reference = await Streams(m, requests("reference", range(8))).run()
        reports = await Reports().start(m)
        first = Streams(m, requests("first", range(4)))
        run_first = asyncio.ensure_future(first.run())
        await until(lambda: first.min_chunks() >= 3 or run_first.done(), 60, "the first requests to stream")
        assert not run_first.done()
        busy = await reports.busiest("decode", busy=True)
        assert busy.active_requests > 0
        decode, prefill = busy.worker_id, (await reports.busiest("prefill")).worker_id
        for name in (decode, prefill):
            process(m, name).terminate()  # SIGTERM: drain
        sent_at = time.monotonic()
        await until(lambda: reports.latest[decode].draining and reports.latest[prefill].draining, 5,
                    "the draining workers to say so")
        second = Streams(m, requests("second", range(4, 8)))  # arrive while the two drain: go to the others
        got = await asyncio.gather(run_first, second.run())
        exits = [await asyncio.to_thread(process(m, name).popen.wait, 40) for name in (decode, prefill)]
        print(f"\nSIGTERM to {decode} ({busy.active_requests} active) and {prefill}: both exited "
              f"{time.monotonic() - sent_at:.1f}s later")
        await reports.close()
        return reference, got[0] + got[1], exits, decode, prefill

    reference, got, exits, decode, prefill = asyncio.run(scenario())
    assert got == reference  # salts differ, texts do not
    assert exits == [0, 0], exits
    assert log_count(m, "gateway-0", "worker_failed") == 0  # drained, not failed over
    assert log_count(m, decode, "service_draining") == 1 and log_count(m, prefill, "service_draining") == 1
