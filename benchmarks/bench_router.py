"""Prefill routing and admission on a mesh of mock workers: TTFT by policy, under overload, and
with one gateway against two sharing the workers.

A mesh of 4 mock prefill workers (``--mock-cost``: ~5k prompt tokens/s each, the modelled time
slept) and one mock decode worker. In one run:

1. **Policies.** The same skewed load (64 requests over 6.4 s: 6 prompts of 4-6k tokens, about
   1 s of prefill each, among 50-400-token ones) through a gateway per ``--prefill-router``
   policy: TTFT p50 / p90 / p99 and the small prompts' p90; ratios of ``predicted`` (predicted
   finish time, the default) to ``round_robin`` and ``least_loaded``.
2. **Overload.** 64 prompts of 4-6k tokens in 4 s (4x what the workers do) through a gateway
   with ``--ttft-slo-s``: how many were admitted and how many got 429 + Retry-After, and the
   admitted requests' TTFT against the SLO.
3. **Two gateways.** The skewed load through one gateway, then split over two (alternate
   requests): each books the compute it sends and tells the other (``PrefillBooked``, counted
   until the worker's next load report shows it), so the two double-book a worker only within a
   message's trip. TTFT of two against one.

Each run uses its own ``cache_salt``, so no run hits another's stored prefixes. Figures are
wall-clock seconds of this machine; run it on a quiet machine.

    python benchmarks/bench_router.py [--slo 2.5] [--runs policies overload gateways]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time


from deepinfer.bench.metrics import percentile
from deepinfer.bench.replay import replay
from deepinfer.bench.trace import TraceRequest
from deepinfer.launcher import Mesh
from deepinfer.models.convert import DEFAULT_MODEL_NAME

MOCK_COST = "0.004,2e-4,1e-9,1e-7"  # a (s/step), b (s/token), d, e: ~5k prompt tokens/s per worker
MOCK_ARGS = ["--engine", "mock", "--mock-cost", MOCK_COST, "--heartbeat-s", "0.5"]
VOCAB_IDS = (1000, 30000)  # plain tokens of the SmolLM2 vocabulary
POLICIES = ("round_robin", "least_loaded", "predicted")


def skewed_load(seed: int = 6, n: int = 64, seconds: float = 6.4, huge: int = 6) -> list[TraceRequest]:
    """``n`` requests at uniform random times over ``seconds``: ``huge`` prompts of 4-6k tokens,
    the rest 50-400 tokens; 2 output tokens each."""
    rng = random.Random(seed)
    sizes = [rng.randint(4000, 6000) for _ in range(huge)] + [rng.randint(50, 400) for _ in range(n - huge)]
    rng.shuffle(sizes)
    times = sorted(rng.uniform(0, seconds) for _ in range(n))
    return [TraceRequest(t, size, 2, ()) for t, size in zip(times, sizes)]


def overload(seed: int = 11, n: int = 64, seconds: float = 4.0) -> list[TraceRequest]:
    rng = random.Random(seed)
    return sorted((TraceRequest(rng.uniform(0, seconds), rng.randint(4000, 6000), 4, ()) for _ in range(n)),
                  key=lambda r: r.arrival_s)


def prompts_for(load: list[TraceRequest], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(*VOCAB_IDS) for _ in range(r.input_length)] for r in load]


def start_gateway(mesh: Mesh, *args: str) -> str:
    """One more gateway with ``args``, healthy, once the workers' load reports reached it."""
    _, url = mesh.start_gateway(args)
    time.sleep(1.2)
    return url


def run(url: str, load: list[TraceRequest], salt: str, seed: int = 0) -> list:
    results, _ = asyncio.run(replay(url, DEFAULT_MODEL_NAME, load, prompts_for(load, seed), timeout_s=120,
                                    body={"cache_salt": salt}))
    time.sleep(1.2)  # queues drain and the reports catch up before the next run
    return results


def ttft(results: list, load: list[TraceRequest] | None = None, small: bool = False) -> list[float]:
    return [r.ttft for i, r in enumerate(results) if r.ok and (not small or load[i].input_length < 1000)]


