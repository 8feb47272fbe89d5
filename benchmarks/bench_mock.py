"""Mock workers: how many fit on this machine, how fast they start, how well steps follow the timing model.

In one run:

1. Step-time accuracy (in-process ``MockEngine``, the default timing model):
   a mix of chunked prefills (time budget 250 ms) and batched decodes; per
   step, (measured - predicted) / predicted. Repeated while the mock mesh of
   step 2 serves a burst, to see the effect of a loaded CPU.
2. A mesh (launcher ``Mesh``) with ``--prefill N --decode N`` mock workers
   (default 8 + 8), plus the tokenizer, kvindex and gateway: time until
   /health, then per worker RSS, PSS (its share of pages shared with the
   other workers, e.g. torch's libraries) and USS (private) from
   /proc/<pid>/smaps_rollup; their CPU use while idle.
3. Start-up of one more mock worker in the running mesh: spawn -> first
   ``LoadReport`` heard on NATS (``--extra`` of them, one after another).
4. A burst of ``--requests`` concurrent chat requests through the gateway.

    python benchmarks/bench_mock.py [--workers 8] [--extra 3] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.mock import MockConfig, MockEngine
from deepinfer.launcher import Mesh
from deepinfer.mesh import MeshClient
from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model
from deepinfer.protocol import LoadReport, SamplingParams, subjects, unpack


def step_errors(model_dir) -> list[float]:
    """Relative step-time errors of a mixed workload on the default timing model."""
    e = MockEngine(model_dir, EngineConfig(step_time_budget_s=0.25, calibrate=True), MockConfig())
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    for i, n in enumerate((1500, 700, 300, 120, 60, 40, 30, 20)):
        e.add_request(str(i), [(i * 31 + j) % 40000 + 100 for j in range(n)], sp)
    while e.has_unfinished():
        e.step_async()
    t = e.timing
    predicted = [t.a * f[0] + t.b * f[1] + t.d * f[2] + t.e * f[3] for f, _ in e.cost_model.samples]
    return [(m - p) / p for (_, m), p in zip(e.cost_model.samples, predicted)]


def describe(errors: list[float]) -> str:
    q = statistics.quantiles(errors, n=10)
    return (f"{len(errors)} steps: median {statistics.median(errors):+.2%}, p90 {q[-1]:+.2%}, "
            f"max {max(errors):+.2%}, min {min(errors):+.2%}")


def memory_kb(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[0] in ("Rss:", "Pss:", "Private_Clean:", "Private_Dirty:"):
                out[parts[0][:-1]] = int(parts[1])
    out["Uss"] = out.pop("Private_Clean") + out.pop("Private_Dirty")
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    import os

    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def time_new_worker(mesh: Mesh, service: str, args: list[str]) -> float:
    """Seconds from spawning one more worker to its first LoadReport."""
    mc = await MeshClient.connect(mesh.nats_url, "bench-observer")
    heard = asyncio.Event()
    index = mesh._next_index.get(service, 0)
    worker_id = f"{service}-{index}"

    async def on_load(msg):
        r = unpack(msg.data)
        if isinstance(r, LoadReport) and r.worker_id == worker_id:
            heard.set()

    await mc.nc.subscribe(subjects.LOAD_ALL, cb=on_load)
    t0 = time.perf_counter()
    mesh.start_worker(service, args)
    await asyncio.wait_for(heard.wait(), 120)
    dt = time.perf_counter() - t0
    await mc.close()
    return dt


def burst(mesh: Mesh, n: int) -> tuple[float, int]:
    import openai

    client = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key="b", max_retries=0, timeout=300)

    def one(i):
        return client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, max_tokens=32, temperature=0,
            messages=[{"role": "user", "content": f"Request {i}: " + "tell me a story. " * (i % 16 * 10)}])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(n, 32)) as pool:
        outs = list(pool.map(one, range(n)))
    return time.perf_counter() - t0, sum(o.usage.completion_tokens for o in outs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=8, help="mock prefill workers and as many decode workers")
    p.add_argument("--extra", type=int, default=3, help="extra workers timed from spawn to first heartbeat")
    p.add_argument("--requests", type=int, default=64)
    args = p.parse_args()
    model_dir = ensure_default_model(progress=False)

    print("step time vs timing model (idle machine):", describe(step_errors(model_dir)))

    mock = ["--engine", "mock"]
    n = args.workers
    t0 = time.perf_counter()
    with Mesh(replicas={"prefill": n, "decode": n}, extra_args={"prefill": mock, "decode": mock}) as mesh:
        print(f"mesh with {n} + {n} mock workers healthy in {time.perf_counter() - t0:.1f} s")
        mem = [memory_kb(p.pid) for s in ("prefill", "decode") for p in mesh.processes[s]]
        for k in ("Rss", "Pss", "Uss"):
            vals = [m[k] / 1024 for m in mem]
            print(f"  per mock worker {k}: mean {statistics.mean(vals):.0f} MiB, max {max(vals):.0f} MiB")
        print(f"  all {2 * n} mock workers together: PSS {sum(m['Pss'] for m in mem) / 1024:.0f} MiB")
        procs = [p for s in ("prefill", "decode") for p in mesh.processes[s]]
        cpu0, t1 = [cpu_s(p.pid) for p in procs], time.perf_counter()
        time.sleep(5)
        idle = sum(cpu_s(p.pid) for p in procs) - sum(cpu0)
        print(f"  idle CPU of all {2 * n} mock workers: {idle / (time.perf_counter() - t1):.1%} of one core")
        starts = [asyncio.run(time_new_worker(mesh, "decode", mock)) for _ in range(args.extra)]
        print(f"one more mock worker, spawn -> first heartbeat: {', '.join(f'{s:.1f}' for s in starts)} s")

        loaded: list[list[float]] = []
        th = threading.Thread(target=lambda: loaded.append(step_errors(model_dir)))
        th.start()
        dt, tokens = burst(mesh, args.requests)
        th.join()
        print(f"burst: {args.requests} requests, {tokens} tokens in {dt:.1f} s")
        print("step time vs timing model (during the burst):", describe(loaded[0]))
        mem = [memory_kb(p.pid) for s in ("prefill", "decode") for p in mesh.processes[s]]
        print(f"  after the burst, per mock worker PSS: mean {statistics.mean(m['Pss'] for m in mem) / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
