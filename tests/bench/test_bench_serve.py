"""``deepinfer bench serve`` / ``bench compare``: metric definitions on synthetic timings with known
answers, arrival processes, datasets, the runner against an in-process fake server (conversation
growth, concurrency cap, failures), the command line's errors; then runs against the real mesh
(SmolLM2) and a mock mesh (trace replay) that write the table, JSON and plots."""

from __future__ import annotations

import asyncio
import json
import math
import statistics

import httpx
import pytest

from deepinfer.bench import datasets
from deepinfer.bench.arrivals import arrival_times
from deepinfer.bench.metrics import RequestResult, summarize, throughput_series
from deepinfer.bench.runner import Target, chat_messages, completion_prompt, run_sessions
from deepinfer.bench.table import format_summaries

PNG = b"\x89PNG\r\n\x1a\n"


# --- metrics ---------------------------------------------------------------------------------
def known_results() -> list[RequestResult]:
    """a: 4 tokens in 3 chunks (the last carries 2); b: 2 tokens; c: 1 token; a 429; a broken stream."""
    a = RequestResult(sent=1.0, token_times=[1.5, 1.7, 2.0], end=2.1, prompt_tokens=100, cached_tokens=60,
                      output_tokens=4, status=200)
    b = RequestResult(sent=2.0, token_times=[2.2, 2.4], end=2.4, prompt_tokens=50, output_tokens=2, status=200)
    c = RequestResult(sent=3.0, token_times=[4.0], end=4.0, prompt_tokens=10, output_tokens=1, status=200)
    rejected = RequestResult(sent=3.0, end=3.1, status=429, error="busy", retry_after_s=1.0)
    broken = RequestResult(sent=3.5, end=3.6, status=200, error="stream ended without output")
    return [a, b, c, rejected, broken]


def test_latencies_follow_vllm_definitions_on_known_timings():
    a, b, c, *_ = known_results()
    # TTFT = first chunk - send; E2E = end - send; TPOT = (E2E - TTFT) / (output tokens - 1); ITL = chunk gaps
    assert (a.ttft, a.e2e, a.tpot, *a.itls) == pytest.approx((0.5, 1.1, 0.6 / 3, 0.2, 0.3))
    assert (b.ttft, b.e2e, b.tpot, *b.itls) == pytest.approx((0.2, 0.4, 0.2, 0.2))
    assert c.tpot is None and c.itls == []  # one output token: no TPOT, no gap
    s = summarize(known_results(), duration_s=4.0)
    assert s["requests"] == {"sent": 5, "completed": 3, "rejected_429": 1,
                             "rejected_429_without_retry_after": 0, "failed": 1}
    assert s["ttft_s"] == pytest.approx({"mean": 1.7 / 3, "median": 0.5, "p90": 0.9, "p99": 0.99})
    assert s["itl_s"] == pytest.approx({"mean": 0.7 / 3, "median": 0.2, "p90": 0.28, "p99": 0.298})
    assert s["tpot_s"] == pytest.approx({"mean": 0.2, "median": 0.2, "p90": 0.2, "p99": 0.2})
    assert s["e2e_s"]["median"] == pytest.approx(1.0)
    assert s["request_throughput"] == 0.75 and s["output_throughput"] == 7 / 4
    assert s["input_throughput"] == 160 / 4 and s["total_token_throughput"] == 167 / 4
    assert s["cached_share"] == 60 / 160 and (s["prompt_tokens"], s["cached_tokens"], s["output_tokens"]) == (160, 60, 7)
    assert s["goodput"] == 0.75  # no SLO: every completed request


def test_goodput_counts_requests_meeting_every_slo_given():
    rs = known_results()  # TTFT 0.5 / 0.2 / 1.0, TPOT 0.2 / 0.2 / none, E2E 1.1 / 0.4 / 1.0
    assert summarize(rs, 4.0, slo_ttft_s=0.6)["goodput"] == 2 / 4  # a, b
    assert summarize(rs, 4.0, slo_e2e_s=1.0)["goodput"] == 2 / 4  # b, c
    assert summarize(rs, 4.0, slo_tpot_s=0.15)["goodput"] == 1 / 4  # c has no TPOT: it passes
    assert summarize(rs, 4.0, slo_ttft_s=0.6, slo_e2e_s=1.0)["goodput"] == 1 / 4  # only b meets both


