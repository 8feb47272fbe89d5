"""Engine throughput and TTFT vs ``transformers.generate``, plus the chunk budget's cost model.

In one run, on the same prompts (SmolLM2-135M-Instruct, greedy, ``ignore_eos``,
fixed output length), for each ``--dtypes`` (default fp32 and ``auto``, the dtype
the engine chooses on this CPU: ``engine.dtype_choice``):

1. Our engine (in-process, no mesh) at 1, 16 and 64 concurrent requests:
   output tokens/s, TTFT (first token of each request, from when all were
   queued), and the mean gap between steps (time the forward thread waits
   between the end of one step's forward + sampling and the start of the next
   forward), once stepping synchronously (schedule, prepare inputs and apply
   outputs between forward passes) and once with async scheduling (step t+1
   scheduled and prepared while step t runs).
2. ``transformers.generate`` on the same prompts at the same batch sizes
   (left-padded batch), in the same dtype: output tokens/s.
3. The step cost model (``engine.cost_model``): coefficients after start-up
   calibration, then predicted vs measured step time on chunked prefills of a
   long prompt at a 500 ms budget (on this 2-core CPU a step's fixed cost is
   already ~100 ms, so smaller budgets leave only minimum chunks).

    python benchmarks/bench_engine.py [--max-tokens 64] [--batches 1 16 64] [--dtypes float32 auto] [--skip-hf]
"""

from __future__ import annotations

import argparse
import statistics
import time

from prompts import PROMPTS  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def prompt_ids(tok, n):
    return [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" (#{i})"}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(n)]


def run_engine(engine, prompts, max_tokens, overlapped):
    from deepinfer.protocol import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.step_gaps.clear()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    ttft, tokens = {}, 0
    while engine.has_unfinished():
        outs = engine.step_async() if overlapped else engine.step()
        now = time.perf_counter()
        for o in outs:
            tokens += len(o.new_token_ids)
            ttft.setdefault(o.request_id, now - t0)
    wall = time.perf_counter() - t0
    gaps = list(engine.step_gaps)
    return {"tok_s": tokens / wall, "ttft_ms": 1000 * statistics.median(ttft.values()),
            "gap_ms": 1000 * statistics.mean(gaps) if gaps else float("nan"), "wall_s": wall}


def run_hf(model, tok, prompts, max_tokens):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                       do_sample=False, pad_token_id=tok.pad_token_id)
        wall = time.perf_counter() - t0
    return {"tok_s": len(prompts) * max_tokens / wall, "wall_s": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "auto"],
                    help="engine dtypes (auto: what the engine chooses on this CPU; transformers runs the same)")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepinfer.engine.interface import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.models.convert import ensure_default_model
    from deepinfer.protocol import SamplingParams

    model_dir = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows, engine = [], None
    for dtype in args.dtypes:
        t0 = time.perf_counter()
        engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=2 << 30, calibrate=True, step_time_budget_s=None,
                                                   enable_prefix_caching=False, dtype=dtype))
        chosen = engine.config.dtype
        print(f"engine --dtype {dtype} -> {chosen} ({engine.dtype_choice.reason}); start-up incl. calibration: "
              f"{time.perf_counter() - t0:.1f} s")
        cm = engine.cost_model
        print(f"  cost model after calibration: a={cm.a * 1e3:.2f} ms, b={cm.b * 1e6:.1f} us/token, "
              f"d={cm.d * 1e9:.2f} ns/token-pair, e={cm.e * 1e6:.2f} us/key gathered")
        run_engine(engine, prompt_ids(tok, 2), 4, False)  # warm-up
        for b in args.batches:
            for overlapped in (False, True):
                name = f"deepinfer {'async' if overlapped else 'sync'} {chosen}"
                rows.append((name, b, run_engine(engine, prompt_ids(tok, b), args.max_tokens, overlapped)))
        if not args.skip_hf:
            # bfloat16-weights: transformers loaded in bf16 and run in fp32 (the same rounded weights)
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, chosen.removesuffix("-weights")))
            hf = (hf.float() if chosen == "bfloat16-weights" else hf).eval()
            for b in args.batches:
                rows.append((f"transformers {chosen}", b, run_hf(hf, tok, prompt_ids(tok, b), args.max_tokens)))
            del hf

    print(f"\nSmolLM2-135M-Instruct, greedy, {args.max_tokens} output tokens per request\n")
    print(f"{'engine':<28}{'batch':>6}{'out tok/s':>11}{'TTFT p50 ms':>13}{'step gap ms':>13}{'wall s':>9}")
    for name, b, r in rows:
        print(f"{name:<28}{b:>6}{r['tok_s']:>11.1f}{r.get('ttft_ms', float('nan')):>13.0f}"
              f"{r.get('gap_ms', float('nan')):>13.2f}{r['wall_s']:>9.1f}")
    print()
    dtypes = sorted({n.rsplit(" ", 1)[1] for n, _, _ in rows}, reverse=True)
    for b in args.batches:
        tput = {n: r["tok_s"] for n, bb, r in rows if bb == b}
        line = [f"batch {b:>3}:"]
        for d in dtypes:
            ours = tput.get(f"deepinfer async {d}")
            ref = tput.get(f"transformers {d}")
            if ours and ref:
                line.append(f"deepinfer/transformers {d} {ours / ref:.2f}x")
        if len(dtypes) > 1 and all(tput.get(f"deepinfer async {d}") for d in dtypes):
            line.append(f"deepinfer {dtypes[1]}/{dtypes[0]} {tput[f'deepinfer async {dtypes[1]}'] / tput[f'deepinfer async {dtypes[0]}']:.2f}x")
        print("  ".join(line))

    # predicted vs measured step time of budget-cut chunks
    cm = engine.cost_model  # (the last dtype's)
    chunked = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=1 << 30, step_time_budget_s=0.5,
                                                max_num_batched_tokens=8192, enable_prefix_caching=False,
                                                dtype=engine.config.dtype))
    chunked.cost_model = engine.cost_model
    chunked.scheduler.cost_model = engine.cost_model
    cm.errors.clear()
    chunked.add_request("long", list(range(1000, 4000)), SamplingParams(temperature=0, max_tokens=1))
    print("\nchunked prefill of a 3000-token prompt, 500 ms budget (model refits online as it goes):")
    print(f"{'step':>5}{'context':>9}{'chunk':>7}{'predicted ms':>14}{'measured ms':>13}")
    step = 0
    while chunked.has_unfinished():
        seq = chunked.scheduler.waiting[0] if chunked.scheduler.waiting else chunked.scheduler.running[0]
        c = seq.num_computed_tokens
        chunked.step()
        n = int(cm.samples[-1][0][1])  # tokens fed in that step
        pred, meas = cm.errors[-1]
        print(f"{step:>5}{c:>9}{n:>7}{pred * 1e3:>14.1f}{meas * 1e3:>13.1f}")
        step += 1
    print(f"mean |predicted - measured| over the run: {cm.mean_abs_error() * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
