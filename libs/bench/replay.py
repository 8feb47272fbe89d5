"""Replay a Mooncake-format trace through a running gateway.

``deepinfer bench replay`` sends every request of a (scaled) trace at its
arrival time as a streamed ``/v1/completions`` request with token-id prompts
built from the trace's hash ids (``trace.PromptMaker``), either to a mesh it
starts itself (``--prefill N --decode N`` mock workers, the real gateway,
routers, tokenizer, kvindex and storage tier) or to ``--url``. It reports:

- cache hit rate in tokens (``usage.prompt_tokens_details.cached_tokens`` over
  prompt tokens) next to the trace's ideal (infinite cache) hit rate, both as
  the trace defines it (512-token blocks) and as the engine can reach it
  (whole KV blocks, the last prompt token always computed);
- TTFT / TPOT / ITL / E2E percentiles, throughput and goodput under the SLOs
  (``metrics.summarize``);
- per-worker load balance from the workers' load reports (NATS, when the
  mesh's NATS URL is known): requests finished, tokens computed, busy seconds;

and writes ``replay.json`` (summary + per request) and ``ttft_over_time.png``.

    deepinfer bench replay --trace benchmarks/traces/mooncake_synthetic_trace.jsonl \\
        --prefill 8 --decode 8 --time-scale 0.25 --output-scale 0.125 --out /tmp/replay
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from deepinfer.bench import run_cli
from deepinfer.bench.client import stream_completion
from deepinfer.bench.metrics import RequestResult, percentile, strict_json, summarize
from deepinfer.bench.trace import (PromptMaker, TraceRequest, ideal_engine_hits, ideal_hit_rate, load_mooncake,
                                   repeat_trace, scale_trace)

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "mooncake_synthetic_trace.jsonl"


class LoadWatcher:
    """Keeps each worker's first and latest ``LoadReport`` heard on NATS (``subjects.LOAD_ALL``)."""

    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        self.first: dict[str, object] = {}
        self.last: dict[str, object] = {}
        self._nc = None

    async def start(self) -> None:
        import nats

        from deepinfer.mesh.client import nats_servers
        from deepinfer.protocol import LoadReport, subjects, unpack

        self._nc = await nats.connect(servers=nats_servers(self.nats_url))

        async def on_report(msg) -> None:
            r = unpack(msg.data, LoadReport)
            self.first.setdefault(r.worker_id, r)
            self.last[r.worker_id] = r

        await self._nc.subscribe(subjects.LOAD_ALL, cb=on_report)

    async def kv_index_health(self) -> dict | None:
        """The kvindex's ``KVIndexHealth`` as a dict (None: no answer in 5 s)."""
        from deepinfer.protocol import KVIndexHealth, KVIndexHealthRequest, pack, subjects, unpack

        try:
            msg = await self._nc.request(subjects.KVINDEX_HEALTH, pack(KVIndexHealthRequest()), timeout=5)
        except Exception:  # noqa: BLE001 - a report without it
            return None
        return asdict(unpack(msg.data, KVIndexHealth))

    async def stop(self) -> None:
        if self._nc is not None:
            await self._nc.drain()

    def kv_block_size(self) -> int | None:
        """The workers' KV block size (tokens) from their reports, if any reported one."""
        return next((r.block_size for r in self.last.values() if r.block_size), None)

    def per_worker(self) -> list[dict]:
        """Per worker, what it did between its first and latest report heard."""
        rows = []
        for wid in sorted(self.last):
            a, b = self.first[wid], self.last[wid]
            if b.role not in ("prefill", "decode"):
                continue
            rows.append({"worker": wid, "role": b.role, "finished": b.finished_requests - a.finished_requests,
                         "computed_tokens": b.computed_tokens - a.computed_tokens,
                         "hit_tokens": b.prefix_hit_tokens - a.prefix_hit_tokens,
                         "busy_s": b.busy_s - a.busy_s, "steps": b.steps - a.steps})
        return rows