def test_throughput_over_time_spreads_each_requests_tokens_over_its_chunks():
    xs, ys = throughput_series(known_results(), bin_s=0.5, t0=1.0)
    assert xs == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
    # a's 4 tokens over 3 chunks (4/3 each) at 1.5, 1.7 | 2.0; b's at 2.2, 2.4; c's at 4.0
    assert ys == pytest.approx([0, (8 / 3) / 0.5, (4 / 3 + 2) / 0.5, 0, 0, 0, 1 / 0.5])
    assert sum(ys) * 0.5 == pytest.approx(7)  # every output token counted once
    with pytest.raises(ValueError):
        throughput_series([], 0)


# --- arrivals --------------------------------------------------------------------------------
def _cv(times: list[float]) -> tuple[float, float]:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.fmean(gaps), statistics.pstdev(gaps) / statistics.fmean(gaps)


def test_arrival_processes_have_the_rate_and_burstiness_asked_for():
    assert arrival_times(4, 2.0, "fixed") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]  # all at once: only the concurrency cap paces
    mean, cv = _cv(arrival_times(20000, 10.0, "poisson", seed=1))
    assert mean == pytest.approx(0.1, rel=0.03) and cv == pytest.approx(1.0, rel=0.05)
    mean, cv = _cv(arrival_times(20000, 10.0, "gamma", burstiness=0.25, seed=1))
    assert mean == pytest.approx(0.1, rel=0.05) and cv == pytest.approx(2.0, rel=0.08)  # 1 / sqrt(0.25)
    mean, cv = _cv(arrival_times(20000, 10.0, "gamma", burstiness=4, seed=1))
    assert mean == pytest.approx(0.1, rel=0.03) and cv == pytest.approx(0.5, rel=0.05)
    assert arrival_times(50, 3.0, seed=7) == arrival_times(50, 3.0, seed=7) != arrival_times(50, 3.0, seed=8)
    for bad in ((1, 0.0), (1, -1.0), (-1, 1.0)):
        with pytest.raises(ValueError):
            arrival_times(*bad)
    with pytest.raises(ValueError, match="unknown arrival"):
        arrival_times(2, 1.0, "uniform")


# --- datasets --------------------------------------------------------------------------------
def words(text: str) -> int:
    return len(text.split())


def test_every_word_is_one_token_so_n_words_are_n_tokens():
    from tokenizers import Tokenizer

    from deepinfer.models.convert import ensure_default_model

    tok = Tokenizer.from_file(str(ensure_default_model(progress=False) / "tokenizer.json"))
    assert len(set(datasets.WORDS)) == len(datasets.WORDS) > 300
    assert [w for w in datasets.WORDS if len(tok.encode(" " + w, add_special_tokens=False).ids) != 1] == []
    text = datasets.TextMaker(3).text("k", 700)
    assert len(tok.encode(text, add_special_tokens=False).ids) == 700
    prefix = datasets.TextMaker(3).text("p", 40)
    both = tok.encode(prefix + text, add_special_tokens=False).ids
    assert both[:40] == tok.encode(prefix, add_special_tokens=False).ids  # a clean token boundary


def test_random_lengths_stay_in_range_and_texts_are_a_function_of_the_seed():
    ss = datasets.random_sessions(200, 100, 50, range_ratio=0.2, seed=1)
    ins, outs = [words(s.turns[0].user) for s in ss], [s.turns[0].max_tokens for s in ss]
    assert min(ins) >= 80 and max(ins) <= 120 and len(set(ins)) > 10
    assert min(outs) >= 40 and max(outs) <= 60
    assert [words(s.turns[0].user) for s in datasets.random_sessions(5, 64, 8)] == [64] * 5  # range 0: exact
    again = datasets.random_sessions(200, 100, 50, range_ratio=0.2, seed=1)
    assert [s.turns[0].user for s in again] == [s.turns[0].user for s in ss]
    assert datasets.random_sessions(1, 100, 50, seed=2)[0].turns[0].user != ss[0].turns[0].user
    with pytest.raises(ValueError):
        datasets.random_sessions(1, 10, 10, range_ratio=1.0)


