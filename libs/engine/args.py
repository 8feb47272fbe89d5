"""Command-line options of engine workers (prefill, decode) -> ``EngineConfig`` (+ ``MockConfig``) and
the engine they name (``build_engine``)."""

from __future__ import annotations

import argparse
import os

from deepinfer.engine.interface import Engine, EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.mock import DEFAULT_COST, MockConfig, MockEngine, load_cost_file, parse_cost
from deepinfer.engine.spec_decode import SpecConfig


def _positive(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return n


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=int(os.environ.get("DEEPINFER_BLOCK_SIZE", 16)),
                   help="tokens per KV block (default 16)")
    p.add_argument("--kv-cache-gb", type=float, default=float(os.environ.get("DEEPINFER_KV_CACHE_GB", 1.0)),
                   help="memory for the KV cache in GiB (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="max sequences per step (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="max new tokens per step (default 4096)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--dtype", default=os.environ.get("DEEPINFER_DTYPE", "auto"),
                   choices=["auto", "float32", "bfloat16", "bfloat16-weights", "float16"],
                   help="weights and KV cache: auto = bf16 where this CPU's bf16 GEMMs beat fp32 on the model's "
                        "shapes, else bfloat16-weights (weights rounded to bf16, fp32 activations and KV; "
                        "decode steps read bf16 weights) where that times faster, else fp32 (timed at start-up, "
                        "logged) (env DEEPINFER_DTYPE; default auto)")
    p.add_argument("--step-time-budget-ms", type=float,
                   default=float(os.environ.get("DEEPINFER_STEP_TIME_BUDGET_MS", 250)),
                   help="predicted compute per step that prefill chunks may fill, ms (default 250; 0 = no limit)")
    p.add_argument("--no-calibrate", action="store_true", help="skip timing forward passes at start-up")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching in the engine")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="schedule each step after the previous one instead of during it")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's bits (logprobs, seeded samples) independent of the batch, the prefix cache "
                        "and chunking, at one thread count (slower attention)")
    p.add_argument("--no-packed-weights", action="store_true", help="do not pre-pack GEMM weights (MKL, fp32)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--single-thread-max-tokens", type=int, default=None,
                   help="steps feeding at most this many tokens run on one thread, larger ones on --threads "
                        "(0 = every step on all; default: timed at start-up on dummy steps, logged)")
    p.add_argument("--swa-replay", choices=["bounded", "exact"],
                   default=os.environ.get("DEEPINFER_SWA_REPLAY", "bounded"),
                   help="hybrid sliding-window models, a cached prefix whose window state is gone: bounded = replay "
                        "its last W tokens (W token-forwards, approximate), exact = recompute it; a request's "
                        "swa_replay overrides it (env DEEPINFER_SWA_REPLAY; default bounded)")
    p.add_argument("--swa-cache-gb", type=float, default=float(os.environ.get("DEEPINFER_SWA_CACHE_GB", 0.25)),
                   help="host memory for the SWA state cache: window layers' KV of recent prefixes, GiB "
                        "(hybrid sliding-window models; 0 = none; default 0.25)")
    p.add_argument("--speculative", choices=["none", "ngram", "draft"],
                   default=os.environ.get("DEEPINFER_SPECULATIVE", "none"),
                   help="decode workers: speculative decoding with prompt-lookup (ngram) or self-draft (draft: the "
                        "model's first --draft-layers layers) drafts (env DEEPINFER_SPECULATIVE; default none)")
    p.add_argument("--num-speculative-tokens", type=_positive, default=5,
                   help="most draft tokens per request per step (γ, default 5)")
    p.add_argument("--spec-verify", choices=["adaptive", "fixed"], default="adaptive",
                   help="verification length: adaptive (DSpark Algorithm 1 priced by the step cost model) or "
                        "fixed (every draft up to γ); default adaptive")
    p.add_argument("--draft-layers", type=_positive, default=None,
                   help="layers of the self-draft (default: a quarter of the model's)")
    p.add_argument("--engine", choices=["native", "mock", "vllm"], default=os.environ.get("DEEPINFER_ENGINE", "native"),
                   help="native: the model; mock: no model, steps sleep by a timing model, deterministic "
                        "tokens (engine/mock.py); vllm: vLLM's engine in-process, KV through the storage tier "
                        "(needs deepinfer[vllm] and --block-size a multiple of 32; docs/vllm_backend.md) "
                        "(env DEEPINFER_ENGINE; default native)")
    p.add_argument("--mock-cost", default=None, metavar="A,B,D,E",
                   help="mock timing model: s/step, s/token, s/token pair, s/key gathered "
                        "(default: fitted on SmolLM2-135M, 2-core CPU)")
    p.add_argument("--mock-cost-file", default=None,
                   help='mock timing model from JSON {"a", "b", "d", "e"} '
                        "(write one with: python -m deepinfer.engine.mock fit --out FILE)")
    p.add_argument("--mock-eos-rate", type=float, default=0.0,
                   help="fraction of mock tokens that are EOS (default 0: never)")
    p.add_argument("--kernels", choices=["auto", "torch", "triton"],
                   default=os.environ.get("DEEPINFER_KERNELS", "auto"),
                   help="auto: Triton kernels where the model is on CUDA, else the torch reference; torch; triton "
                        "(on a CPU only with TRITON_INTERPRET=1: tests) (env DEEPINFER_KERNELS; default auto)")
    p.add_argument("--heartbeat-s", type=float, default=float(os.environ.get("DEEPINFER_HEARTBEAT_S", 1.0)),
                   help="seconds between load reports (env DEEPINFER_HEARTBEAT_S; default 1)")
    p.add_argument("--kv-root", default=os.environ.get("DEEPINFER_KV_ROOT", os.path.expanduser("~/.cache/deepinfer/kvstore")),
                   help="storage tier root directory (shared across workers)")


