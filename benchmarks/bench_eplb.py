"""Expert load balancing: max/mean tokens per EP rank before and after EPLB, in one run.

A tiny random Qwen3-MoE checkpoint (``--experts`` experts, top-``--top-k``,
``--layers`` MoE layers) runs in the real engine with its experts split over
``--ranks`` EP ranks (ranks are partitions of this process's expert slots: the
per-rank token counts are the engine's own counters, with a replicated expert's
tokens spread round-robin; the parallelism is simulated). The workload favours
a few experts: prompts draw their tokens from a Zipf(``--zipf``) distribution
over a shuffled vocabulary, so a few tokens, and the experts they route to,
dominate.

  1. Planning window: ``--prompts`` requests under the identity placement (slot e =
     expert e); its counters go to the balancer's tracker as an ``ExpertStats``
     report, and one tick yields the EPLB placement (``--redundant`` extra slots),
     for the global policy and for the hierarchical one (``--groups`` over
     ``--nodes``).
  2. Each placement is applied between steps (slots copied, time) and measured on
     (a) the planning window's requests again (the stationary traffic EPLB
     assumes: the average predicts the next window) and (b) a fresh window from
     the same distribution (held out: the average's prediction error at this
     window size shows). Before = the same requests under the identity placement.
  3. Memory: the experts' bytes and the extra bytes of the replicas.
  4. The algorithm alone at DeepSeek-V3 scale (58 layers, 256 experts, 288 slots,
     8 groups, 4 nodes, 32 ranks): milliseconds per placement.

max/mean per EP rank is computed per MoE layer (each layer is a synchronisation
point) and averaged over layers; the worst layer is shown too.

    python benchmarks/bench_eplb.py [--experts 64] [--ranks 8] [--redundant 16] [--prompts 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.balancer.eplb import keep_slots, rebalance_experts
from deepinfer.balancer.tracker import BalancerConfig, ExpertLoad
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.models.expert_placement import ExpertPlacement
from deepinfer.protocol import ExpertStats, SamplingParams

VOCAB = 2048


def build_model(path: Path, args) -> None:
    """A random Qwen3-MoE checkpoint (transformers' initialisation, norms with noise), saved as safetensors."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=1024, initializer_range=0.1, num_experts=args.experts,
                         num_experts_per_tok=args.top_k, norm_topk_prob=True, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)


def window(seed: int, args) -> list[list[int]]:
    """``--prompts`` prompts of ``--prompt-len`` tokens, Zipf-distributed over a shuffled vocabulary."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64) ** args.zipf
    vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(12345))
    return [vocab[torch.multinomial(weights, args.prompt_len, replacement=True, generator=g)].tolist()
            for _ in range(args.prompts)]


def run(engine: LLMEngine, prompts: list[list[int]], args) -> tuple[torch.Tensor, torch.Tensor, list, float]:
    """Serve the prompts (greedy); (expert counts [L, E], rank counts [L, P], tokens, seconds)."""
    engine.model.reset_expert_counts()
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    out = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    seconds = time.perf_counter() - t0
    counts, ranks = engine.model.take_expert_counts()
    return counts, ranks, [out[str(i)] for i in range(len(prompts))], seconds


def ratio(ranks: torch.Tensor) -> tuple[float, float]:
    """(mean over layers, worst layer) of max/mean tokens per EP rank."""
    r = ranks.double()
    per_layer = r.max(1).values / r.mean(1)
    return float(per_layer.mean()), float(per_layer.max())


def plan(counts: torch.Tensor, args, groups: int, nodes: int) -> tuple[ExpertPlacement, ExpertLoad]:
    """One report into the balancer's tracker, one tick: the placement it would publish."""
    cfg = BalancerConfig(redundant_experts=args.redundant, num_groups=groups, num_nodes=nodes, num_ranks=args.ranks,
                         period_s=1, threshold=0, min_interval_s=0, min_tokens=0)
    num_layers, num_experts = counts.shape
    tracker = ExpertLoad("bench", num_layers, num_experts, cfg,
                         ExpertPlacement.identity(num_layers, num_experts, args.ranks), now=0.0)
    identity_ranks = counts.view(num_layers, args.ranks, -1).sum(2)
    tracker.add(ExpertStats(model="bench", worker_id="w", role="decode", counts=counts.tolist(),
                            rank_counts=identity_ranks.tolist(), num_ranks=args.ranks, num_slots=num_experts))
    placement = tracker.tick(2.0)
    if placement is None:
        raise SystemExit("the tracker found no better placement (is the workload skewed?)")
    return placement, tracker


