"""The mesh with the native engine vs the mesh with ``--engine vllm`` vs a plain vLLM server, in one run.

The vLLM backend's benchmark (docs/vllm_backend.md). Run it in .venv-vllm
(``bash scripts/setup_vllm.sh``), which has both engines, so the three systems share one environment:

    .venv-vllm/bin/python benchmarks/bench_vllm_backend.py [--concurrency 1 4 16] [--output-len 64]

Starts each system in turn (never two at once), on the default model (SmolLM2-135M-Instruct, fp32):

1. ``native``: ``Mesh()`` (gateway, tokenizer, kvindex, balancer, prefill, decode; native engine);
2. ``mesh-vllm``: the same mesh, prefill and decode with ``--engine vllm --block-size 128``;
3. ``vllm-serve``: ``python -m vllm.entrypoints.openai.api_server`` (vLLM's own HTTP server).

and sends each the same workload with ``deepinfer bench serve`` (random prompts of
``--input-len`` tokens, ``--output-len`` output tokens with ignore_eos, greedy, streaming chat,
``--prompts-per-concurrency`` x N prompts at each concurrency cap N, fresh prompts per level).
Prints output tokens/s, median TTFT and median ITL per system and level, and the ratios to
vllm-serve; writes every system's ``serve.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deepinfer.launcher import Mesh, free_port
from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def bench(url: str, args, out: Path) -> list[dict]:
    """``deepinfer bench serve`` against ``url``; returns its runs' summaries (one per concurrency)."""
    cmd = [sys.executable, "-m", "deepinfer.cli", "bench", "serve", "--url", url, "--model", DEFAULT_MODEL_NAME,
           "--dataset", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--max-concurrency", *map(str, args.concurrency), "--prompts-per-concurrency", str(args.waves),
           "--out", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [e["summary"] for e in json.loads((out / "serve.json").read_text())["runs"]]


def run_mesh(name: str, args, extra_args: dict | None = None) -> list[dict]:
    mesh = Mesh(workdir=Path(args.out) / name / "mesh", extra_args=extra_args, env=VLLM_ENV)
    t0 = time.monotonic()
    mesh.start(timeout=900)
    print(f"{name}: started in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    try:
        return bench(mesh.gateway_url, args, Path(args.out) / name)
    finally:
        mesh.stop()


def run_vllm_serve(args) -> list[dict]:
    port, model = free_port(), ensure_default_model(progress=False)
    log = open(Path(args.out) / "vllm-serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--served-model-name", DEFAULT_MODEL_NAME, "--dtype", "float32", "--port", str(port),
                             "--host", "127.0.0.1", "--max-model-len", "2048"],
                            env={**os.environ, **VLLM_ENV}, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm server exited {proc.returncode}: see {log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 900:
                raise RuntimeError("vllm server did not become healthy in 900 s")
            time.sleep(1)
        print(f"vllm-serve: started in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        return bench(f"http://127.0.0.1:{port}", args, Path(args.out) / "vllm-serve")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--input-len", type=int, default=150)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2, help="prompts per concurrency level = waves x level (default 2)")
    ap.add_argument("--out", default="bench_results/vllm_backend")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    vllm_args = ["--engine", "vllm", "--block-size", "128"]
    results = {
        "native": run_mesh("native", args),
        "mesh-vllm": run_mesh("mesh-vllm", args, {"prefill": vllm_args, "decode": vllm_args}),
        "vllm-serve": run_vllm_serve(args),
    }
    ref = results["vllm-serve"]
    print(f"{'system':<11} {'conc':>4} {'out tok/s':>10} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} "
          f"{'tok/s vs serve':>15} {'TTFT vs serve':>14} {'ITL vs serve':>13}")
    for name, runs in results.items():
        for c, s, r in zip(args.concurrency, runs, ref):
            tput, ttft, itl = s["output_throughput"], s["ttft_s"]["median"], s["itl_s"]["median"]
            print(f"{name:<11} {c:>4} {tput:>10.1f} {ttft * 1e3:>12.0f} {itl * 1e3:>11.1f} "
                  f"{tput / r['output_throughput']:>15.2f} {ttft / r['ttft_s']['median']:>14.2f} "
                  f"{itl / r['itl_s']['median']:>13.2f}")
    (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
