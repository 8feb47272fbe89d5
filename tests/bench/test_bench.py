"""Benchmark metrics and Mooncake trace replay: definitions on synthetic timings with known answers,
trace scaling and ideal hit rates on hand-made traces (the replay through a mock mesh is in
test_mock_engine.py, next to that mesh)."""

from __future__ import annotations

import json
import math

import pytest

from deepinfer.bench.metrics import RequestResult, percentile, summarize
from deepinfer.bench.trace import (PromptMaker, TraceRequest, ideal_engine_hits, ideal_hit_rate, load_mooncake,
                                   repeat_trace, scale_trace)


def test_percentile_interpolates_between_ranks_like_numpy():
    assert percentile([3, 1, 2, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))


def test_request_metrics_and_run_summary_on_known_timings():
    a = RequestResult(sent=1.0, token_times=[1.5, 1.7, 2.0], end=2.0, prompt_tokens=100, cached_tokens=60,
                      output_tokens=3, status=200)
    b = RequestResult(sent=2.0, token_times=[4.0], end=4.0, prompt_tokens=50, cached_tokens=0, output_tokens=1,
                      status=200)
    rejected = RequestResult(sent=3.0, status=429, error="busy", retry_after_s=1.0)
    failed = RequestResult(sent=3.0, status=200, error="stream ended without output")
    assert a.ttft == 0.5 and a.tpot == pytest.approx(0.25) and a.itls == pytest.approx([0.2, 0.3])
    assert b.tpot is None and b.ttft == 2.0
    s = summarize([a, b, rejected, failed], duration_s=4.0, slo_ttft_s=1.0, slo_tpot_s=0.3)
    assert s["requests"] == {"sent": 4, "completed": 2, "rejected_429": 1, "rejected_429_without_retry_after": 0,
                             "failed": 1}
    bare = RequestResult(sent=3.0, status=429, error="busy")  # no Retry-After header
    assert summarize([a, rejected, bare], 4.0)["requests"]["rejected_429_without_retry_after"] == 1
    assert s["ttft_s"]["mean"] == pytest.approx(1.25) and s["ttft_s"]["median"] == pytest.approx(1.25)
    assert s["itl_s"]["mean"] == pytest.approx(0.25)
    assert s["request_throughput"] == 0.5 and s["output_throughput"] == 1.0
    assert s["goodput"] == 0.25  # b misses the TTFT SLO
    assert s["cached_share"] == pytest.approx(60 / 150)
    assert summarize([a, b], 4.0, slo_tpot_s=0.2)["goodput"] == 0.25  # a misses the TPOT SLO
    with pytest.raises(ValueError):
        summarize([a], 0)


ROWS = [  # hash ids: equal leading ids = equal prefix
    {"timestamp": 1000, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 1500, "input_length": 1300, "output_length": 20, "hash_ids": [1, 2, 3]},  # hits 2 blocks
    {"timestamp": 3000, "input_length": 700, "output_length": 5, "hash_ids": [1, 4]},  # hits 1 block
    {"timestamp": 3100, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},  # all: min(1024, 1000)
]


def test_ideal_hit_rate_counts_leading_blocks_seen_before():
    assert ideal_hit_rate(ROWS) == pytest.approx((0 + 1024 + 512 + 1000) / (1024 + 1300 + 700 + 1000))


def test_scaling_keeps_prefix_structure_and_equal_ids_give_equal_tokens(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    rows = load_mooncake(path)
    reqs = scale_trace(rows, time_scale=0.5, block_tokens=16, output_scale=0.5)
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 1.0, 1.05]
    assert [r.input_length for r in reqs] == [32, 41, 22, 32]  # ceil(len * 16 / 512), at most 16 per id
    assert [r.output_length for r in reqs] == [5, 10, 2, 2]
    maker = PromptMaker(16)
    p = [maker.prompt(r) for r in reqs]
    assert [len(x) for x in p] == [32, 41, 22, 32]
    assert p[1][:32] == p[0] and p[3] == p[0] and p[2][:16] == p[0][:16] and p[2][16:] != p[0][16:22]
    # KV blocks of 16 tokens: request 1 hits both of request 0's blocks (41 - 1 >= 32); request 2 one
    # block; request 3 (32 tokens, all stored) recomputes its last block: 16
    assert ideal_engine_hits(reqs, 16, 16) == [0, 32, 16, 16]
    # two KV blocks per trace block: partial trace blocks are keyed by their id and offset
    assert ideal_engine_hits(scale_trace(rows, block_tokens=32), 32, 16) == [0, 64, 32, 48]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="missing"):
        load_mooncake(bad)


def test_bad_trace_lines_are_named_by_file_and_line(tmp_path):
    cases = {'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n{oops\n': ":2: not JSON",
             "[1, 2]\n": ":1: expected a JSON object",
             '{"timestamp": "x", "input_length": 1, "output_length": 1, "hash_ids": [1]}\n': ":1: timestamp",
             '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []}\n': ":1: timestamp"}
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"t{i}.jsonl"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_mooncake(path)


def test_a_repeated_trace_plays_back_to_back_with_fresh_prefixes():
    rows = [{"timestamp": 100, "input_length": 10, "output_length": 1, "hash_ids": [0, 1]},
            {"timestamp": 300, "input_length": 10, "output_length": 1, "hash_ids": [0, 5]}]
    out = repeat_trace(rows, 3)
    assert [r["timestamp"] for r in out] == [100, 300, 500, 700, 900, 1100]
    assert [r["hash_ids"] for r in out] == [[0, 1], [0, 5], [6, 7], [6, 11], [12, 13], [12, 17]]
    assert ideal_hit_rate(out) == pytest.approx(ideal_hit_rate(rows))
    assert repeat_trace(rows, 1) == rows
    with pytest.raises(ValueError):
        repeat_trace(rows, 0)


def test_ideals_count_only_served_requests(tmp_path):
    """A rejected request stores nothing: the request after it cannot hit its prefix, so the ideals
    (like the measurement) leave it out."""
    from deepinfer.bench.replay import report

    reqs = scale_trace(ROWS[:2], block_tokens=16)
    rejected = RequestResult(sent=0.0, end=0.1, status=429, error="busy")
    served = RequestResult(sent=0.5, token_times=[0.7], end=0.8, prompt_tokens=41, output_tokens=1, status=200)
    s = report(ROWS[:2], reqs, [rejected, served], 1.0, 16, 16, [], 5.0, 0.5)
    assert s["hit_rate"] == {"measured": 0.0, "ideal_engine": 0.0, "ideal_trace": 0.0}
    assert s["errors"] == {"HTTP 429: busy": 1}
    both = report(ROWS[:2], reqs, [served, served], 1.0, 16, 16, [], 5.0, 0.5)
    assert both["hit_rate"]["ideal_engine"] == pytest.approx(32 / (32 + 41))


def test_the_command_line_refuses_bad_input_in_one_line(tmp_path, capsys):
    from deepinfer.bench.replay import main

    for flags in (["--time-scale", "0"], ["--prefill", "0"], ["--max-requests", "-1"], ["--block-tokens", "0"]):
        with pytest.raises(SystemExit) as e:
            main(flags)
        assert e.value.code == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["--trace", str(empty)]) == 2  # before any mesh is started
    assert "the trace has no requests" in capsys.readouterr().err
    assert main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(ROWS[0]) + "\n")
    assert main(["--trace", str(trace), "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "o")]) == 2
    assert "error: ConnectError" in capsys.readouterr().err
