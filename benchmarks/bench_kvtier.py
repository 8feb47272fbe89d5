"""Prefix reuse through the storage tier: TTFT cold vs warm, and KV load throughput.

In one run (SmolLM2-135M-Instruct, fp32, block size 16, a fresh temporary
storage root):

1. A prefill engine computes a long prompt (``--prompt-tokens``, default 3000)
   and its full KV blocks are written to the tier, as the prefill worker does.
2. For 0%, 50%, 90% and 99% of that prompt shared with a new prompt (the rest
   differs): TTFT of the new prompt cold (an engine with an empty cache
   computes it all) vs warm (another engine with an empty cache reads the
   shared blocks from the tier, ``load_prefix`` puts them in its prefix cache,
   then it computes the rest). Warm TTFT includes the reads.
3. Load throughput: bytes/s of reading the stored blocks with the tier's
   verified read (header + XXH3-64 checksum, straight into a tensor), one thread
   and two threads, vs a plain ``read()`` of the same files (both from the
   page cache: this measures the tier's overhead, not the disk).

    python benchmarks/bench_kvtier.py [--prompt-tokens 3000]

Targets: warm TTFT at 90% cached <= 0.15x cold; load throughput
>= 50% of the plain read.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch

from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.kvstore import AsyncBlockStore, BlockStore, block_hashes
from deepinfer.models.convert import ensure_default_model
from deepinfer.protocol import SamplingParams

BS = 16
SP = SamplingParams(temperature=0.0, max_tokens=2)  # 1 would finish with "length" instead of a handoff


def new_engine(model_dir) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(kv_cache_bytes=1 << 30, prefill_only=True, max_num_batched_tokens=8192,
                                             async_scheduling=False))


def ttft(engine: LLMEngine, ids: list[int]) -> tuple[float, object]:
    t0 = time.perf_counter()
    engine.add_request(str(time.perf_counter_ns()), ids, SP)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return time.perf_counter() - t0, outs[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3, help="load-throughput repeats (median)")
    args = ap.parse_args()
    model_dir = ensure_default_model()
    g = torch.Generator().manual_seed(0)
    base = torch.randint(100, 40000, (args.prompt_tokens,), generator=g).tolist()
    root = tempfile.mkdtemp(prefix="deepinfer-bench-kvtier-")

    engine = new_engine(model_dir)
    ttft(engine, [1, 2, 3, 4] * 20)  # warm-up
    cold_base, out = ttft(engine, base)
    store = BlockStore(root, engine.fingerprint)
    hashes = block_hashes(base, BS, engine.fingerprint)
    t0 = time.perf_counter()
    for i, h in enumerate(hashes):
        store.put(h, out.kv_blocks[i], "chat", num_tokens=BS)
    write_s = time.perf_counter() - t0
    block_bytes = out.kv_blocks[0].numel() * out.kv_blocks.element_size()
    print(f"prompt {len(base)} tokens: cold TTFT {cold_base * 1e3:.0f} ms; wrote {len(hashes)} blocks "
          f"of {block_bytes / 1024:.0f} KiB in {write_s * 1e3:.0f} ms")

    print(f"\n{'cached':>7}{'hit tokens':>12}{'cold TTFT ms':>14}{'warm TTFT ms':>14}{'read+load ms':>14}{'warm/cold':>11}")
    shape = out.kv_blocks.shape[1:]
    for frac in (0.0, 0.5, 0.9, 0.99):
        shared = int(len(base) * frac)
        ids = base[:shared] + torch.randint(100, 40000, (len(base) - shared,), generator=g).tolist()
        cold, _ = ttft(new_engine(model_dir), ids)
        warm_engine = new_engine(model_dir)
        ttft(warm_engine, [5, 6, 7, 8] * 20)  # same warm-up as the cold engine had
        t0 = time.perf_counter()
        keys = block_hashes(ids, BS, engine.fingerprint)[: (len(ids) - 1) // BS]
        staging = torch.empty(len(keys), *shape)
        got = store.read_prefix_into(keys, "chat", staging)
        warm_engine.load_prefix(keys[:got], staging[:got])
        load_s = time.perf_counter() - t0
        warm_rest, o = ttft(warm_engine, ids)
        warm = load_s + warm_rest
        print(f"{frac:>7.0%}{o.num_cached_tokens:>12}{cold * 1e3:>14.0f}{warm * 1e3:>14.0f}{load_s * 1e3:>14.1f}"
              f"{warm / cold:>11.2f}")

    # load throughput: verified reads vs plain reads of the same files
    paths = [store.path(h, "chat") for h in hashes]
    total = sum(p.stat().st_size for p in paths)
    staging = torch.empty(len(hashes), *shape)

    def plain():
        for p in paths:
            with open(p, "rb") as f:
                f.read()

    async def two_threads():
        astore = AsyncBlockStore(store, io_threads=2)
        try:
            return await astore.read_prefix_into(hashes, "chat", staging)
        finally:
            astore.close()

    def timed(fn):
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    t_plain = timed(plain)
    t_one = timed(lambda: store.read_prefix_into(hashes, "chat", staging))
    t_two = timed(lambda: asyncio.run(two_threads()))
    assert store.read_prefix_into(hashes, "chat", staging) == len(hashes)
    gbs = lambda t: total / t / 1e9  # noqa: E731
    print(f"\nload {len(hashes)} blocks, {total / 1e6:.0f} MB (page cache):")
    print(f"  plain read()                    {gbs(t_plain):6.2f} GB/s")
    print(f"  tier read, verified, 1 thread   {gbs(t_one):6.2f} GB/s  ({t_plain / t_one:.0%} of plain)")
    print(f"  tier read, verified, 2 threads  {gbs(t_two):6.2f} GB/s  ({t_plain / t_two:.0%} of plain)")


if __name__ == "__main__":
    main()
