"""Command-line options of engine workers (prefill, decode) -> ``EngineConfig``."""

from __future__ import annotations

import argparse
import os

from deepinfer.engine.llm_engine import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=int(os.environ.get("DEEPINFER_BLOCK_SIZE", 16)),
                   help="tokens per KV block (default 16)")
    p.add_argument("--kv-cache-gb", type=float, default=float(os.environ.get("DEEPINFER_KV_CACHE_GB", 1.0)),
                   help="memory for the KV cache in GiB (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="max sequences per step (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="max new tokens per step (default 4096)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--dtype", default=os.environ.get("DEEPINFER_DTYPE", "float32"),
                   choices=["float32", "bfloat16", "float16"])
    p.add_argument("--step-time-budget-ms", type=float,
                   default=float(os.environ.get("DEEPINFER_STEP_TIME_BUDGET_MS", 250)),
                   help="predicted compute per step that prefill chunks may fill, ms (default 250; 0 = no limit)")
    p.add_argument("--no-calibrate", action="store_true", help="skip timing forward passes at start-up")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching in the engine")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="schedule each step after the previous one instead of during it")
    p.add_argument("--batch-invariant", action="store_true",
                   help="greedy output independent of batch composition (slower attention)")
    p.add_argument("--no-packed-weights", action="store_true", help="do not pre-pack GEMM weights (MKL, fp32)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--kv-root", default=os.environ.get("DEEPINFER_KV_ROOT", os.path.expanduser("~/.cache/deepinfer/kvstore")),
                   help="storage tier root directory (shared across workers)")


def engine_config(args, prefill_only: bool) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        prefill_only=prefill_only,
        num_threads=args.threads,
        enable_prefix_caching=not args.no_prefix_caching,
        step_time_budget_s=args.step_time_budget_ms / 1000 if args.step_time_budget_ms > 0 else None,
        calibrate=not args.no_calibrate,
        async_scheduling=not args.no_async_scheduling,
        batch_invariant=args.batch_invariant,
        packed_weights=not args.no_packed_weights,
    )