def algorithm_ms(repeats: int = 3) -> list[tuple[str, float, float]]:
    """Milliseconds per placement at DeepSeek-V3 scale (hierarchical, global) and for keep_slots."""
    g = torch.Generator().manual_seed(0)
    loads = 1e5 / (torch.stack([torch.randperm(256, generator=g) for _ in range(58)]) + 1).double() ** 1.1
    out = []
    for name, groups, nodes in (("hierarchical (8 groups, 4 nodes)", 8, 4), ("global (8 groups, 3 nodes)", 8, 3)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            phy2log, _, _ = rebalance_experts(loads, 288, groups, nodes, 32)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        keep_slots(rebalance_experts(loads.flip(1), 288, groups, nodes, 32)[0], phy2log, 32,
                   nodes if 8 % nodes == 0 else 1)
        out.append((name, min(times) * 1e3, (time.perf_counter() - t0) * 1e3))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--redundant", type=int, default=16, help="replica slots beyond one per expert")
    p.add_argument("--groups", type=int, default=8, help="expert groups for the hierarchical policy")
    p.add_argument("--nodes", type=int, default=2, help="nodes for the hierarchical policy")
    p.add_argument("--prompts", type=int, default=64, help="requests per window")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.1, help="exponent of the token distribution (skew)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-eplb-") as tmp:
        build_model(Path(tmp), args)
        engine = LLMEngine(tmp, EngineConfig(block_size=16, kv_cache_bytes=256 << 20, enable_prefix_caching=False))
        model = engine.model
        num_layers = len(model.moe_blocks())
        model.apply_expert_placement(ExpertPlacement.identity(num_layers, args.experts, args.ranks))
        planning, fresh = window(1, args), window(2, args)
        counts, before_same, tokens_same, _ = run(engine, planning, args)
        _, before_fresh, tokens_fresh, _ = run(engine, fresh, args)
        pairs = int(counts[0].sum())
        top = float((counts.max(1).values / counts.sum(1)).mean())
        print(f"model: Qwen3-MoE (random), {num_layers} MoE layers x {args.experts} experts, top-{args.top_k}; "
              f"{args.ranks} EP ranks, {args.experts + args.redundant} slots ({args.redundant} redundant)")
        print(f"window: {args.prompts} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, "
              f"Zipf {args.zipf}: {pairs} (token, expert) pairs per layer; the busiest expert takes "
              f"{top:.1%} of a layer's pairs (uniform: {1 / args.experts:.1%})\n")
        header = (f"{'policy':<34}{'traffic':<22}{'before mean':>12}{'worst':>8}{'after mean':>12}{'worst':>8}"
                  f"{'tokens same':>13}")
        print(header)
        print("-" * len(header))
        rows = []
        for name, groups, nodes in (("global", 1, 1), (f"hierarchical ({args.groups} groups, {args.nodes} nodes)",
                                                       args.groups, args.nodes)):
            placement, tracker = plan(counts, args, groups, nodes)
            t0 = time.perf_counter()
            copied = engine.between_steps(model.apply_expert_placement, placement)
            apply_ms = (time.perf_counter() - t0) * 1e3
            _, after_same, same_tokens, _ = run(engine, planning, args)
            _, after_fresh, fresh_tokens, _ = run(engine, fresh, args)
            for traffic, before, after, ok in (
                    ("same (stationary)", before_same, after_same, same_tokens == tokens_same),
                    ("fresh (held out)", before_fresh, after_fresh, fresh_tokens == tokens_fresh)):
                b, a = ratio(before), ratio(after)
                print(f"{name:<34}{traffic:<22}{b[0]:>12.3f}{b[1]:>8.3f}{a[0]:>12.3f}{a[1]:>8.3f}{str(ok):>13}")
            rows.append((name, tracker.imbalance_before, tracker.predicted_imbalance(), copied, apply_ms))
            model.apply_expert_placement(ExpertPlacement.identity(num_layers, args.experts, args.ranks))
        print()
        for name, pred_before, pred_after, copied, apply_ms in rows:
            print(f"{name}: the balancer predicted {pred_before:.3f} -> {pred_after:.3f}; applied in {apply_ms:.0f} ms "
                  f"({copied} of {num_layers * (args.experts + args.redundant)} slots copied, packed GEMM weights "
                  f"rebuilt)")

        model.apply_expert_placement(plan(counts, args, 1, 1)[0])
        expert_bytes, replica_bytes = model.expert_memory()
        weights = sum(t.numel() * t.element_size() for t in model.parameters())
        print(f"\nmemory: experts {expert_bytes / 2**20:.2f} MiB (weights + packed GEMM copies), replicas "
              f"+{replica_bytes / 2**20:.2f} MiB = +{replica_bytes / expert_bytes:.1%} of the experts, "
              f"{replica_bytes} bytes ({args.redundant} slots x {num_layers} layers x "
              f"{model.moe_blocks()[0].slot_bytes()} bytes); all parameters {weights / 2**20:.2f} MiB (unpacked)")

    print("\nalgorithm at DeepSeek-V3 scale (58 layers, 256 experts, 288 slots, 32 ranks):")
    for name, ms, keep in algorithm_ms():
        print(f"  {name}: {ms:.0f} ms per placement; keep_slots {keep:.0f} ms")


if __name__ == "__main__":
    main()
