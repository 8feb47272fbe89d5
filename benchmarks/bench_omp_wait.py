"""Spinning vs passive OpenMP waiters when several torch processes share the cores.

torch's CPU wheel runs its parallel regions on GNU OpenMP, whose idle threads spin before they
sleep (``OMP_WAIT_POLICY`` unset or ``ACTIVE``). A local mesh runs a prefill and a decode engine
(and, in the tests, pytest's own engines) on the same cores, so a spinning thread of one process
holds a core that another process's thread needs. This script runs the same work under both
policies, one after the other, each in fresh processes (the policy is read when torch loads), and
prints the seconds side by side with the ratio:

- ``engine``: an in-process ``LLMEngine`` serving 5 prompts (440 prompt tokens, 8 output tokens
  each) while ``--busy`` other torch processes run matrix products on the same cores;
- ``mesh``: ``launcher.Mesh()`` of the default model, start to healthy, then 5 chat requests one at
  a time (24 tokens each); its own prefill and decode workers are the sharing processes.

    python benchmarks/bench_omp_wait.py [--busy 1] [--skip-mesh]

Measured 2026-12-02 on the 2-core CPU (docs/benchmarks.md has the table).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ENGINE = r"""
import time
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.models.convert import ensure_default_model
from deepinfer.protocol import SamplingParams
engine = LLMEngine(ensure_default_model(progress=False), EngineConfig(kv_cache_bytes=64 << 20,
                                                                      max_num_batched_tokens=64))
sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
t0 = time.perf_counter()
for i in range(5):
    engine.add_request(str(i), [100 + i + 7 * j for j in range(88)], sp)
while engine.has_unfinished():
    engine.step()
print(time.perf_counter() - t0)
"""

MESH = r"""
import tempfile, time
from pathlib import Path
import openai
from deepinfer.launcher import Mesh
t0 = time.perf_counter()
m = Mesh(workdir=Path(tempfile.mkdtemp(prefix="bench-omp-")))
m.start(timeout=600)
t1 = time.perf_counter()
try:
    c = openai.OpenAI(base_url=m.gateway_url + "/v1", api_key="x", max_retries=0, timeout=600)
    for i in range(5):
        c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True},
                                  messages=[{"role": "user", "content": f"Tell me about topic {i}. " * (10 * i + 1)}])
    t2 = time.perf_counter()
finally:
    m.stop()
print(t1 - t0, t2 - t1)
"""

BUSY = r"""
import torch
a = torch.randn(512, 512)
while True:
    a = torch.tanh(a @ a)
"""


def run(code: str, policy: str, busy: int) -> list[float]:
    """Run ``code`` in a fresh python under ``policy`` beside ``busy`` matmul loops (same policy);
    returns the floats it printed. Raises CalledProcessError if it fails."""
    env = dict(os.environ, OMP_WAIT_POLICY=policy)
    loops = [subprocess.Popen([sys.executable, "-c", BUSY], env=env) for _ in range(busy)]
    try:
        time.sleep(2 if busy else 0)  # let them load torch first
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
        return [float(x) for x in out.stdout.split()]
    finally:
        for p in loops:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--busy", type=int, default=1, help="other torch processes beside the engine run (default 1)")
    p.add_argument("--skip-mesh", action="store_true", help="only the engine run")
    args = p.parse_args(argv)
    rows = [("engine: 5 prompts beside %d busy process(es) (s)" % args.busy,
             *(run(ENGINE, pol, args.busy)[0] for pol in ("ACTIVE", "PASSIVE")))]
    if not args.skip_mesh:
        active, passive = run(MESH, "ACTIVE", 0), run(MESH, "PASSIVE", 0)
        rows += [("mesh: start to healthy (s)", active[0], passive[0]),
                 ("mesh: 5 chat requests one at a time (s)", active[1], passive[1])]
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'ACTIVE':>8}  {'PASSIVE':>8}  {'ratio':>6}")
    for name, a, b in rows:
        print(f"{name:{width}}  {a:8.1f}  {b:8.1f}  {a / b:6.2f}")


if __name__ == "__main__":
    main()
