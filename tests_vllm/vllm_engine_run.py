"""``VllmEngine`` (deepinfer.engine.vllm_engine) in its own process, for the tests: run requests step by step.

    python tests_vllm/vllm_engine_run.py --model DIR --requests JSON_FILE [--kv-root DIR] [--prefill-only]

``--requests``: a JSON list of ``{"id", "prompt", "output" (tokens already streamed), "max_tokens",
"abort_after_steps" (optional)}``; greedy. Prints one JSON line: ``{"chunks": {id: [[tokens, finish_reason,
num_cached_tokens], ...]}, "aborted": [ids], "unfinished": bool, "connector": {"blocks_loaded", "load_errors"}
(worker side; {} without --kv-root), "prefix_hit_tokens" (``load_fields``), "start_s": s}``.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--kv-root")
    ap.add_argument("--prefill-only", action="store_true")
    args = ap.parse_args()
    from deepinfer.engine.interface import EngineConfig
    from deepinfer.engine.vllm_engine import VllmEngine
    from deepinfer.protocol import SamplingParams

    t0 = time.monotonic()
    engine = VllmEngine(args.model, EngineConfig(block_size=128, max_model_len=1024, prefill_only=args.prefill_only),
                        args.kv_root)
    start_s = time.monotonic() - t0
    reqs = json.load(open(args.requests))
    for r in reqs:
        engine.add_request(r["id"], r["prompt"], SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                                                ignore_eos=True), output_token_ids=r["output"])
    chunks, aborted, steps = {r["id"]: [] for r in reqs}, [], 0
    while engine.has_unfinished():
        for out in engine.step():
            chunks[out.request_id].append([out.new_token_ids, out.finish_reason, out.num_cached_tokens])
        steps += 1
        for r in reqs:
            if r.get("abort_after_steps") == steps and engine.abort(r["id"]):
                aborted.append(r["id"])
    counters = {}
    if args.kv_root:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()
        counters = {"blocks_loaded": worker.blocks_loaded, "load_errors": worker.load_errors}
    print(json.dumps({"chunks": chunks, "aborted": aborted, "unfinished": engine.has_unfinished(),
                      "connector": counters, "prefix_hit_tokens": engine.load_fields()["prefix_hit_tokens"],
                      "start_s": round(start_s, 1)}), flush=True)


if __name__ == "__main__":
    main()