def quantiles(values: list[float]) -> str:
    return "  ".join(f"p{q} {percentile(values, q):6.3f}" for q in (50, 90, 99))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slo", type=float, default=2.5, help="TTFT SLO of the overload run, seconds")
    p.add_argument("--runs", nargs="+", choices=("policies", "overload", "gateways"),
                   default=["policies", "overload", "gateways"], help="which of the three runs (default all)")
    args = p.parse_args(argv)
    # decode's KV holds the whole overload (64 prompts of up to 6k tokens): refusals come from prefill
    mesh = Mesh(workdir=tempfile.mkdtemp(prefix="bench-router-"), replicas={"prefill": 4, "decode": 1},
                extra_args={"prefill": MOCK_ARGS, "decode": [*MOCK_ARGS, "--kv-cache-gb", "24"]})
    mesh.start(timeout=300)
    try:
        load = skewed_load()
        if "policies" in args.runs:
            policies(mesh, load)
        if "overload" in args.runs:
            overloaded(mesh, args.slo)
        if "gateways" in args.runs:
            gateways(mesh, load)
    finally:
        mesh.stop()
    return 0


def policies(mesh: Mesh, load: list[TraceRequest]) -> None:
    print("1. TTFT seconds by prefill policy (4 mock prefill workers, 64 requests, 6 of 4-6k tokens)")
    p90 = {}
    for policy in POLICIES:
        res = run(start_gateway(mesh, "--prefill-router", policy), load, salt=f"policy-{policy}")
        failed = sum(not r.ok for r in res)
        p90[policy] = percentile(ttft(res), 90)
        print(f"   {policy:13s} {quantiles(ttft(res))}  small p90 {percentile(ttft(res, load, True), 90):6.3f}"
              + (f"  FAILED {failed}" if failed else ""))
    print("   predicted / round_robin p90: %.2f   predicted / least_loaded p90: %.2f"
          % (p90["predicted"] / p90["round_robin"], p90["predicted"] / p90["least_loaded"]))


def overloaded(mesh: Mesh, slo: float) -> None:
    res = run(start_gateway(mesh, "--ttft-slo-s", str(slo)), overload(), salt="overload")
    ok = [r for r in res if r.status == 200]
    limited = [r for r in res if r.status == 429]
    print(f"\n2. overload: {len(res)} prompts of 4-6k tokens in 4 s, TTFT SLO {slo} s: {len(ok)} admitted "
          f"({sum(r.ok for r in ok)} completed), {len(limited)} got 429 (Retry-After "
          f"{sorted({r.retry_after_s for r in limited})}), {len(res) - len(ok) - len(limited)} other")
    print(f"   admitted TTFT {quantiles(ttft(ok))}  max {max(ttft(ok), default=float('nan')):.3f}"
          f"   p99 / SLO {percentile(ttft(ok), 99) / slo:.2f}")


def gateways(mesh: Mesh, load: list[TraceRequest]) -> None:
    one = start_gateway(mesh)
    two = [start_gateway(mesh), start_gateway(mesh)]
    single = run(one, load, salt="one-gateway")

    async def split():
        halves = [load[0::2], load[1::2]]
        return await asyncio.gather(*(replay(url, DEFAULT_MODEL_NAME, half, prompts_for(half, i + 1),
                                             timeout_s=120, body={"cache_salt": f"two-gateways-{i}"})
                                      for i, (url, half) in enumerate(zip(two, halves))))

    shared = [r for results, _ in asyncio.run(split()) for r in results]
    print("\n3. TTFT seconds, the same load through one gateway and split over two")
    for name, res in (("one gateway", single), ("two gateways", shared)):
        failed = sum(not r.ok for r in res)
        print(f"   {name:13s} {quantiles(ttft(res))}" + (f"  FAILED {failed}" if failed else ""))
    print("   two / one p90: %.2f" % (percentile(ttft(shared), 90) / percentile(ttft(single), 90)))


if __name__ == "__main__":
    raise SystemExit(main())
