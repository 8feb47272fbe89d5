"""The longest prompt a request can have: context - 1 tokens, ``max_tokens`` 1, timed.

In one run: the engine in-process (``LLMEngine``, calibrated, the default step budget) and,
unless ``--engine-only``, a whole mesh started by the launcher (``Mesh``, the code of
``deepinfer up``) answering it through ``/v1/completions`` (token ids) with a fresh
``cache_salt`` each time, so every run computes the whole prompt. Prints seconds per run, the
engine's steps for it and its fitted cost model (``a`` per step, ``e`` per context token read).

    python benchmarks/bench_long_prompt.py [--dtype auto|float32|bfloat16] [--mode agg|disagg] [--runs 2]

(``--mode`` defaults to ``deepinfer up``'s mode.)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from deepinfer.cli import DEFAULT_MODE


def prompt_ids(model_dir: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(("word " * (n + 100)))["input_ids"][:n]


def engine_run(model_dir: str, ids: list[int], dtype: str) -> None:
    from deepinfer.engine.interface import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.protocol import SamplingParams

    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=(len(ids) // 1000 + 2) * (64 << 20), dtype=dtype,
                                               calibrate=True, step_time_budget_s=0.25))
    started, steps = time.monotonic(), 0
    engine.add_request("long", ids, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
        steps += 1
    cm = engine.cost_model
    print(f"engine ({engine.dtype_choice.dtype}): {len(ids)} tokens in {steps} steps, "
          f"{time.monotonic() - started:.1f} s; cost model a {cm.a:.3f} s, e*c at {len(ids)} {cm.e * len(ids):.3f} s",
          flush=True)


def mesh_runs(ids: list[int], dtype: str, mode: str, runs: int) -> None:
    import openai

    from deepinfer.launcher import Mesh
    from deepinfer.models.convert import DEFAULT_MODEL_NAME

    with tempfile.TemporaryDirectory() as work:
        m = Mesh(workdir=work, mode=mode, env={"DEEPINFER_DTYPE": dtype})
        m.start(timeout=300)
        try:
            client = openai.OpenAI(base_url=m.gateway_url + "/v1", api_key="bench", max_retries=0, timeout=600)
            for i in range(runs):
                started = time.monotonic()
                r = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=ids, max_tokens=1, temperature=0,
                                              extra_body={"cache_salt": f"long-{os.getpid()}-{i}"})
                print(f"mesh ({mode}, {dtype}) run {i}: {r.usage.prompt_tokens} prompt tokens, "
                      f"{r.usage.completion_tokens} out, {time.monotonic() - started:.1f} s", flush=True)
        finally:
            m.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--mode", default=DEFAULT_MODE, choices=["agg", "disagg"])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--engine-only", action="store_true")
    args = p.parse_args()
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.convert import ensure_default_model

    model_dir = str(ensure_default_model(progress=False))
    ids = prompt_ids(model_dir, ModelConfig.from_dir(model_dir).max_position_embeddings - 1)
    engine_run(model_dir, ids, args.dtype)
    if not args.engine_only:
        mesh_runs(ids, args.dtype, args.mode, args.runs)


if __name__ == "__main__":
    main()
