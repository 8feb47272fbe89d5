"""SWA bounded replay on Gemma-3-270M: prefill compute and accuracy.

Scenario, per cached prefix length H (2k / 4k / 8k tokens, whole blocks): turn 1
of a conversation is a long document (H tokens of the repository's own docs in
Gemma's chat format); a worker computed it, so the storage tier holds its
blocks (full-attention layers only) and that worker's SWA state cache holds
its last window. Turn 2 = turn 1 + a question; it hits the H cached tokens.
Measured, each on its own engine, for turn 2:

* ``no cache``: a fresh engine computes the whole prompt (the cold run, the reference);
* ``exact``: the full layers' blocks are loaded from the tier, the window state is
  missing, ``swa_replay="exact"``: the prefix is recomputed for every layer;
* ``bounded``: the same, ``swa_replay="bounded"``: the prefix's last W = 512 tokens
  are replayed (window layers attend within the replayed span only);
* ``swa cache``: the worker that ran turn 1 (window pool evicted, full layers
  reloaded from the tier) restores the window state from its SWA state cache.

Prefill compute = tokens fed through the model until the first token
(token-forwards), and the wall and CPU time of those steps (the better of two
runs of each path). One torch thread by default: on this shared 2-core machine
two OpenMP threads slowed down ~10x whenever another process took a core,
while one thread's CPU time stays put (the load average is printed too). Accuracy against the cold
run over 64 greedy tokens: free-running agreement (positions equal, and the
length of the common prefix), and teacher-forced (the cold run's tokens fed):
top-1 agreement and the mean KL(cold || path) of the next-token distributions.
Storage: bytes per block with every layer vs the full layers only.

Run: ``.venv/bin/python benchmarks/bench_swa_replay.py`` (about 15 minutes on 2
CPU cores; ``--lengths 2048`` for a quick look).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import deepinfer.engine.engine_core as engine_core
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.kvstore import BlockStore, block_hashes
from deepinfer.models.convert import ensure_gemma3_270m
from deepinfer.models.loader import DTYPES
from deepinfer.protocol import SamplingParams

NEW_TOKENS = 64
REPO = Path(__file__).resolve().parent.parent
QUESTION = ("\n\nQuestion: what does the last section of this document describe, and which "
            "numbers does it report?<end_of_turn>\n<start_of_turn>model\n")


def document_tokens(tok, n: int) -> list[int]:
    """The first ``n`` tokens of turn 1: Gemma's user turn holding repository documents."""
    files = [REPO / "docs" / "architecture.md", REPO / "README.md", *sorted((REPO / "libs" / "engine").glob("*.py")),
             *sorted((REPO / "libs" / "kvstore").glob("*.py"))]
    text = "\n\n".join(f.read_text() for f in files)
    ids = tok("<start_of_turn>user\nRead this document.\n\n" + text).input_ids  # (adds <bos>)
    if len(ids) < n:
        raise SystemExit(f"only {len(ids)} document tokens, {n} wanted")
    return ids[:n]


class Recorder:
    """Wraps the engine's sampler: keeps each step's log-softmax (one request at a time) and,
    given ``forced`` tokens, feeds those instead of its own picks (teacher forcing)."""

    def __init__(self, forced: list[int] | None = None):
        self.forced = forced
        self.logps: list[torch.Tensor] = []

    def __call__(self, logits, seqs, generators, eos_token_ids=()):
        result = REAL_SAMPLE(logits, seqs, generators, eos_token_ids)
        if not seqs:  # a prefill chunk that samples nothing
            return result
        self.logps.append(torch.log_softmax(logits[0].float(), -1))
        if self.forced is not None:
            result.token_ids[0] = self.forced[len(self.logps) - 1]
        return result


REAL_SAMPLE = engine_core.sample


