"""Forward time of verify-shaped decode steps: uniform vs mixed query lengths at equal tokens.

Speculative decoding's adaptive verification (docs/speculative_decoding.md) gives each request its own number of draft
tokens, so a verify step feeds queries of uneven lengths (1..γ+1 per sequence), where fixed-k
verification feeds every sequence k+1. The torch attention groups sequences by query length
(``libs/kernels/attention.py``), one SDPA call per group and layer, so uneven lengths cost more groups.
This script times the model forward of both shapes at the same total tokens, interleaved in rounds,
and prints them side by side with the ratio.

    python benchmarks/bench_verify_shapes.py [--batch 32] [--context 400] [--rounds 5]

Measured 2026-12-02 on the 2-core CPU (quiet), SmolLM2-135M, 32 sequences at context 400:
mixed / uniform = 1.05 at 64 tokens, 1.05 at 128, 1.06 at 192 (this script); an earlier draft
with other mixed draws gave 1.11, 1.13, 1.04.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sequence import Sequence
from deepinfer.models.convert import resolve_model
from deepinfer.protocol import SamplingParams


def mixed_lengths(rng: random.Random, batch: int, total: int, longest: int = 9) -> list[int]:
    """``batch`` query lengths in [1, longest] summing to ``total``, spread like adaptive verification's."""
    q = [rng.choice([1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9]) for _ in range(batch)]
    while sum(q) != total:
        j = rng.randrange(batch)
        if sum(q) < total and q[j] < longest:
            q[j] += 1
        elif sum(q) > total and q[j] > 1:
            q[j] -= 1
    return q


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--batch", type=int, default=32, help="sequences in the step (default 32)")
    p.add_argument("--context", type=int, default=400, help="tokens of context before the step (default 400)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds, 3 forwards each (default 5)")
    args = p.parse_args()

    engine = LLMEngine(str(resolve_model(args.model)), EngineConfig(calibrate=False, kv_cache_bytes=1 << 30))
    rng = random.Random(0)
    seqs = []
    for i in range(args.batch):
        prompt = [rng.randrange(1000, 20000) for _ in range(args.context + 1)]
        seq = Sequence(f"s{i}", prompt, len(prompt), SamplingParams(max_tokens=1))
        engine.block_manager.allocate(seq, args.context + 9)
        seqs.append(seq)

    def forward_s(qlens: list[int]) -> float:
        """Median CPU seconds (this thread) of 3 forwards feeding ``qlens[i]`` queries to sequence i."""
        for seq, q in zip(seqs, qlens):
            seq.num_computed_tokens, seq.num_scheduled_tokens = args.context, q
            seq.draft_token_ids = [7] * (q - 1)
        times = []
        for _ in range(3):
            t = time.thread_time()
            engine.runner.run(seqs)
            times.append(time.thread_time() - t)
        return statistics.median(times)

    shapes = {}
    for per_seq in (2, 4, 6):
        total = per_seq * args.batch
        shapes[total] = ([per_seq] * args.batch, mixed_lengths(rng, args.batch, total))
    for uniform, mixed in shapes.values():  # warm-up
        forward_s(uniform), forward_s(mixed)
    results = {total: ([], []) for total in shapes}
    for _ in range(args.rounds):
        for total, (uniform, mixed) in shapes.items():
            results[total][0].append(forward_s(uniform))
            results[total][1].append(forward_s(mixed))
    print(f"{args.batch} sequences at context {args.context}; forward CPU ms (median of {args.rounds} rounds)")
    print(f"{'tokens':>7} {'uniform':>9} {'mixed':>9} {'groups':>7} {'mixed/uniform':>14}")
    for total, (u, m) in results.items():
        u_ms, m_ms = statistics.median(u) * 1000, statistics.median(m) * 1000
        print(f"{total:>7} {u_ms:>9.1f} {m_ms:>9.1f} {len(set(shapes[total][1])):>7} {m_ms / u_ms:>14.2f}")


if __name__ == "__main__":
    main()