def mock_config(args) -> MockConfig | None:
    """The mock engine's options, or None for the native engine."""
    if args.engine != "mock":
        return None
    cost = DEFAULT_COST
    if args.mock_cost_file:
        cost = load_cost_file(args.mock_cost_file)
    if args.mock_cost:
        cost = parse_cost(args.mock_cost)
    return MockConfig(cost=cost, eos_rate=args.mock_eos_rate)


def engine_config(args, prefill_only: bool) -> EngineConfig:
    # NOTE: a mock worker needs no intra-op threads; one each keeps dozens of them light.
    threads = args.threads or (1 if getattr(args, "engine", "native") == "mock" else None)
    return EngineConfig(
        block_size=args.block_size,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        prefill_only=prefill_only,
        num_threads=threads,
        enable_prefix_caching=not args.no_prefix_caching,
        step_time_budget_s=args.step_time_budget_ms / 1000 if args.step_time_budget_ms > 0 else None,
        calibrate=not args.no_calibrate,
        async_scheduling=not args.no_async_scheduling,
        batch_invariant=args.batch_invariant,
        packed_weights=not args.no_packed_weights,
        swa_replay=args.swa_replay,
        swa_cache_bytes=int(args.swa_cache_gb * (1 << 30)),
        kernels=getattr(args, "kernels", None),
        single_thread_max_tokens=getattr(args, "single_thread_max_tokens", None),
        speculative=None if prefill_only or args.speculative == "none" else SpecConfig(
            args.speculative, args.num_speculative_tokens, args.spec_verify, draft_layers=args.draft_layers),
    )


def refusals(backend: str, config: EngineConfig, model_dir: str) -> list[str]:
    """Why ``backend`` (``--engine``) cannot run ``config`` (every reason; [] when it can): mesh
    features vLLM lacks are refused at start-up, never ignored (``vllm_engine.unsupported``)."""
    if backend != "vllm":
        return []
    from deepinfer.engine.vllm_engine import unsupported  # vllm is an optional extra (deepinfer[vllm])

    return unsupported(config, model_dir)


def build_engine(backend: str, model_dir: str, config: EngineConfig, kv_root: str | None = None,
                 mock: MockConfig | None = None) -> Engine:
    """The engine ``backend`` (``--engine``) names: ``LLMEngine`` ("native"), ``MockEngine`` ("mock", or
    any backend given a ``mock`` config) or ``VllmEngine`` ("vllm", its KV connector rooted at
    ``kv_root``). Raises what their constructors raise (ValueError, ``vllm_engine.UnsupportedOnVllm``)."""
    if mock is not None or backend == "mock":
        return MockEngine(model_dir, config, mock)
    if backend == "vllm":
        from deepinfer.engine.vllm_engine import VllmEngine  # vllm is an optional extra (deepinfer[vllm])

        return VllmEngine(model_dir, config, kv_root)
    return LLMEngine(model_dir, config)