def test_shared_prefix_agent_and_multi_turn_sessions_share_what_they_should():
    sp = datasets.shared_prefix_sessions(6, groups=2, prefix_len=50, suffix_len=7, output_len=3)
    assert sp[0].system == sp[2].system == sp[4].system != sp[1].system == sp[3].system
    assert {words(s.system) for s in sp} == {50} and {words(s.turns[0].user) for s in sp} == {7}
    assert len({s.turns[0].user for s in sp}) == 6
    ag = datasets.agent_sessions(4, contexts=2, context_len=300, turns=3, turn_len=20, output_len=5)
    assert ag[0].system == ag[2].system != ag[1].system and words(ag[0].system) == 300
    assert all(len(s.turns) == 3 and words(s.turns[1].user) == 20 for s in ag)
    mt = datasets.multi_turn_sessions(3, turns=2, turn_len=10, output_len=4, system_len=8)
    assert len({s.system for s in mt}) == 1 and words(mt[0].system) == 8
    assert len({t.user for s in mt for t in s.turns}) == 6  # every user turn is new text


def test_trace_sessions_scale_time_and_length_and_keep_prefix_structure(tmp_path):
    rows = [{"timestamp": 1000, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
            {"timestamp": 3000, "input_length": 1300, "output_length": 20, "hash_ids": [1, 2, 3]},
            {"timestamp": 3500, "input_length": 600, "output_length": 4, "hash_ids": [1, 4]}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ids = datasets.trace_sessions(path, time_scale=0.5, block_tokens=16, output_scale=0.5)
    assert [s.arrival_s for s in ids] == [0.0, 1.0, 1.25]
    assert [len(s.turns[0].user) for s in ids] == [32, 41, 19]  # token ids: ceil(len * 16 / 512)
    assert [s.turns[0].max_tokens for s in ids] == [5, 10, 2]
    assert ids[1].turns[0].user[:32] == ids[0].turns[0].user and ids[2].turns[0].user[:16] == ids[0].turns[0].user[:16]
    text = datasets.trace_sessions(path, block_tokens=16, token_ids=False)
    w = [s.turns[0].user.split() for s in text]
    assert [len(x) for x in w] == [32, 41, 19] and w[1][:32] == w[0] and w[2][:16] == w[0][:16] != w[2][16:32]
    assert len(datasets.trace_sessions(path, n=2)) == 2


# --- the runner, against a fake OpenAI server -------------------------------------------------
class FakeServer:
    """An OpenAI-compatible server in httpx's MockTransport: the reply to the n-th request is the
    words ' rN_0 rN_1 ...' (``max_tokens`` of them), one per SSE chunk, after ``delay_s``; usage says
    half the prompt was cached. ``fail_when(body)`` answers 503 instead."""

    def __init__(self, delay_s: float = 0.02, fail_when=lambda body: False):
        self.bodies: list[dict] = []
        self.in_flight = self.peak = 0
        self.delay_s, self.fail_when = delay_s, fail_when

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        n = len(self.bodies)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        if self.fail_when(body):
            return httpx.Response(503, json={"error": {"message": "no worker"}}, headers={"retry-after": "2"})
        chat = "messages" in body
        events = []
        for i in range(body["max_tokens"]):
            piece = f" r{n}_{i}"
            events.append({"choices": [{"index": 0, "delta": {"content": piece}} if chat else
                                       {"index": 0, "text": piece}]})
        prompt = sum(len(m["content"].split()) for m in body["messages"]) if chat else len(body["prompt"].split())
        events.append({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": body["max_tokens"],
                                                "prompt_tokens_details": {"cached_tokens": prompt // 2}}})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


async def test_each_chat_turn_resends_the_conversation_with_the_replies_the_server_gave():
    sessions = datasets.multi_turn_sessions(2, turns=3, turn_len=5, output_len=3, system_len=4)
    server = FakeServer()
    done = []
    run = await run_sessions(Target("http://fake", "m", "chat", {"ignore_eos": True}), sessions, [0.0, 0.0],
                             progress=done.append, transport=server.transport)
    assert len(run.sent) == 6 and all(s.result.ok for s in run.sent) and sum(done) == 6
    by_turn = {(s.session, s.turn): s.result for s in run.sent}
    for body in server.bodies:
        s = next(i for i, x in enumerate(sessions) for t in x.turns if t.user == body["messages"][-1]["content"])
        k = next(k for k, t in enumerate(sessions[s].turns) if t.user == body["messages"][-1]["content"])
        want = [{"role": "system", "content": sessions[s].system}]
        for j in range(k):
            want += [{"role": "user", "content": sessions[s].turns[j].user},
                     {"role": "assistant", "content": by_turn[(s, j)].output_text}]
        assert body["messages"] == want + [{"role": "user", "content": sessions[s].turns[k].user}]
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    r = by_turn[(1, 2)]
    assert r.output_text.split()[0].startswith("r") and len(r.output_text.split()) == 3 == r.output_tokens
    assert len(r.token_times) == 3 and 0 < r.ttft <= r.e2e and r.cached_tokens == r.prompt_tokens // 2


async def test_completion_turns_concatenate_the_conversation_and_the_cap_bounds_requests_in_flight():
    sessions = datasets.conversation_sessions(6, turns=2, turn_len=3, output_len=2, system_len=5, contexts=2)
    server = FakeServer(delay_s=0.03)
    run = await run_sessions(Target("http://fake", "m", "completions"), sessions, [0.0] * 6, max_concurrency=2,
                             transport=server.transport)
    assert len(run.sent) == 12 and server.peak == 2
    second = [s for s in run.sent if s.turn == 1]
    for s in second:
        first = next(x for x in run.sent if x.session == s.session and x.turn == 0).result
        want = sessions[s.session].system + sessions[s.session].turns[0].user + first.output_text \
            + sessions[s.session].turns[1].user
        assert want in [b["prompt"] for b in server.bodies]
    assert completion_prompt(datasets.Session([]), [], [5, 6]) == [5, 6]
    with pytest.raises(ValueError):
        completion_prompt(datasets.Session([], system="x"), [], [5, 6])
    assert chat_messages(datasets.Session([]), [("u", "r")], "v") == [
        {"role": "user", "content": "u"}, {"role": "assistant", "content": "r"}, {"role": "user", "content": "v"}]


async def test_a_failed_turn_ends_its_session_and_is_reported_with_its_status():
    sessions = datasets.multi_turn_sessions(2, turns=3, turn_len=4, output_len=2)
    bad = sessions[0].turns[1].user
    server = FakeServer(fail_when=lambda body: body["messages"][-1]["content"] == bad)
    done = []
    run = await run_sessions(Target("http://fake", "m", "chat"), sessions, [0.0, 0.0], progress=done.append,
                             transport=server.transport)
    assert sorted((s.session, s.turn, s.result.ok) for s in run.sent) == [
        (0, 0, True), (0, 1, False), (1, 0, True), (1, 1, True), (1, 2, True)]  # (0, 2) never sent
    failed = next(s.result for s in run.sent if not s.result.ok)
    assert failed.status == 503 and failed.retry_after_s == 2.0 and "no worker" in failed.error
    assert sum(done) == 6  # the skipped turn is accounted for: the progress bar ends full
    s = summarize(run.results, run.duration_s)
    assert s["requests"] == {"sent": 5, "completed": 4, "rejected_429": 0,
                             "rejected_429_without_retry_after": 0, "failed": 1}


def test_the_table_puts_runs_side_by_side_with_the_ratio():
    s = summarize(known_results(), 4.0)
    fast = dict(summarize(known_results(), 2.0), duration_s=2.0, slo={"ttft_s": 0.6, "tpot_s": None, "e2e_s": None})
    text = format_summaries([("A", dict(s, duration_s=4.0)), ("B", fast)], ratio=True, title="t")
    rows = {line[:32].strip(): line[32:].split() for line in text.splitlines()}
    assert rows[""] == ["A", "B", "B/A"]
    assert rows["completed / sent requests"] == ["3/5", "3/5"]
    assert rows["output throughput (tok/s)"] == ["1.8", "3.5", "2.00x"]
    assert rows["TTFT median (ms)"] == ["500.0", "500.0", "1.00x"]
    assert rows["cached-token share (%)"] == ["37.5", "37.5", "1.00x"]
    assert rows["mean prompt tokens"] == ["53.3", "53.3", "1.00x"]
    empty = format_summaries([("A", dict(summarize([], 1.0), duration_s=1.0))])  # nothing completed
    assert next(x for x in empty.splitlines() if x.startswith("TTFT mean (ms)")).split()[-1] == "-"


# --- the command line --------------------------------------------------------------------------
def test_bad_command_lines_get_one_clear_error_not_a_traceback(tmp_path, capsys):
    from deepinfer import cli
    from deepinfer.bench import serve

    for argv, message in ((["bench", "serve", "--max-concurrency", "0"], "must be >= 1"),
                          (["bench", "serve", "--dataset", "nope"], "invalid choice"),
                          (["bench", "serve", "--range-ratio", "1.5"], "must be in [0, 1)"),
                          (["bench", "serve", "--extra-body", "[1]"], "must be a JSON object"),
                          (["bench", "serve", "--request-rate", "0"], "must be > 0"),
                          (["bench", "compare", "--url-a", "http://x"], "required: --url-b"),
                          (["economics", "--cache-hit", "96"], "0.96, not 96"),
                          (["economics", "--tokens-per-day", "lots"], "not a number")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "Traceback" not in err, (argv, err)
    out = str(tmp_path / "o")
    for argv, message in ((["--burstiness", "0.5"], "--burstiness needs --arrival gamma"),
                          (["--dataset", "trace", "--request-rate", "2"], "scale them with --time-scale"),
                          (["--arrival", "fixed"], "--arrival fixed needs a --request-rate"),
                          (["--prompts-per-concurrency", "4"], "--prompts-per-concurrency needs --max-concurrency"),
                          (["--dataset", "trace", "--trace", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
                          (["--url", "http://127.0.0.1:9", "--num-prompts", "1"], "error: ConnectError")):
        assert serve.main(argv + ["--out", out, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


# --- against meshes ----------------------------------------------------------------------------
MOCK_ARGS = ["--engine", "mock", "--mock-cost", "0.002,1e-5,0,0", "--heartbeat-s", "0.5"]


@pytest.fixture(scope="module")
def mock_mesh(tmp_path_factory):
    from deepinfer.launcher import Mesh

    m = Mesh(workdir=tmp_path_factory.mktemp("bench-mock-mesh"), replicas={"prefill": 1, "decode": 1},
             extra_args={"prefill": MOCK_ARGS, "decode": MOCK_ARGS})
    m.start(timeout=300)
    yield m
    m.stop()


def check_outputs(out, name: str) -> dict:
    """The JSON parses as strict JSON and both plots are real PNGs; returns the JSON."""
    doc = json.loads((out / f"{name}.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    for png in ("latency_cdf.png", "throughput.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG and len(data) > 10_000, png
    return doc


def check_plausible(s: dict, completed: int) -> None:
    assert s["requests"]["completed"] == s["requests"]["sent"] == completed, s["errors"]
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0 and 0 < s["goodput"] <= s["request_throughput"]
    assert 0 <= s["cached_share"] <= 1
    for key in ("ttft_s", "itl_s", "e2e_s", "tpot_s"):
        d = s[key]
        assert 0 < d["median"] <= d["p90"] <= d["p99"], (key, d)
    assert s["ttft_s"]["median"] <= s["e2e_s"]["median"]


def test_bench_serve_on_the_real_mesh_writes_table_json_and_plots(mesh, tmp_path, capsys):
    """SmolLM2 through the whole mesh: chat conversations of two turns, at concurrency 1 (one
    conversation) then 2 (two); a second turn resends the first and its reply, so part of its prompt
    comes from the cache."""
    from deepinfer.bench import serve

    out = tmp_path / "out"
    rc = serve.main(["--url", mesh.gateway_url, "--dataset", "multi-turn", "--turns", "2", "--turn-len", "24",
                     "--system-len", "16", "--output-len", "6", "--max-concurrency", "1", "2",
                     "--prompts-per-concurrency", "1", "--slo-ttft", "30", "--out", str(out), "--no-progress"])
    table = capsys.readouterr().out
    assert rc == 0, table
    doc = check_outputs(out, "serve")
    assert [r["label"] for r in doc["runs"]] == ["c=1", "c=2"] and doc["model"] == "SmolLM2-135M-Instruct"
    for run, sessions in zip(doc["runs"], (1, 2)):
        check_plausible(run["summary"], 2 * sessions)
        reqs = run["requests"]
        assert all(r["output_tokens"] == 6 for r in reqs)  # ignore_eos: exactly the length asked
        first = {r["session"]: r for r in reqs if r["turn"] == 0}
        for r in (r for r in reqs if r["turn"] == 1):
            assert r["prompt_tokens"] > first[r["session"]]["prompt_tokens"] + 24  # + reply + new turn
            assert r["cached_tokens"] > 0  # the first turn's prompt, from the prefix cache
    assert "c=1" in table and "c=2" in table and "TTFT p99 (ms)" in table and "TTFT <= 30 s" in table


def test_bench_serve_replays_a_trace_on_mock_workers(mock_mesh, tmp_path, capsys):
    """The Mooncake-format trace dataset: token-id prompts, the trace's times scaled, a prefix reused."""
    from deepinfer.bench import serve

    rows = [{"timestamp": 300 * i, "input_length": 512 * (2 + i % 3), "output_length": 40,
             "hash_ids": [0, 1] + [10 * i + j for j in range(i % 3)]} for i in range(8)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    rc = serve.main(["--url", mock_mesh.gateway_url, "--api", "completions", "--dataset", "trace", "--trace",
                     str(trace), "--time-scale", "0.5", "--output-scale", "0.25", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr()
    doc = check_outputs(out, "serve")
    (run,) = doc["runs"]
    check_plausible(run["summary"], 8)
    reqs = sorted(run["requests"], key=lambda r: r["session"])
    assert [r["prompt_tokens"] for r in reqs] == [16 * (2 + i % 3) for i in range(8)]
    assert all(r["output_tokens"] == 10 for r in reqs)
    assert run["summary"]["cached_share"] > 0.3  # every request after the first shares 2 trace blocks
    assert max(r["sent_s"] for r in reqs) >= 7 * 0.15 - 0.05  # arrivals at 0.15 s steps
    assert run["label"] == "trace times"


def test_bench_compare_interleaves_rounds_and_prints_ratios(mesh, mock_mesh, tmp_path, capsys):
    from deepinfer.bench import compare

    out = tmp_path / "out"
    rc = compare.main(["--url-a", mesh.gateway_url, "--label-a", "real", "--url-b", mock_mesh.gateway_url,
                       "--label-b", "mock", "--dataset", "random", "--num-prompts", "2", "--input-len", "20",
                       "--output-len", "4", "--rounds", "2", "--max-concurrency", "2", "--out", str(out),
                       "--no-progress"])
    table = capsys.readouterr().out
    assert rc == 0, table
    doc = check_outputs(out, "compare")
    real, mock = doc["endpoints"]
    for e in (real, mock):
        check_plausible(e["summary"], 4)  # 2 prompts x 2 rounds
        assert len(e["summary"]["round_durations_s"]) == 2
    assert sorted(r["prompt_tokens"] for r in real["requests"]) == sorted(r["prompt_tokens"] for r in mock["requests"])
    ratio = mock["summary"]["output_throughput"] / real["summary"]["output_throughput"]
    line = next(x for x in table.splitlines() if x.startswith("output throughput"))
    assert line.split()[-1] == f"{ratio:.2f}x"
    assert "real" in table and "mock/real" in table
