"""``deepinfer bench serve``: a serving benchmark client for any OpenAI-compatible endpoint.

    deepinfer bench serve --url http://127.0.0.1:8000 --dataset random --input-len 128 \\
        --output-len 128 --num-prompts 64 --max-concurrency 1 8 32 --out bench-out

It builds a workload (``datasets.py``: random, shared-prefix, multi-turn, agent,
trace), sends it streamed (``runner.py``) at the arrival process's times
(``arrivals.py``: Poisson, gamma with a burstiness, fixed rate, or all at once)
under an optional cap on concurrent requests, and reports the metrics of
``metrics.py`` (TTFT / TPOT / ITL / E2E mean, median, p90, p99; request and token
throughput; goodput under the SLOs given; cached-token share). Several
``--max-concurrency`` values make one run each, in order, with the seed plus the
run's index (fresh prompts each, so no run finds the previous one's prefixes
cached); ``--prompts-per-concurrency K`` sizes each run at K x its cap. Outputs: a progress bar (stderr), a table (stdout), ``<out>/serve.json``
(args, every run's summary and requests), ``<out>/latency_cdf.png`` and
``<out>/throughput.png``. Definitions: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
from pathlib import Path


from deepinfer.bench import datasets, run_cli
from deepinfer.bench.arrivals import PROCESSES, arrival_times
from deepinfer.bench.metrics import strict_json, summarize
from deepinfer.bench.plots import plot_latency_cdfs, plot_throughput
from deepinfer.bench.runner import APIS, Run, Target, run_sessions, served_model
from deepinfer.bench.table import format_summaries

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "mooncake_synthetic_trace.jsonl"


# ------------------------------------------------------------------------------ arguments


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return n


def nonnegative_int(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return n


def positive_float(text: str) -> float:
    x = float(text)
    if not x > 0 or math.isnan(x):
        raise argparse.ArgumentTypeError("must be > 0")
    return x


def nonnegative_float(text: str) -> float:
    x = float(text)
    if not x >= 0 or math.isinf(x):
        raise argparse.ArgumentTypeError("must be a finite number >= 0")
    return x


def ratio(text: str) -> float:
    x = float(text)
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError("must be in [0, 1)")
    return x


def json_object(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def add_request_arguments(p: argparse.ArgumentParser) -> None:
    """What every request carries (both endpoints of ``compare`` alike)."""
    g = p.add_argument_group("requests")
    g.add_argument("--api", choices=APIS, default="chat",
                   help="chat: /v1/chat/completions with messages; completions: /v1/completions with one prompt "
                        "(a trace's token ids) (default chat)")
    g.add_argument("--temperature", type=nonnegative_float, default=0.0, help="sampling temperature (default 0)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly the output length (vLLM's ignore_eos; default on)")
    g.add_argument("--extra-body", type=json_object, default={},
                   help="more request fields as a JSON object, e.g. '{\"traffic_class\": \"agent\"}'")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--timeout", type=positive_float, default=600,
                   help="seconds a request may wait for its next bytes (default 600)")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Dataset, arrival process and SLOs (shared by ``serve`` and ``compare``)."""
    g = p.add_argument_group("dataset (lengths in tokens)")
    g.add_argument("--dataset", choices=datasets.DATASETS, default="random", help="the workload (default random)")
    g.add_argument("--num-prompts", type=positive_int, default=None,
                   help="requests (random, shared-prefix), sessions (multi-turn, agent) or first trace rows "
                        "(trace); default 100, the whole trace for trace")
    g.add_argument("--input-len", type=positive_int, default=128, help="random: prompt tokens (default 128)")
    g.add_argument("--output-len", type=positive_int, default=128,
                   help="output tokens per request, every dataset but trace (default 128)")
    g.add_argument("--range-ratio", type=ratio, default=0.0,
                   help="random: lengths uniform in len x [1 - r, 1 + r] (default 0)")
    g.add_argument("--prefix-groups", type=positive_int, default=4, help="shared-prefix: system prompts (default 4)")
    g.add_argument("--prefix-len", type=positive_int, default=512, help="shared-prefix: system prompt tokens (default 512)")
    g.add_argument("--suffix-len", type=positive_int, default=32, help="shared-prefix: question tokens (default 32)")
    g.add_argument("--turns", type=positive_int, default=4, help="multi-turn, agent: turns per session (default 4)")
    g.add_argument("--turn-len", type=positive_int, default=64,
                   help="multi-turn, agent: new user / tool tokens per turn (default 64)")
    g.add_argument("--system-len", type=nonnegative_int, default=32,
                   help="multi-turn: the shared system prompt's tokens (default 32)")
    g.add_argument("--contexts", type=positive_int, default=2, help="agent: distinct long contexts (default 2)")
    g.add_argument("--context-len", type=positive_int, default=2048, help="agent: tokens per long context (default 2048)")
    g.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace: Mooncake-format JSON lines (default: %(default)s)")
    g.add_argument("--time-scale", type=positive_float, default=1.0, help="trace: arrival times x this (default 1)")
    g.add_argument("--block-tokens", type=positive_int, default=16,
                   help="trace: tokens per 512-token trace block, i.e. length scale = this / 512 (default 16)")
    g.add_argument("--output-scale", type=positive_float, default=1.0, help="trace: output lengths x this (default 1)")
    g.add_argument("--max-input-tokens", type=positive_int, default=None, help="trace: cap prompts at N tokens")
    g.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default 0)")
    g = p.add_argument_group("load (not for trace: it keeps the trace's times)")
    g.add_argument("--request-rate", type=positive_float, default=None,
                   help="mean arrivals per second (default inf: all at once, paced only by --max-concurrency)")
    g.add_argument("--arrival", choices=PROCESSES, default="poisson",
                   help="gaps between arrivals: poisson, gamma (with --burstiness) or fixed (default poisson)")
    g.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="gamma: shape of the gaps; 1 = Poisson, < 1 burstier, > 1 more regular (default 1)")
    g.add_argument("--think-time", type=nonnegative_float, default=0.0,
                   help="multi-turn, agent: seconds between a reply and the next turn (default 0)")
    g = p.add_argument_group("goodput SLOs (seconds; a request counts when it meets every one given)")
    g.add_argument("--slo-ttft", type=positive_float, default=None, help="time to first token")
    g.add_argument("--slo-tpot", type=positive_float, default=None, help="time per output token after the first")
    g.add_argument("--slo-e2e", type=positive_float, default=None, help="end-to-end latency")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the endpoint's base URL, without /v1 (default %(default)s)")
    p.add_argument("--model", default=None, help="model name to send (default: the endpoint's first /v1/models)")
    p.add_argument("--max-concurrency", type=positive_int, nargs="+", default=None, metavar="N",
                   help="at most N requests in flight; several values run one after another (default: no cap)")
    p.add_argument("--prompts-per-concurrency", type=positive_int, default=None, metavar="K",
                   help="with --max-concurrency: each run sends K x N prompts (sessions) instead of --num-prompts, "
                        "so every level runs about K waves")
    add_request_arguments(p)
    add_workload_arguments(p)
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="directory for serve.json, latency_cdf.png, throughput.png (default bench-out)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_arguments(args: argparse.Namespace) -> None:
    """Cross-flag checks argparse cannot make; ValueError with the reason."""
    if args.burstiness != 1.0 and args.arrival != "gamma":
        raise ValueError("--burstiness needs --arrival gamma")
    if args.dataset == "trace" and args.request_rate is not None:
        raise ValueError("the trace dataset sends at the trace's times: scale them with --time-scale, "
                         "not --request-rate")
    if args.arrival == "fixed" and args.request_rate is None:
        raise ValueError("--arrival fixed needs a --request-rate")
    if getattr(args, "prompts_per_concurrency", None) and (not args.max_concurrency or args.num_prompts
                                                           or args.dataset == "trace"):
        raise ValueError("--prompts-per-concurrency needs --max-concurrency, without --num-prompts, "
                         "and a generated dataset (not trace)")