def generate(engine: LLMEngine, ids: list[int], mode: str | None, recorder: Recorder) -> dict:
    """Greedy ``NEW_TOKENS`` tokens; the prefill's token-forwards and wall time, the path, the tokens."""
    engine_core.sample = recorder
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, swa_replay=mode)
        before = engine.num_computed_tokens_total
        c0, t0 = time.process_time(), time.perf_counter()
        engine.add_request("r", ids, sp)
        tokens, first = [], None
        while engine.has_unfinished():
            for o in engine.step():
                if first is None:
                    first = o
                    prefill_s = time.perf_counter() - t0
                    prefill_cpu = time.process_time() - c0
                    forwards = engine.num_computed_tokens_total - before
                tokens += o.new_token_ids
    finally:
        engine_core.sample = REAL_SAMPLE
    return {"forwards": forwards, "seconds": prefill_s, "cpu": prefill_cpu, "path": first.prefix_path, "tokens": tokens,
            "replayed": first.num_replayed_tokens}


def kl(cold: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Mean over steps of KL(cold || other), nats."""
    return statistics.fmean(float((p.exp() * (p - q)).sum()) for p, q in zip(cold, other))


def agreement(cold: list[int], other: list[int]) -> tuple[int, int]:
    """(positions equal, common prefix length)."""
    same = sum(a == b for a, b in zip(cold, other))
    prefix = next((i for i, (a, b) in enumerate(zip(cold, other)) if a != b), len(cold))
    return same, prefix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,4096,8192", help="cached prefix lengths H, tokens (multiples of 16)")
    ap.add_argument("--chunk", type=int, default=2048, help="max tokens per prefill step (default 2048)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see above)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = ensure_gemma3_270m(progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = EngineConfig(kv_cache_bytes=512 << 20, max_num_batched_tokens=args.chunk, num_threads=args.threads,
                       async_scheduling=False, max_model_len=max(lengths) + 512)
    doc = document_tokens(tok, max(lengths))
    question = tok(QUESTION, add_special_tokens=False).input_ids
    probe = LLMEngine(path, cfg)
    mc, bs = probe.model_config, cfg.block_size
    layout = probe.kv_layout
    window = probe.block_manager.window.window
    all_bytes = ModelRunner.block_bytes(mc, bs, DTYPES[cfg.dtype])
    print(f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs) at the start")
    print(f"Gemma-3-270M: {mc.num_hidden_layers} layers, {len(layout.window_layers)} sliding-window (W = {window}), "
          f"{len(layout.full_layers)} full; block {bs} tokens; prefill chunks of {args.chunk}; "
          f"{torch.get_num_threads()} threads")
    del probe
    rows = []
    with tempfile.TemporaryDirectory() as tier:
        for h in lengths:
            turn1, turn2 = doc[:h], doc[:h] + question
            # turn 1 on the worker that will later restore the window state (colocated engine, one token)
            worker = LLMEngine(path, cfg)
            worker.add_request("turn-1", turn1, SamplingParams(temperature=0.0, max_tokens=1))
            while worker.has_unfinished():
                worker.step()
            hashes = block_hashes(turn1, bs, worker.fingerprint)
            store = BlockStore(tier, worker.fingerprint)
            ids = [worker.block_manager.cached[x] for x in hashes]
            full = worker.runner.kv_cache[:, :, ids].permute(2, 0, 1, 3, 4, 5)  # what prefill stores: full layers
            stored = sum(store.put(x, full[i], num_tokens=bs) for i, x in enumerate(hashes))
            file_bytes = sum(f.stat().st_size for f in Path(tier).rglob("*.kvb") if f.stem in set(hashes))

            def load(engine: LLMEngine) -> None:
                staging = torch.empty(len(hashes), *full.shape[1:])
                got = store.read_prefix_into(hashes, "chat", staging)
                assert got == len(hashes) and engine.load_prefix(hashes, staging) == len(hashes)

            cold_rec = Recorder()
            cold = generate(LLMEngine(path, cfg), turn2, None, cold_rec)
            again = generate(LLMEngine(path, cfg), turn2, None, Recorder(forced=cold["tokens"]))
            for key in ("seconds", "cpu"):
                cold[key] = min(cold[key], again[key])
            res = {"no cache": cold}
            for name, mode in (("exact", "exact"), ("bounded", "bounded"), ("swa cache", None)):
                runs = []
                for forced in (None, cold["tokens"]):  # free-running, then teacher-forced
                    if name == "swa cache":  # the pools forgot turn 1; the host SWA cache did not
                        engine = worker
                        engine.block_manager.reset_prefix_cache()
                    else:
                        engine = LLMEngine(path, cfg)
                    load(engine)
                    rec = Recorder(forced=forced)
                    runs.append(generate(engine, turn2, mode, rec))
                res[name] = runs[0]
                for key in ("seconds", "cpu"):
                    res[name][key] = min(r[key] for r in runs)
                res[name]["kl"] = kl(cold_rec.logps, rec.logps)
                res[name]["top1"] = sum(int(q.argmax()) == t for q, t in zip(rec.logps, cold["tokens"]))
            rows.append((h, len(turn2), res, stored, file_bytes, len(hashes)))
            print_one(h, len(turn2), res, window)
    print_summary(rows, all_bytes, layout)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


def print_one(h: int, n: int, res: dict, window: int) -> None:
    print(f"\nH = {h} cached tokens, prompt {n} tokens (W = {window}):")
    print(f"  {'path':<10} {'taken':<16} {'forwards':>8} {'wall s':>7} {'cpu s':>7} {'greedy =':>9} {'common':>6} "
          f"{'top-1 (TF)':>10} {'mean KL':>10}")
    cold = res["no cache"]
    for name, r in res.items():
        same, prefix = agreement(cold["tokens"], r["tokens"])
        tf = f"{r['top1']}/{NEW_TOKENS}" if "top1" in r else "-"
        k = f"{r['kl']:.2e}" if "kl" in r else "-"
        print(f"  {name:<10} {r['path']:<16} {r['forwards']:>8} {r['seconds']:>7.2f} {r['cpu']:>7.2f} "
              f"{same:>5}/{NEW_TOKENS} {prefix:>6} {tf:>10} {k:>10}")


def print_summary(rows, all_bytes: int, layout) -> None:
    print("\nBounded replay vs exact recompute vs no cache (prefill until the first token):")
    for h, n, res, stored, file_bytes, nblocks in rows:
        b, e, c = res["bounded"], res["exact"], res["no cache"]
        s = res["swa cache"]
        print(f"  H={h:>5}: token-forwards {b['forwards']} vs {e['forwards']} exact "
              f"({1 - b['forwards'] / e['forwards']:.1%} less) vs {c['forwards']} no cache;\n"
              f"           wall {b['seconds']:.2f} s vs {e['seconds']:.2f} s exact "
              f"({1 - b['seconds'] / e['seconds']:.1%} less) vs {c['seconds']:.2f} s no cache;\n"
              f"           CPU {b['cpu']:.2f} s vs {e['cpu']:.2f} s exact ({1 - b['cpu'] / e['cpu']:.1%} less) "
              f"vs {c['cpu']:.2f} s no cache;\n"
              f"           swa cache {s['forwards']} forwards, {s['seconds']:.2f} s wall, {s['cpu']:.2f} s CPU")
    print("Accuracy of bounded replay against the cold run (64 greedy tokens):")
    for h, n, res, *_ in rows:
        same, prefix = agreement(res["no cache"]["tokens"], res["bounded"]["tokens"])
        print(f"  H={h:>5}: free-running {same}/{NEW_TOKENS} positions equal (first {prefix} identical); "
              f"teacher-forced top-1 {res['bounded']['top1']}/{NEW_TOKENS}, mean KL {res['bounded']['kl']:.3e} nats"
              f" (exact: {res['exact']['kl']:.1e}, swa cache: {res['swa cache']['kl']:.1e})")
    nf = len(layout.full_layers)
    print(f"Storage tier: {all_bytes // 1024} KiB per block with all {layout.num_layers} layers, "
          f"{all_bytes * nf // layout.num_layers // 1024} KiB with the {nf} full layers only "
          f"({1 - nf / layout.num_layers:.1%} saved)")
    for h, n, res, stored, file_bytes, nblocks in rows:
        print(f"  H={h:>5}: {nblocks} blocks, {stored / 2**20:.1f} MiB stored ({file_bytes / 2**20:.1f} MiB of files "
              f"with headers) instead of {nblocks * all_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
