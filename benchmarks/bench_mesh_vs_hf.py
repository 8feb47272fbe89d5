"""Throughput through the whole mesh vs ``transformers.generate`` on the same prompts.

Starts a mesh (tokenizer, prefill, decode, gateway) with the embedded model,
sends streaming chat requests with the official ``openai`` client at 1 and 8
concurrent requests (greedy, ``ignore_eos``, fixed output length), then runs
``transformers.generate`` on the same prompt token ids at batch 1 and 8, and
prints output tokens/s, TTFT and ITL side by side with ratios.

    python benchmarks/bench_mesh_vs_hf.py [--max-tokens 64] [--concurrency 1 8]

Output tokens/s = total output tokens / wall time of the batch of requests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from prompts import PROMPTS  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


async def run_mesh(url: str, model: str, concurrency: int, max_tokens: int):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]

    async def one(p):
        t0 = time.perf_counter()
        times, n = [], 0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
            if chunk.usage:
                n = chunk.usage.completion_tokens
        return t0, times, n

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    tokens = sum(n for *_, n in results)
    ttft = [times[0] - start for start, times, _ in results if times]
    itl = [b - a for _, times, _ in results for a, b in zip(times, times[1:])]
    return {"tok_s": tokens / wall, "ttft_ms": 1000 * statistics.median(ttft),
            "itl_ms": 1000 * statistics.median(itl) if itl else float("nan"), "tokens": tokens, "wall_s": wall}


def run_hf(model_dir, batch: int, max_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                     add_generation_prompt=True, tokenize=False) for i in range(batch)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        wall = time.perf_counter() - t0
    tokens = (out.shape[1] - enc["input_ids"].shape[1]) * batch
    return {"tok_s": tokens / wall, "ttft_ms": float("nan"), "itl_ms": float("nan"), "tokens": tokens, "wall_s": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--url", default=None, help="use a running gateway instead of starting a mesh")
    args = ap.parse_args()

    from deepinfer.launcher import Mesh
    from deepinfer.models.convert import ensure_default_model

    model_dir = ensure_default_model()
    rows = []
    mesh = None
    try:
        if args.url is None:
            mesh = Mesh()
            mesh.start()
            url = mesh.gateway_url
        else:
            url = args.url
        import httpx

        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(run_mesh(url, model, 1, 4))  # warm-up
        for c in args.concurrency:
            rows.append(("mesh", c, asyncio.run(run_mesh(url, model, c, args.max_tokens))))
    finally:
        if mesh is not None:
            mesh.stop()
    for c in args.concurrency:
        rows.append(("transformers", c, run_hf(model_dir, c, args.max_tokens)))

    print(f"\nSmolLM2-135M-Instruct fp32, greedy, {args.max_tokens} output tokens per request, streaming\n")
    print(f"{'engine':<14}{'concurrency':>12}{'out tok/s':>11}{'TTFT p50 ms':>13}{'ITL p50 ms':>12}{'wall s':>9}")
    for name, c, r in rows:
        print(f"{name:<14}{c:>12}{r['tok_s']:>11.1f}{r['ttft_ms']:>13.0f}{r['itl_ms']:>12.1f}{r['wall_s']:>9.1f}")
    print()
    for c in args.concurrency:
        m = next(r for n, cc, r in rows if n == "mesh" and cc == c)
        h = next(r for n, cc, r in rows if n == "transformers" and cc == c)
        print(f"concurrency {c}: mesh / transformers throughput = {m['tok_s'] / h['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