# ------------------------------------------------------------------------------ workload


def build_sessions(args: argparse.Namespace, seed: int, n: int | None = None) -> list[datasets.Session]:
    """The workload the arguments describe, its prompts drawn with ``seed``; ``n`` overrides
    ``--num-prompts``."""
    n = n or args.num_prompts or 100
    if args.dataset == "random":
        return datasets.random_sessions(n, args.input_len, args.output_len, args.range_ratio, seed)
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_sessions(n, args.prefix_groups, args.prefix_len, args.suffix_len,
                                               args.output_len, seed)
    if args.dataset == "multi-turn":
        return datasets.multi_turn_sessions(n, args.turns, args.turn_len, args.output_len, args.system_len, seed)
    if args.dataset == "agent":
        return datasets.agent_sessions(n, args.contexts, args.context_len, args.turns, args.turn_len,
                                       args.output_len, seed)
    return datasets.trace_sessions(args.trace, args.num_prompts, args.time_scale, args.block_tokens,
                                   args.output_scale, args.max_input_tokens, token_ids=args.api == "completions",
                                   seed=seed)


def make_target(args: argparse.Namespace, url: str, model: str) -> Target:
    extra = {"temperature": args.temperature, "ignore_eos": args.ignore_eos, **args.extra_body}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    return Target(url, model, args.api, extra, headers)


async def run_workload(target: Target, args: argparse.Namespace, sessions: list[datasets.Session], seed: int,
                       max_concurrency: int | None, label: str) -> Run:
    """One run of ``sessions`` against ``target`` (arrival times drawn with ``seed``), with a progress
    bar unless ``--no-progress``."""
    from tqdm import tqdm

    arrivals = arrival_times(len(sessions), args.request_rate or math.inf, args.arrival, args.burstiness, seed)
    with tqdm(total=sum(len(s.turns) for s in sessions), desc=label, unit="req", file=sys.stderr,
              disable=args.no_progress, dynamic_ncols=True) as bar:
        return await run_sessions(target, sessions, arrivals, max_concurrency, args.think_time, args.timeout,
                                  bar.update)


