"""What the mesh costs over the bare engine, on the same prompts, in one run.

    .venv/bin/python benchmarks/bench_mesh_overhead.py [--num-prompts 32] [--concurrency 16]
        [--input-len 150] [--output-len 128] [--mode disagg|agg] [--out bench_results/mesh_overhead]

1. ``engine``: an ``LLMEngine`` in this process, built from a worker's own command-line defaults
   (``engine.args``: ``--dtype auto`` and the rest, as ``deepinfer serve decode`` gets them), fed
   the prompts' chat-templated token ids with at most ``--concurrency`` requests in it at once
   (a new one added as one finishes), greedy, ``ignore_eos``;
2. ``mesh``: the mesh ``deepinfer up`` starts (``--mode``, default: ``cli.DEFAULT_MODE``) on a
   fresh workdir, driven by ``deepinfer bench serve`` (streaming chat) with the same prompts
   (``bench.datasets.random_sessions``: the same seed gives the same texts) and concurrency.

Prints output tokens/s of each and the ratio mesh / engine (1.0: the gateway, the tokenizer, NATS,
the storage-tier handoff and SSE cost nothing), plus the engine's and the client's ITL p50. The two
never run at the same time; this process sets ``OMP_WAIT_POLICY=PASSIVE`` as the launcher does for
every worker. ``--mode disagg`` runs a prefill and a decode engine side by side, so it can beat the
one bare engine; ``--mode agg`` (one engine) is the like-for-like comparison. About 5 minutes on 2
cores with the defaults. On a shared VM the figures move from run to run: run it more than once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# as the launcher gives every worker, before torch loads OpenMP: spinning threads cost more than
# they save when other processes share the cores, and the engine here must run as a worker does
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from deepinfer.bench.datasets import random_sessions  # noqa: E402
from deepinfer.cli import DEFAULT_MODE  # noqa: E402
from deepinfer.engine.args import add_engine_args, engine_config  # noqa: E402
from deepinfer.engine.llm_engine import LLMEngine  # noqa: E402
from deepinfer.engine_worker.base import service_parser  # noqa: E402
from deepinfer.launcher import Mesh  # noqa: E402
from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model  # noqa: E402
from deepinfer.protocol import SamplingParams  # noqa: E402

SEED = 100


def texts(args) -> list[str]:
    return [s.turns[0].user for s in random_sessions(args.num_prompts, args.input_len, args.output_len, seed=SEED)]


def run_engine(args, model_dir: Path) -> dict:
    """Output tokens/s of the bare engine with ``--concurrency`` requests in flight, and its ITL p50 (s)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for t in texts(args)]
    p = service_parser("decode", "bench")
    add_engine_args(p)
    engine = LLMEngine(model_dir, engine_config(p.parse_args([]), prefill_only=False))
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    waiting, running, out, last, itls = list(enumerate(prompts)), 0, 0, {}, []
    t0 = time.perf_counter()
    while waiting or engine.has_unfinished():
        while waiting and running < args.concurrency:
            i, ids = waiting.pop(0)
            engine.add_request(str(i), ids, sp)
            running += 1
        for o in (engine.step_async() if engine.config.async_scheduling else engine.step()):  # as a worker steps
            now = time.perf_counter()
            if o.new_token_ids and o.request_id in last:
                itls.append(now - last[o.request_id])
            last[o.request_id] = now
            out += len(o.new_token_ids)
            if o.finish_reason is not None:
                running -= 1
    took = time.perf_counter() - t0
    return {"output_throughput": out / took, "itl_p50_s": statistics.median(itls), "seconds": took,
            "dtype": engine.config.dtype, "output_tokens": out}


def run_mesh(args, out: Path) -> dict:
    """``bench serve`` on a fresh mesh of ``--mode``: output tokens/s and the client's ITL p50 (s)."""
    with tempfile.TemporaryDirectory(prefix="mesh-overhead-") as work:
        mesh = Mesh(workdir=Path(work), mode=args.mode)
        try:
            mesh.start(timeout=900)
            out.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "deepinfer.cli", "bench", "serve", "--url", mesh.gateway_url,
                   "--model", DEFAULT_MODEL_NAME, "--api", "chat", "--temperature", "0", "--ignore-eos",
                   "--dataset", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
                   "--seed", str(SEED), "--out", str(out), "--no-progress"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        finally:
            mesh.stop()
    s = json.loads((out / "serve.json").read_text())["runs"][0]["summary"]
    return {"output_throughput": s["output_throughput"], "itl_p50_s": s["itl_s"]["median"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=150)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--mode", choices=["agg", "disagg"], default=DEFAULT_MODE)
    ap.add_argument("--out", default="bench_results/mesh_overhead")
    args = ap.parse_args()
    model_dir = ensure_default_model(progress=False)
    engine = run_engine(args, model_dir)
    print(f"engine: {engine['output_throughput']:.1f} tok/s, ITL p50 {engine['itl_p50_s'] * 1000:.1f} ms "
          f"({engine['output_tokens']} tokens in {engine['seconds']:.1f} s, dtype {engine['dtype']})", flush=True)
    mesh = run_mesh(args, Path(args.out))
    print(f"mesh ({args.mode}): {mesh['output_throughput']:.1f} tok/s, ITL p50 {mesh['itl_p50_s'] * 1000:.1f} ms")
    print(f"\n| {args.num_prompts} chats of {args.input_len} tokens, {args.output_len} out, c={args.concurrency} "
          f"| engine | mesh ({args.mode}) | mesh/engine |\n|---|---|---|---|\n"
          f"| output tok/s | {engine['output_throughput']:.1f} | {mesh['output_throughput']:.1f} | "
          f"{mesh['output_throughput'] / engine['output_throughput']:.2f} |\n"
          f"| ITL p50 (ms) | {engine['itl_p50_s'] * 1000:.1f} | {mesh['itl_p50_s'] * 1000:.1f} | "
          f"{mesh['itl_p50_s'] / engine['itl_p50_s']:.2f} |")


if __name__ == "__main__":
    main()
