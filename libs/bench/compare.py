"""``deepinfer bench compare``: the same workload against two endpoints, interleaved by rounds.

    deepinfer bench compare --url-a http://127.0.0.1:8000 --label-a deepinfer \\
        --url-b http://127.0.0.1:8001 --label-b vllm --dataset random --num-prompts 32 \\
        --max-concurrency 8 --rounds 4

Round ``r`` (0-based) draws the workload with seed ``--seed + r`` and runs it whole
against A then B (even rounds) or B then A (odd rounds): both endpoints get exactly the
same prompts, each round starts cold for both (fresh prefixes), and the ABBA order
cancels a steady drift of the machine (another process warming up or winding down).
Only one endpoint runs at a time, so two servers on one machine do not compete.

Each endpoint's rounds are summarized together (``metrics.summarize``; duration = the
sum of its rounds' durations) and printed side by side with the ratio B / A per
metric. Outputs: ``<out>/compare.json``, ``<out>/latency_cdf.png``,
``<out>/throughput.png`` (an endpoint's rounds laid end to end).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from dataclasses import replace
from pathlib import Path


from deepinfer.bench import run_cli, serve
from deepinfer.bench.runner import Run, Sent, served_model
from deepinfer.bench.table import format_summaries


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url-a", required=True, help="endpoint A's base URL, without /v1")
    p.add_argument("--url-b", required=True, help="endpoint B's base URL, without /v1")
    p.add_argument("--label-a", default="A", help="A's name in the table (default A)")
    p.add_argument("--label-b", default="B", help="B's name in the table (default B)")
    p.add_argument("--model-a", default=None, help="model name sent to A (default: A's first /v1/models)")
    p.add_argument("--model-b", default=None, help="model name sent to B (default: B's first /v1/models)")
    p.add_argument("--rounds", type=serve.positive_int, default=2,
                   help="rounds, each running the workload on both endpoints, ABBA order (default 2)")
    p.add_argument("--max-concurrency", type=serve.positive_int, default=None, metavar="N",
                   help="at most N requests in flight (default: no cap)")
    serve.add_request_arguments(p)
    serve.add_workload_arguments(p)
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("compare-out"),
                   help="directory for compare.json, latency_cdf.png, throughput.png (default compare-out)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def concat_runs(runs: list[Run]) -> Run:
    """Runs laid end to end on one clock (each shifted to start where the previous one ended)."""
    out: list[Sent] = []
    offset = 0.0
    for run in runs:
        if not run.sent:
            continue
        start = min(s.result.sent for s in run.sent)
        shift = offset - start
        for s in run.sent:
            r = s.result
            out.append(Sent(s.session, s.turn, replace(r, sent=r.sent + shift, end=r.end + shift,
                                                       token_times=[t + shift for t in r.token_times])))
        offset += run.duration_s
    return Run(out, max(sum(r.duration_s for r in runs), 1e-9))


async def _run(args: argparse.Namespace) -> dict:
    names = (args.label_a, args.label_b)
    if names[0] == names[1]:
        raise ValueError("--label-a and --label-b must differ")
    workloads = [serve.build_sessions(args, args.seed + r) for r in range(args.rounds)]  # bad input fails here
    urls = (args.url_a, args.url_b)
    models = (args.model_a or await served_model(urls[0]), args.model_b or await served_model(urls[1]))
    targets = [serve.make_target(args, u, m) for u, m in zip(urls, models)]
    rounds: list[list[Run]] = [[], []]
    for r in range(args.rounds):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            run = await serve.run_workload(targets[side], args, workloads[r], args.seed + r, args.max_concurrency,
                                           f"round {r + 1}/{args.rounds} {names[side]}")
            rounds[side].append(run)
    merged = [concat_runs(rounds[0]), concat_runs(rounds[1])]
    entries = []
    for side in (0, 1):
        summary = serve.run_summary(merged[side], args, max_concurrency=args.max_concurrency,
                                    round_durations_s=[x.duration_s for x in rounds[side]])
        entries.append({"label": names[side], "url": urls[side], "model": models[side], "summary": summary,
                        "requests": serve.request_records(merged[side])})
    doc = {"benchmark": "compare", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "api": args.api, "dataset": args.dataset, "args": serve.args_record(args), "endpoints": entries}
    title = f"{args.dataset}: {names[0]} ({urls[0]}) vs {names[1]} ({urls[1]}), {args.rounds} rounds"
    print(format_summaries([(e["label"], e["summary"]) for e in entries], ratio=True, title=title))
    for e in entries:
        for why, n in list(e["summary"]["errors"].items())[:5]:
            print(f"{e['label']}: failed x{n}: {why}")
    paths = serve.write_outputs(args.out, "compare", doc, list(zip(names, merged)), title)
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return doc


def run(args: argparse.Namespace) -> dict:
    """Run the comparison the arguments describe; returns the document written to ``compare.json``."""
    serve.check_arguments(args)
    return asyncio.run(_run(args))


def cli(args: argparse.Namespace) -> int:
    """Exit 2 with one ``error:`` line for bad input or an unreachable endpoint, 1 when an endpoint
    completed no request, else 0."""
    return run_cli(run, args, lambda doc: "an endpoint completed no request (reasons above and in compare.json)"
                   if any(e["summary"]["requests"]["completed"] == 0 for e in doc["endpoints"]) else None)


DESCRIPTION = ("Run the same workload against two OpenAI-compatible endpoints, interleaved by rounds "
               "(ABBA), and print their metrics side by side with ratios B/A.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deepinfer bench compare", description=DESCRIPTION)
    add_arguments(p)
    return cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