def run_summary(run: Run, args: argparse.Namespace, **extra) -> dict:
    """``metrics.summarize`` of a run plus its duration, SLOs and the load it ran under."""
    s = summarize(run.results, run.duration_s, args.slo_ttft, args.slo_tpot, args.slo_e2e)
    s["duration_s"] = run.duration_s
    s["slo"] = {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot, "e2e_s": args.slo_e2e}
    s["errors"] = error_counts(run)
    s.update(extra)
    return s


def error_counts(run: Run) -> dict[str, int]:
    """The failures' reasons (HTTP status + message start), commonest first."""
    errors: dict[str, int] = {}
    for r in run.results:
        if not r.ok:
            why = (f"HTTP {r.status}: " if r.status else "") + (r.error or "no output")[:160]
            errors[why] = errors.get(why, 0) + 1
    return dict(sorted(errors.items(), key=lambda kv: -kv[1]))


def request_records(run: Run) -> list[dict]:
    """Per request, for the JSON file: ids, times (s), token counts, status."""
    out = []
    for s in run.sent:
        r = s.result
        out.append({"session": s.session, "turn": s.turn, "sent_s": r.sent, "status": r.status, "error": r.error,
                    "ttft_s": r.ttft if r.ok else None, "tpot_s": r.tpot if r.ok else None,
                    "e2e_s": r.e2e, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                    "output_tokens": r.output_tokens, "token_times_s": [round(t, 6) for t in r.token_times]})
    return out


def args_record(args: argparse.Namespace) -> dict:
    skip = {"command", "bench", "api_key"}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}


def run_label(args: argparse.Namespace, max_concurrency: int | None) -> str:
    parts = []
    if args.dataset != "trace" and args.request_rate is not None:
        parts.append(f"{args.request_rate:g} req/s")
    if max_concurrency:
        parts.append(f"c={max_concurrency}")
    return ", ".join(parts) or ("trace times" if args.dataset == "trace" else "all at once")


def write_outputs(out: Path, name: str, doc: dict, runs: list[tuple[str, Run]], title: str) -> list[Path]:
    """``<out>/<name>.json`` and the two plots; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / "latency_cdf.png", out / "throughput.png"]
    paths[0].write_text(json.dumps(strict_json(doc), indent=1, allow_nan=False))
    labelled = [(label, run.results) for label, run in runs]
    plot_latency_cdfs(labelled, paths[1], f"{title}: latency CDFs")
    plot_throughput(labelled, paths[2], f"{title}: throughput over time")
    return paths


# ------------------------------------------------------------------------------ command


async def _run(args: argparse.Namespace) -> dict:
    levels = args.max_concurrency or [None]
    k = args.prompts_per_concurrency
    # bad input fails here, before any request
    workloads = [build_sessions(args, args.seed + i, k * mc if k else None) for i, mc in enumerate(levels)]
    model = args.model or await served_model(args.url)
    target = make_target(args, args.url, model)
    runs, entries = [], []
    for i, mc in enumerate(levels):
        label = run_label(args, mc)
        run = await run_workload(target, args, workloads[i], args.seed + i, mc, label)
        summary = run_summary(run, args, max_concurrency=mc, request_rate=args.request_rate, seed=args.seed + i)
        runs.append((label, run))
        entries.append({"label": label, "summary": summary, "requests": request_records(run)})
    doc = {"benchmark": "serve", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "url": args.url, "model": model, "api": args.api, "dataset": args.dataset, "args": args_record(args),
           "runs": entries}
    title = f"{args.dataset} on {model} ({args.url})"
    print(format_summaries([(e["label"], e["summary"]) for e in entries], title=title))
    for e in entries:
        for why, n in list(e["summary"]["errors"].items())[:5]:
            print(f"{e['label']}: failed x{n}: {why}")
    paths = write_outputs(args.out, "serve", doc, runs, title)
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return doc


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark the arguments describe; returns the document written to ``serve.json``."""
    check_arguments(args)
    return asyncio.run(_run(args))


def cli(args: argparse.Namespace) -> int:
    """``run`` for the command line: one ``error:`` line and exit 2 for bad input or an unreachable
    endpoint, exit 1 when no request of a run completed, else 0."""
    return run_cli(run, args, lambda doc: "a run completed no request (reasons above and in serve.json)"
                   if any(e["summary"]["requests"]["completed"] == 0 for e in doc["runs"]) else None)


DESCRIPTION = ("Benchmark an OpenAI-compatible endpoint: datasets (random, shared-prefix, multi-turn, agent, "
               "Mooncake trace), arrival processes, concurrency caps; TTFT/TPOT/ITL/E2E, throughput, goodput, "
               "cached-token share; a table, serve.json and PNG plots.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deepinfer bench serve", description=DESCRIPTION)
    add_arguments(p)
    return cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
