"""The default mesh vs the disaggregated mesh vs a plain vLLM server, side by side, in one run.

    .venv/bin/python benchmarks/bench_peers.py [--systems default disagg vllm] [--chat-prompts N]
        [--prefix-prompts N] [--burst N] [--out bench_results/peers]

Starts each system in turn (never two at once), on the default model (SmolLM2-135M-Instruct):

1. ``default``: the mesh ``deepinfer up`` starts (``Mesh(mode=cli.DEFAULT_MODE)``);
2. ``disagg``: the disaggregated mesh (``Mesh(mode="disagg")``: a prefill and a decode worker);
3. ``vllm``: ``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``, bf16) from .venv-vllm
   (``bash scripts/setup_vllm.sh``).

and drives each with the same ``deepinfer bench serve`` runs (greedy, streaming chat, ignore_eos):

- chats: random prompts of 150 tokens, 128 output tokens, at concurrency 1, 4 and 16,
  ``--chat-prompts`` (32) prompts per level, fresh prompts per level: output tok/s, ITL p50,
  TTFT p50 / p90;
- shared prefix: a 1,600-token system prompt + a 32-token question, 16 output tokens, TTFT of
  - cold c=1: ``--prefix-prompts`` (8) requests one at a time, each with its own new prefix;
  - warm c=1: one new prefix, cached by one untimed request first (its question is one token), then
    ``--prefix-prompts`` requests with new questions one at a time;
  - cold c=16: ``--burst`` (16) requests at once sharing one new prefix;
  - warm c=16: the same requests again, each question extended by 32 new tokens (same seed,
    ``--suffix-len 64``: the prompt text is a pure function of seed and key), so the prefix (and the
    old question) is cached and 32 tokens are new.

Each phase draws its prompts with its own seed (``PHASE_SEEDS``): a different seed is a different
text, so "cold" is never cached by an earlier phase. Each mesh starts on a fresh workdir (no KV
blocks left from an earlier run).

Prints each system's start-up time and the peak RSS (MiB) of each of its processes (sampled every
0.5 s while the workloads run), then one table with every system as a column and the ratios to
vllm; writes ``<out>/results.json``, ``<out>/table.md`` and every run's ``serve.json`` under
``<out>/<system>/<phase>/``. With the defaults, about 25 minutes for the three systems on 2 CPU
cores (most of it the chats at c=1; vllm takes ~1.5 min to start); the smoke run ``--systems default
vllm --chat-prompts 4 --prefix-prompts 2 --burst 4``: about 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from deepinfer.cli import DEFAULT_MODE
from deepinfer.launcher import ManagedProcess, Mesh, free_port
from deepinfer.models.convert import DEFAULT_MODEL_NAME, ensure_default_model

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}

# Mesh keyword arguments per mesh system
SYSTEMS: dict[str, dict] = {
    "default": {"mode": DEFAULT_MODE},  # what `deepinfer up` starts
    "disagg": {"mode": "disagg"},  # prefill workers hand off to decode workers
    "agg": {"mode": "agg"},  # one worker prefills and decodes (not in the default run: it is one of the above)
}
ALL_SYSTEMS = (*SYSTEMS, "vllm")

CHAT_LEVELS = (1, 4, 16)
CHAT_INPUT, CHAT_OUTPUT = 150, 128
PREFIX_LEN, SUFFIX_LEN, PREFIX_OUTPUT = 1600, 32, 16
PHASE_SEEDS = {"chats": 100, "prefix-cold-c1": 200, "prefix-warm-c1": 300, "prefix-c16": 400}  # chats: 100..102


def phases(args) -> list[tuple[str, list[str]]]:
    """(name, ``bench serve`` flags) of every run, in order; ``*-prime`` runs are untimed."""
    def prefix(n: int, groups: int, seed: int, suffix: int = SUFFIX_LEN, concurrency: int = 1) -> list[str]:
        return ["--dataset", "shared-prefix", "--num-prompts", str(n), "--prefix-groups", str(groups),
                "--prefix-len", str(PREFIX_LEN), "--suffix-len", str(suffix), "--output-len", str(PREFIX_OUTPUT),
                "--seed", str(seed), "--max-concurrency", str(concurrency)]

    p, b, s = args.prefix_prompts, args.burst, PHASE_SEEDS
    runs = [
        ("chats", ["--dataset", "random", "--input-len", str(CHAT_INPUT), "--output-len", str(CHAT_OUTPUT),
                   "--num-prompts", str(args.chat_prompts), "--max-concurrency", *map(str, CHAT_LEVELS),
                   "--seed", str(s["chats"])]),  # bench serve seeds level i with seed + i: fresh prompts
        ("prefix-cold-c1", prefix(p, p, s["prefix-cold-c1"])),
        ("prefix-warm-c1-prime", prefix(1, 1, s["prefix-warm-c1"], suffix=1)),
        ("prefix-warm-c1", prefix(p, 1, s["prefix-warm-c1"])),
        ("prefix-cold-c16", prefix(b, 1, s["prefix-c16"], concurrency=b)),
        ("prefix-warm-c16", prefix(b, 1, s["prefix-c16"], suffix=2 * SUFFIX_LEN, concurrency=b)),
    ]
    return [(name, flags) for name, flags in runs if name.split("-")[0] in args.workloads]


def bench(url: str, flags: list[str], out: Path) -> list[dict]:
    """``deepinfer bench serve`` against ``url``; returns its runs' summaries (one per concurrency level)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "deepinfer.cli", "bench", "serve", "--url", url, "--model", DEFAULT_MODEL_NAME,
           "--api", "chat", "--temperature", "0", "--ignore-eos", *flags, "--out", str(out), "--no-progress"]
    with open(out / "bench.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise RuntimeError(f"bench serve failed: see {log.name}")
    return [e["summary"] for e in json.loads((out / "serve.json").read_text())["runs"]]


def run_workloads(name: str, url: str, args) -> dict[str, list[dict]]:
    results = {}
    for phase, flags in phases(args):
        t0 = time.monotonic()
        results[phase] = bench(url, flags, Path(args.out) / name / phase)
        print(f"{name}: {phase} done in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return results


class PeakRSS:
    """While in its ``with`` block, samples every ``interval`` s the RSS of each root process and each
    of its descendants (labelled ``root/name``), keeping every label's peak and the peak of the sum (MiB)."""

    def __init__(self, roots: dict[str, int], interval: float = 0.5):
        self.roots, self.interval = roots, interval
        self.peak_mib: dict[str, float] = {}
        self.peak_total_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def sample(self) -> None:
        now: dict[str, float] = {}
        for label, pid in self.roots.items():
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    key = label if p.pid == pid else f"{label}/{p.name()}"
                    now[key] = now.get(key, 0.0) + p.memory_info().rss / 2**20
                except psutil.Error:
                    pass
        for key, mib in now.items():
            self.peak_mib[key] = max(self.peak_mib.get(key, 0.0), mib)
        self.peak_total_mib = max(self.peak_total_mib, sum(now.values()))

    def report(self) -> dict:
        return {"peak_rss_mib": {k: round(v, 1) for k, v in self.peak_mib.items()},
                "peak_total_rss_mib": round(self.peak_total_mib, 1)}


def run_mesh(name: str, args, extra_args: dict | None = None, **mesh_kwargs) -> dict:
    """One mesh system: start it on a fresh workdir, run the workloads, stop it."""
    workdir = Path(args.out) / name / "mesh"
    shutil.rmtree(workdir, ignore_errors=True)  # no KV blocks (storage tier, Redis index) from an earlier run
    mesh = Mesh(workdir=workdir, extra_args=extra_args, **mesh_kwargs)
    try:
        t0 = time.monotonic()
        mesh.start(timeout=900)
        startup = time.monotonic() - t0
        print(f"{name}: started in {startup:.1f} s", file=sys.stderr)
        procs = [p for p in (mesh.nats, mesh.redis, *mesh.all_services()) if p is not None]
        with PeakRSS({p.name: p.pid for p in procs}) as rss:
            phases_out = run_workloads(name, mesh.gateway_url, args)
        return {"startup_s": startup, **rss.report(), "phases": phases_out}
    finally:
        mesh.stop()


def wait_healthy(url: str, proc: ManagedProcess, timeout: float = 900) -> None:
    t0 = time.monotonic()
    while True:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} exited {proc.returncode}: see {proc.log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{proc.name} did not become healthy in {timeout:.0f} s: see {proc.log_path}")
        time.sleep(1)


def run_vllm(args) -> dict:
    """vLLM's own OpenAI server from .venv-vllm, in its own process group (stopped as a whole)."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: run `bash scripts/setup_vllm.sh` first")
    port, model = free_port(), ensure_default_model(progress=False)
    argv = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", DEFAULT_MODEL_NAME, "--dtype", "bfloat16", "--host", "127.0.0.1",
            "--port", port, "--max-model-len", "4096",
            "--enable-prompt-tokens-details"]  # reports cached prompt tokens, as the mesh does (no effect on speed)
    log = Path(args.out) / "vllm" / "vllm-serve.log"
    log.unlink(missing_ok=True)
    t0 = time.monotonic()
    proc = ManagedProcess("vllm-serve", argv, log, env={**os.environ, **VLLM_ENV})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        startup = time.monotonic() - t0
        print(f"vllm: started in {startup:.1f} s", file=sys.stderr)
        with PeakRSS({"vllm-serve": proc.pid}) as rss:
            phases_out = run_workloads("vllm", url, args)
        return {"startup_s": startup, **rss.report(), "phases": phases_out}
    finally:
        proc.stop(30)


def run_system(name: str, args) -> dict:
    return run_vllm(args) if name == "vllm" else run_mesh(name, args, **SYSTEMS[name])


# ------------------------------------------------------------------------------ report

TPUT, ITL50 = ("output_throughput", None, 1), ("itl_s", "median", 1e3)
TTFT50, TTFT90 = ("ttft_s", "median", 1e3), ("ttft_s", "p90", 1e3)


def rows(burst: int) -> list[tuple[str, str, int, list]]:
    """The table's rows: (label, phase, run index in the phase, [(summary key, percentile, scale)])."""
    c1, c4, c16 = CHAT_LEVELS
    return [(f"chats c={c1} tok/s (ITL p50 ms)", "chats", 0, [TPUT, ITL50]),
            (f"chats c={c4} tok/s", "chats", 1, [TPUT]),
            (f"chats c={c16} tok/s (TTFT p50 / p90 ms)", "chats", 2, [TPUT, TTFT50, TTFT90]),
            ("prefix cold c=1 TTFT p50 ms", "prefix-cold-c1", 0, [TTFT50]),
            ("prefix warm c=1 TTFT p50 ms", "prefix-warm-c1", 0, [TTFT50]),
            (f"prefix cold c={burst} TTFT p50 (p90) ms", "prefix-cold-c16", 0, [TTFT50, TTFT90]),
            (f"prefix warm c={burst} TTFT p50 ms", "prefix-warm-c16", 0, [TTFT50])]


def chat_rows() -> list[tuple[str, str, int, list]]:
    """Every chats level in full."""
    return [(f"chats c={c} tok/s (ITL p50 / TTFT p50 / p90 ms)", "chats", i, [TPUT, ITL50, TTFT50, TTFT90])
            for i, c in enumerate(CHAT_LEVELS)]


def values(result: dict, phase: str, run: int, metrics: list) -> list[float] | None:
    try:
        s = result["phases"][phase][run]
        return [(s[m] if q is None else s[m][q]) * scale for m, q, scale in metrics]
    except (KeyError, IndexError, TypeError):
        return None


def cell(xs: list[float] | None, fmt: str) -> str:
    if not xs or any(x is None for x in xs):
        return "-"
    first, rest = format(xs[0], fmt), [format(x, fmt) for x in xs[1:]]
    return first + (f" ({' / '.join(rest)})" if rest else "")


def table(results: dict[str, dict], rows: list) -> str:
    systems = list(results)
    ref = results.get("vllm")
    others = [s for s in systems if s != "vllm"] if ref else []
    lines = ["| workload | " + " | ".join(systems + [f"{s}/vllm" for s in others]) + " |",
             "|---" * (1 + len(systems) + len(others)) + "|"]
    for label, phase, run, metrics in rows:
        row = [cell(values(results[s], phase, run, metrics), ".1f") for s in systems]
        r = values(ref, phase, run, metrics) if ref else None
        for s in others:
            v = values(results[s], phase, run, metrics)
            row.append(cell([a / b if a is not None and b else None for a, b in zip(v, r)] if v and r else None,
                            ".2f"))
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def resources(results: dict[str, dict]) -> str:
    lines = []
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name}: FAILED: {r['error']}")
            continue
        procs = ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mib"].items())
        cached = ", ".join(f"{phase} {runs[-1]['cached_share']:.2f}" for phase, runs in r["phases"].items()
                           if phase.startswith("prefix-") and not phase.endswith("-prime"))
        lines.append(f"{name}: started in {r['startup_s']:.1f} s; peak RSS MiB: {procs} "
                     f"(peak of the sum {r['peak_total_rss_mib']:.0f}); cached prompt share: {cached}")
    return "\n".join(lines)


def failures(results: dict[str, dict]) -> list[str]:
    return [f"{name} {phase} run {i}: {s['requests']['failed'] + s['requests']['rejected_429']} of "
            f"{s['requests']['sent']} requests failed: {s['errors']}"
            for name, r in results.items() for phase, runs in r.get("phases", {}).items()
            for i, s in enumerate(runs) if s["requests"]["completed"] < s["requests"]["sent"]]


def report(results: dict[str, dict], args) -> None:
    header = ("Ratios are system / vllm for every number: > 1 is better for tok/s, < 1 is better for "
              "latencies (ms).")
    failed = failures(results)
    text = "\n\n".join([resources(results), header, table(results, rows(args.burst)),
                         "Chats per level:", table(results, chat_rows()), *(["\n".join(failed)] if failed else [])])
    print("\n" + text)
    (Path(args.out) / "table.md").write_text(text + "\n")


def on_sigterm(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through every ``finally``: meshes and vllm get stopped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", nargs="+", choices=ALL_SYSTEMS, default=["default", "disagg", "vllm"])
    ap.add_argument("--workloads", nargs="+", choices=("chats", "prefix"), default=["chats", "prefix"])
    ap.add_argument("--chat-prompts", type=int, default=32, help="chats: prompts per concurrency level (default 32)")
    ap.add_argument("--prefix-prompts", type=int, default=8, help="prefix cold/warm c=1: requests (default 8)")
    ap.add_argument("--burst", type=int, default=16, help="prefix cold/warm c=16: requests at once (default 16)")
    ap.add_argument("--out", default="bench_results/peers")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, on_sigterm)
    ensure_default_model(progress=False)  # the one-time conversion, outside every start-up time
    results: dict[str, dict] = {}
    for name in sorted(set(args.systems), key=ALL_SYSTEMS.index):  # vllm, the reference, last
        try:
            results[name] = run_system(name, args)
        except Exception as e:  # one system failing still leaves the others' numbers
            print(f"{name}: FAILED: {e}", file=sys.stderr)
            results[name] = {"error": str(e)}
        (out / "results.json").write_text(json.dumps({"args": vars(args), "systems": results}, indent=1))
    report(results, args)


if __name__ == "__main__":
    main()