async def replay(url: str, model: str, reqs: list[TraceRequest], prompts: list[list[int]],
                 traffic_class: str | None = None, timeout_s: float = 600,
                 progress=None, body: dict | None = None) -> tuple[list[RequestResult], float]:
    """Send ``prompts[i]`` at ``reqs[i].arrival_s`` (seconds after the start) to ``url`` (the
    gateway's base URL), streaming /v1/completions with ``reqs[i].output_length`` tokens and the
    fields of ``body`` (e.g. ``cache_salt``) added; wait for every reply. Returns the results (in
    trace order) and the run's duration in seconds (first send -> last reply)."""
    endpoint = url.rstrip("/") + "/v1/completions"
    extra = {**(body or {}), **({"traffic_class": traffic_class} if traffic_class else {})} or None
    # NOTE: idle connections expire well before a server's keep-alive timeout (uvicorn's default 5 s):
    # reusing one the server closes that instant fails the request
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)
    done = 0

    async def one(i: int) -> RequestResult:
        nonlocal done
        res = await stream_completion(client, endpoint, model, prompts[i], reqs[i].output_length, clock0, extra)
        done += 1
        if progress:
            progress(done, len(reqs))
        return res

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30), limits=limits) as client:
        clock0 = time.perf_counter()
        tasks = []
        for i, r in enumerate(reqs):
            delay = r.arrival_s - (time.perf_counter() - clock0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
    duration = max((r.end for r in results), default=0.0) - min((r.sent for r in results), default=0.0)
    return list(results), max(duration, 1e-9)


def report(rows: list[dict], reqs: list[TraceRequest], results: list[RequestResult], duration_s: float,
           block_tokens: int, kv_block_size: int, workers: list[dict], slo_ttft_s: float,
           slo_tpot_s: float) -> dict:
    """The replay's summary: ``metrics.summarize`` plus hit rates and workers.

    Both ideal hit rates are taken over the completed requests only, in arrival order (a
    rejected or failed request stores nothing, so it cannot make a later one hit): the
    engine's (``ideal_engine_hits`` on the scaled prompts, ``kv_block_size``-token blocks) and
    the trace's own (``ideal_hit_rate`` on the raw rows: 512-token blocks, unscaled, uncapped).
    ``rows[i]`` is the raw row of ``reqs[i]``."""
    summary = summarize(results, duration_s, slo_ttft_s, slo_tpot_s)
    done = [i for i, r in enumerate(results) if r.ok]
    served = [reqs[i] for i in done]
    prompt = sum(q.input_length for q in served)
    summary["hit_rate"] = {
        "measured": summary["cached_share"],
        "ideal_engine": sum(ideal_engine_hits(served, block_tokens, kv_block_size)) / prompt if prompt else 0.0,
        "ideal_trace": ideal_hit_rate([rows[i] for i in done]),
    }
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            why = f"HTTP {r.status}: " if r.status else ""
            errors[why + (r.error or "no output")[:160]] = errors.get(why + (r.error or "no output")[:160], 0) + 1
    summary["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1]))
    summary["duration_s"] = duration_s
    summary["slo"] = {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s}
    summary["workers"] = workers
    for role in ("prefill", "decode"):
        busy = [w["busy_s"] for w in workers if w["role"] == role]
        if busy and sum(busy) > 0:
            summary.setdefault("balance", {})[role] = {"busy_max_over_mean": max(busy) / (sum(busy) / len(busy))}
    return summary


def format_table(s: dict) -> str:
    """The summary as a terminal table."""
    q = s["requests"]
    bare = q["rejected_429_without_retry_after"]
    lines = [f"requests: {q['sent']} sent, {q['completed']} completed, {q['rejected_429']} rejected (429"
             f"{f', {bare} without Retry-After' if bare else ''}), {q['failed']} failed, in {s['duration_s']:.1f} s",
             f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
             f"goodput {s['goodput']:.2f} req/s (TTFT <= {s['slo']['ttft_s']} s, TPOT <= {s['slo']['tpot_s']} s)",
             "hit rate (tokens): measured {measured:.2%} | ideal, engine blocks {ideal_engine:.2%} | "
             "ideal, trace blocks {ideal_trace:.2%}".format(**s["hit_rate"]),
             f"{'metric':<10}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}   (seconds)"]
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = s[k]
        lines.append(f"{k[:-2].upper():<10}" + "".join(f"{d[m]:>10.3f}" for m in ("mean", "median", "p90", "p99")))
    if s["workers"]:
        lines.append(f"{'worker':<14}{'finished':>10}{'computed tok':>14}{'hit tok':>10}{'busy s':>10}{'steps':>8}")
        for w in s["workers"]:
            lines.append(f"{w['worker']:<14}{w['finished']:>10}{w['computed_tokens']:>14}{w['hit_tokens']:>10}"
                         f"{w['busy_s']:>10.1f}{w['steps']:>8}")
        for role, b in s.get("balance", {}).items():
            lines.append(f"{role} balance: busiest worker {b['busy_max_over_mean']:.2f}x the mean busy time")
    for why, n in list(s.get("errors", {}).items())[:5]:
        lines.append(f"failed x{n}: {why}")
    k = s.get("kv_index")
    if k:
        lines.append(f"kvindex: {k['num_blocks']} blocks, {k['events_applied']} events applied, {k['gaps']} gaps, "
                     f"{k['lookup_timeouts']} lookups timed out (answered as misses)")
    return "\n".join(lines)


def plot_ttft(results: list[RequestResult], path: Path, slo_ttft_s: float) -> None:
    """PNG: TTFT of every completed request against its arrival time, with a rolling p90."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted((r.sent, r.ttft) for r in results if r.ok)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    if pts:
        xs, ys = zip(*pts)
        ax.scatter(xs, ys, s=4, alpha=0.35, label="TTFT per request")
        window = max(1, len(pts) // 40)
        roll = [percentile(list(ys[max(0, i - window):i + window + 1]), 90) for i in range(len(ys))]
        ax.plot(xs, roll, color="C3", lw=1.5, label=f"rolling p90 (±{window} requests)")
    ax.axhline(slo_ttft_s, color="gray", ls="--", lw=1, label=f"TTFT SLO {slo_ttft_s} s")
    ax.set_yscale("log")
    rejected = [r.sent for r in results if r.status == 429]
    if rejected:  # along the bottom edge
        ax.scatter(rejected, [0.02] * len(rejected), marker="x", color="k", s=10,
                   transform=ax.get_xaxis_transform(), label="429 (rejected)")
    ax.set_xlabel("arrival (s since start)")
    ax.set_ylabel("TTFT (s, log scale)")
    ax.set_title(f"Trace replay: TTFT over time ({len(pts)} requests)")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return n


def _positive_float(text: str) -> float:
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSON lines (default: %(default)s)")
    p.add_argument("--url", default=None, help="a running gateway (default: start a mock mesh)")
    p.add_argument("--nats-url", default=None, help="that mesh's NATS, for the per-worker table (with --url)")
    p.add_argument("--model", default=None, help="model name to send (default: the gateway's first /v1/models)")
    p.add_argument("--prefill", type=_positive_int, default=8, help="mock prefill workers to start (without --url; default 8)")
    p.add_argument("--decode", type=_positive_int, default=8, help="mock decode workers to start (without --url; default 8)")
    p.add_argument("--mock-cost", default=None, help="timing model a,b,d,e for the mock workers (s)")
    p.add_argument("--prefill-router", default=None, help="the gateway's --prefill-router (without --url)")
    p.add_argument("--gateway-arg", action="append", default=[],
                   help="one more gateway argument (without --url; repeat it, e.g. --gateway-arg=--ttft-slo-s=2)")
    p.add_argument("--time-scale", type=_positive_float, default=0.25, help="arrival times x this (default 0.25)")
    p.add_argument("--block-tokens", type=_positive_int, default=16,
                   help="tokens per 512-token trace block: length scale = this / 512 (default 16)")
    p.add_argument("--output-scale", type=_positive_float, default=0.125, help="output lengths x this (default 0.125)")
    p.add_argument("--max-requests", type=_positive_int, default=None, help="replay only the first N requests")
    p.add_argument("--repeat", type=_positive_int, default=1,
                   help="play the trace N times back to back, each pass with its own prefixes (default 1)")
    p.add_argument("--max-input-tokens", type=_positive_int, default=None, help="cap scaled prompts at N tokens")
    p.add_argument("--traffic-class", default=None, help="traffic_class field to send (default: the gateway's)")
    p.add_argument("--slo-ttft", type=_positive_float, default=5.0, help="TTFT SLO for goodput, seconds (default 5)")
    p.add_argument("--slo-tpot", type=_positive_float, default=0.5, help="TPOT SLO for goodput, seconds (default 0.5)")
    p.add_argument("--out", type=Path, default=Path("replay-out"),
                   help="directory for replay.json and the PNG (default: replay-out)")
    p.add_argument("--timeout", type=_positive_float, default=600,
                   help="seconds a request may wait for its next bytes (httpx read timeout; default 600)")
    p.add_argument("--workdir", default=None, help="the started mesh's logs / KV blocks (default: a temporary dir)")


async def _model_name(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(url.rstrip("/") + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def run(args: argparse.Namespace) -> dict:
    """Run a replay as the command line describes; returns the summary (also written to ``--out``)."""
    rows = repeat_trace(load_mooncake(args.trace)[:args.max_requests], args.repeat)
    if not rows:
        raise ValueError(f"{args.trace}: the trace has no requests")
    reqs = scale_trace(rows, args.time_scale, args.block_tokens, args.output_scale, None, args.max_input_tokens)
    maker = PromptMaker(args.block_tokens)
    prompts = [maker.prompt(r) for r in reqs]
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    mesh = None
    if args.url is None:
        from deepinfer.launcher import Mesh

        mock = ["--engine", "mock", "--heartbeat-s", "0.5"] + (["--mock-cost", args.mock_cost] if args.mock_cost else [])
        gateway = list(args.gateway_arg) + (["--prefill-router", args.prefill_router] if args.prefill_router else [])
        mesh = Mesh(workdir=args.workdir, replicas={"prefill": args.prefill, "decode": args.decode},
                    extra_args={"prefill": mock, "decode": mock, "gateway": gateway})
        say(f"starting a mesh: {args.prefill} mock prefill + {args.decode} mock decode workers ...")
        mesh.start(timeout=600)
        url, nats_url = mesh.gateway_url, mesh.nats_url
    else:
        url, nats_url = args.url, args.nats_url
    try:
        return asyncio.run(_run(args, url, nats_url, rows, reqs, prompts, say))
    finally:
        if mesh is not None:
            mesh.stop()


async def _run(args, url, nats_url, rows, reqs, prompts, say) -> dict:
    model = args.model or await _model_name(url)
    watcher = LoadWatcher(nats_url) if nats_url else None
    if watcher:
        await watcher.start()
        await asyncio.sleep(1.5)  # a first report from every worker
    span = reqs[-1].arrival_s if reqs else 0
    say(f"replaying {len(reqs)} requests over {span:.0f} s "
        f"(mean prompt {sum(r.input_length for r in reqs) / max(1, len(reqs)):.0f} tokens) against {url}")
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if time.monotonic() - last[0] > 10 or done == total:
            last[0] = time.monotonic()
            say(f"  {done}/{total} done")

    results, duration = await replay(url, model, reqs, prompts, args.traffic_class, args.timeout, progress)
    workers, kv_index = [], None
    if watcher:
        await asyncio.sleep(1.5)  # the reports after the last request
        workers = watcher.per_worker()
        kv_index = await watcher.kv_index_health()
        await watcher.stop()
    block_size = watcher.kv_block_size() if watcher else None
    summary = report(rows, reqs, results, duration, args.block_tokens, block_size or 16, workers, args.slo_ttft,
                     args.slo_tpot)
    summary["kv_index"] = kv_index
    summary["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                       if k not in ("func", "command", "bench")}
    args.out.mkdir(parents=True, exist_ok=True)
    per_request = [{"arrival_s": q.arrival_s, "input_length": q.input_length, "output_length": q.output_length,
                    **{k: v for k, v in asdict(r).items() if k != "token_times"},
                    "ttft_s": r.ttft if r.ok else None} for q, r in zip(reqs, results)]
    (args.out / "replay.json").write_text(json.dumps(strict_json({"summary": summary, "requests": per_request}),
                                                     indent=1, allow_nan=False))
    plot_ttft(results, args.out / "ttft_over_time.png", args.slo_ttft)
    print(format_table(summary))
    say(f"wrote {args.out / 'replay.json'} and {args.out / 'ttft_over_time.png'}")
    return summary


def cli(args: argparse.Namespace) -> int:
    """``run`` for the command line: a one-line error (exit 2) for bad input or an unreachable
    gateway, exit 1 when no request completed, else 0."""
    from deepinfer.launcher import LauncherError

    return run_cli(run, args, lambda summary: "no request completed (reasons above and in replay.json)"
                   if summary["requests"]["completed"] == 0 else None, errors=(LauncherError,))


DESCRIPTION = ("Replay a Mooncake-format trace through the gateway, against mock workers it starts "
               "(or --url), and report cache hit rate vs the ideal, latency percentiles and load balance.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deepinfer bench replay", description=DESCRIPTION)
    add_arguments(p)
    return cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
