"""``deepinfer bench soak``: mixed load for a set time, RSS of every mesh process over time.

    deepinfer bench soak --duration-s 600                       # a mock mesh started here
    deepinfer bench soak --duration-s 300 --mesh real           # the real model
    deepinfer bench soak --duration-s 600 --url http://127.0.0.1:8000   # a running mesh (processes found by name)

A closed loop of ``--concurrency`` clients sends a mix (``Mix``): chat and completions, streamed and
not, some streams dropped by the client after a few events (cancellations), most prompts behind
one of a few shared system prompts (prefix-cache hits) and the rest unique. Every
``--sample-s`` the RSS of every mesh process (gateway, workers, nats-server, redis-server; psutil)
is sampled; every ``--window-s`` a row is printed: requests ended in the window by outcome, E2E
latency p50 / p99 and TTFT p50 of the window's completed requests, and each process's RSS (MiB).
At the end: totals, latency drift (the last window's p50 / p99 over the first's) and a verdict on
memory: per process, the least-squares slope of RSS over the second half of the run (MiB/min) and
the growth it implies over that half; ``GROWTH`` when a process grew more than ``--growth-mib``
MiB and ``--growth-pct`` % over the second half, else ``flat``.

On a mock mesh (``--mesh mock``, the default: ``engine/mock.py``'s deterministic workers) every
chat answer's token ids are also checked against the mock's own function of the prompt
(``MockOracle``): an answer with a lost, repeated or wrong token is counted ``wrong``.

Outcomes: ``ok`` (200 and, where checked, correct), ``wrong``, ``error`` (an HTTP error status or an
SSE error event: a clear error), ``broken`` (a stream that ended without ``[DONE]`` or an error
event, or a body that does not parse), ``hung`` (no end within ``--hang-s``), ``cancelled``
(dropped by the client on purpose). ``--out DIR`` writes ``soak.json`` (samples, windows, verdict).
Exit codes: 0 clean and flat; 1 any wrong / error / broken / hung outcome, no completed request, or
GROWTH; 2 bad options, or a mesh that cannot be started or reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from deepinfer.bench import metrics

DESCRIPTION = ("Run mixed load against the mesh for a set time and report, per window, outcomes, E2E/TTFT "
               "latency and the RSS of every mesh process; at the end latency drift and a memory verdict. "
               "Exit 0: clean and flat; 1: a request failed, none completed, or memory grew; 2: bad options "
               "or the mesh could not be started or reached.")
KINDS = ("ok", "wrong", "error", "broken", "hung", "cancelled")
WORDS = ("queue", "worker", "block", "cache", "tenant", "stream", "token", "prefix", "decode", "river",
         "mountain", "lantern", "harbor", "copper", "violet", "signal", "garden", "thunder", "marble", "echo")
VOCAB_IDS = (300, 40000)  # plain-text token ids of SmolLM2's vocabulary (completions prompts)


# --- the mock's answers -------------------------------------------------------------------------


class MockOracle:
    """The token ids a mock worker (``engine/mock.py``) answers a prompt with: its rolling state
    over the prompt and each output token, the next token a function of the state alone."""

    def __init__(self, model_dir: str | os.PathLike | None = None):
        from deepinfer.engine.mock import MIX, STATE_MOD, _mix64, allowed_tokens
        from deepinfer.models.config import ModelConfig
        from deepinfer.models.convert import resolve_model

        model_dir = resolve_model(str(model_dir) if model_dir else None)
        self.allowed = allowed_tokens(model_dir, ModelConfig.from_dir(model_dir))
        self._mix, self._mod, self._mix64 = MIX, STATE_MOD, _mix64

    def tokens(self, prompt_ids: list[int], n: int) -> list[int]:
        s, out = 0, []
        for t in prompt_ids:
            s = (s * self._mix + t + 1) % self._mod
        for _ in range(n):
            tok = self.allowed[self._mix64(s) % len(self.allowed)]
            out.append(tok)
            s = (s * self._mix + tok + 1) % self._mod
        return out


# --- one request --------------------------------------------------------------------------------


@dataclass
class Spec:
    """One request: ``api`` chat or completions, streamed or not, dropped after ``cancel_after``
    SSE events (None: read to the end)."""

    api: str
    body: dict
    stream: bool
    cancel_after: int | None = None
    label: str = ""

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"


@dataclass
class Outcome:
    kind: str  # one of KINDS
    api: str = ""
    stream: bool = False
    status: int = 0
    started: float = 0.0  # perf_counter when sent
    latency_s: float = 0.0
    ttft_s: float | None = None
    error: str = ""
    label: str = ""


def chat_spec(rng: random.Random, i: int, model: str, max_tokens: int, stream: bool, system: str | None,
              cancel_after: int | None = None, label: str = "") -> Spec:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": f"request {i}: " + " ".join(rng.choice(WORDS)
                                                                          for _ in range(rng.randint(5, 40)))})
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    return Spec("chat", body, stream, cancel_after, label)


def completion_spec(rng: random.Random, model: str, max_tokens: int, stream: bool, prefix: list[int] | None,
                    cancel_after: int | None = None, label: str = "") -> Spec:
    prompt = list(prefix or []) + [rng.randint(*VOCAB_IDS) for _ in range(rng.randint(8, 120))]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    return Spec("completions", body, stream, cancel_after, label)


def _error_text(body) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)
        if err:
            return str(err)
    return str(body)[:300]


async def send(client: httpx.AsyncClient, spec: Spec, hang_s: float, oracle: MockOracle | None = None) -> Outcome:
    """Send ``spec``; its outcome (``hung`` when it has not ended within ``hang_s``)."""
    out = Outcome("broken", spec.api, spec.stream, label=spec.label)
    out.started = time.perf_counter()
    try:
        await asyncio.wait_for(_send(client, spec, out, oracle), hang_s)
    except asyncio.TimeoutError:
        out.kind, out.error = "hung", f"no end within {hang_s:g} s"
    except httpx.HTTPError as e:  # the connection failed: the gateway went away (not a server answer)
        out.kind, out.error = "broken", f"{type(e).__name__}: {e}"
    out.latency_s = time.perf_counter() - out.started
    return out


async def _send(client: httpx.AsyncClient, spec: Spec, out: Outcome, oracle: MockOracle | None) -> None:
    max_tokens = spec.body["max_tokens"]
    if not spec.stream:
        r = await client.post(spec.path, json=spec.body)
        out.status = r.status_code
        try:
            body = r.json()
        except ValueError:
            out.kind, out.error = "broken", f"HTTP {r.status_code}: not JSON: {r.text[:200]}"
            return
        if r.status_code != 200:
            out.kind, out.error = "error", f"HTTP {r.status_code}: {_error_text(body)}"
            return
        out.ttft_s = time.perf_counter() - out.started
        choice = body["choices"][0]
        ids = choice.get("token_ids")
        _judge(out, spec, ids, body.get("prompt_token_ids"), body.get("usage", {}).get("completion_tokens"),
               choice.get("finish_reason"), max_tokens, oracle)
        return
    async with client.stream("POST", spec.path, json=spec.body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            raw = await r.aread()
            try:
                out.kind, out.error = "error", f"HTTP {r.status_code}: {_error_text(json.loads(raw))}"
            except ValueError:
                out.kind, out.error = "broken", f"HTTP {r.status_code}: not JSON: {raw[:200]!r}"
            return
        ids: list[int] = []
        prompt_ids, finish, events, done = None, None, 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                out.kind, out.error = "error", f"SSE error event: {_error_text(event)}"
                return
            events += 1
            if event.get("prompt_token_ids") is not None:
                prompt_ids = event["prompt_token_ids"]
            for choice in event.get("choices") or []:
                if choice.get("token_ids"):
                    ids += choice["token_ids"]
                if choice.get("text") or choice.get("token_ids") or (choice.get("delta") or {}).get("content"):
                    if out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - out.started
                finish = choice.get("finish_reason") or finish
            if spec.cancel_after is not None and events >= spec.cancel_after:
                out.kind = "cancelled"
                return  # leaving the block closes the connection mid-stream
        if not done:
            out.kind, out.error = "broken", f"the stream ended without [DONE] after {events} events"
            return
        _judge(out, spec, ids if spec.api == "chat" else None, prompt_ids, None, finish, max_tokens, oracle)


def _judge(out: Outcome, spec: Spec, ids, prompt_ids, completion_tokens, finish, max_tokens: int,
           oracle: MockOracle | None) -> None:
    """``ok`` or ``wrong``: the finish reason, the token count and, for a mock, every token id."""
    out.kind = "ok"
    if finish != "length":
        out.kind, out.error = "wrong", f"finish_reason {finish!r}, expected 'length' (ignore_eos)"
    elif completion_tokens is not None and completion_tokens != max_tokens:
        out.kind, out.error = "wrong", f"{completion_tokens} completion tokens, expected {max_tokens}"
    elif spec.api == "chat":
        if ids is None or len(ids) != max_tokens:
            out.kind, out.error = "wrong", f"{None if ids is None else len(ids)} token ids, expected {max_tokens}"
        elif oracle is not None and prompt_ids is not None:
            want = oracle.tokens(prompt_ids, max_tokens)
            if ids != want:
                at = next(i for i, (a, b) in enumerate(zip(ids, want)) if a != b)
                out.kind, out.error = "wrong", f"token {at} is {ids[at]}, the mock answers {want[at]}"


# --- the mix ------------------------------------------------------------------------------------


@dataclass
class Mix:
    """What the soak sends: shares of chat (vs completions), streaming, cancelled streams and
    prompts behind a shared prefix (one of ``prefixes``); output lengths in ``max_tokens``."""

    chat: float = 0.6
    stream: float = 0.5
    cancel: float = 0.15
    shared_prefix: float = 0.7
    prefixes: int = 4
    max_tokens: tuple[int, int] = (8, 48)

    def specs(self, model: str, seed: int):
        """An endless stream of ``Spec``s."""
        rng = random.Random(seed)
        systems = [f"You are assistant {k}. " + " ".join(rng.choice(WORDS) for _ in range(150))
                   for k in range(self.prefixes)]
        token_prefixes = [[rng.randint(*VOCAB_IDS) for _ in range(200)] for _ in range(self.prefixes)]
        i = 0
        while True:
            i += 1
            stream = rng.random() < self.stream
            cancel = rng.randint(1, 6) if stream and rng.random() < self.cancel else None
            n = rng.randint(*self.max_tokens)
            k = rng.randrange(self.prefixes) if rng.random() < self.shared_prefix else None
            if rng.random() < self.chat:
                yield chat_spec(rng, i, model, n, stream, systems[k] if k is not None else None, cancel)
            else:
                yield completion_spec(rng, model, n, stream, token_prefixes[k] if k is not None else None, cancel)


# --- processes and their memory -----------------------------------------------------------------


def mesh_processes(mesh) -> dict[str, int]:
    """Name -> pid of every process of a ``launcher.Mesh`` (nats-server and redis-server too)."""
    procs = {p.name: p.pid for p in mesh.all_services() if p.alive}
    for infra in (mesh.nats, mesh.redis):
        if infra is not None and infra.alive:
            procs[infra.name] = infra.pid
    return procs


def find_processes() -> dict[str, int]:
    """Name -> pid of this machine's mesh processes, found by command line (``deepinfer ... serve
    <service> --worker-id <id>``, nats-server, redis-server)."""
    import psutil

    found: dict[str, int] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "serve" in cmd and any("deepinfer" in c for c in cmd[:3]):
            i = cmd.index("serve")
            name = cmd[cmd.index("--worker-id") + 1] if "--worker-id" in cmd[:-1] else \
                (cmd[i + 1] if i + 1 < len(cmd) else "service")
            found[name if name not in found else f"{name}@{p.info['pid']}"] = p.info["pid"]
        elif cmd and os.path.basename(cmd[0]) in ("nats-server", "redis-server"):
            found[os.path.basename(cmd[0]).split("-")[0] + f"@{p.info['pid']}"] = p.info["pid"]
    return found


def rss_mib(pids: dict[str, int]) -> dict[str, float | None]:
    """Each process's resident set size in MiB (None once it is gone)."""
    import psutil

    out: dict[str, float | None] = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            out[name] = None
    return out


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute (0 for fewer than 2)."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def percentile(xs: list[float], q: float) -> float | None:
    """``metrics.percentile`` (linear interpolation, as ``bench serve``), None when empty."""
    return metrics.percentile(xs, q) if xs else None


# --- the run ------------------------------------------------------------------------------------


@dataclass
class Report:
    duration_s: float
    samples: list[dict] = field(default_factory=list)  # {"t": s, "rss": {name: MiB}}
    windows: list[dict] = field(default_factory=list)  # {"t0", "t1", counts..., "p50_s", "p99_s", "ttft_p50_s", "rss"}
    totals: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # error text -> count (first 80 characters)
    growth: dict = field(default_factory=dict)  # name -> {"slope_mib_per_min", "growth_mib", "start_mib", "flag"}
    drift: dict = field(default_factory=dict)
    verdict: str = ""


async def soak(url: str, pids: dict[str, int], duration_s: float, concurrency: int = 8, sample_s: float = 5.0,
               window_s: float = 60.0, hang_s: float = 60.0, mix: Mix | None = None, seed: int = 0,
               oracle: MockOracle | None = None, growth_mib: float = 32.0, growth_pct: float = 10.0,
               model: str | None = None, on_window=None) -> Report:
    """Run the mixed load against ``url`` for ``duration_s``, sampling the RSS of ``pids``."""
    from deepinfer.bench.runner import served_model

    mix = mix or Mix()
    model = model or await served_model(url)
    specs = mix.specs(model, seed)
    report = Report(duration_s)
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    end = t0 + duration_s
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < end:
            outcomes.append(await send(client, next(specs), hang_s, oracle))

    clients_done = asyncio.Event()

    async def sampler() -> None:
        next_window = t0 + window_s
        seen = 0
        while True:
            now = time.perf_counter()
            if now >= end:  # the last window also counts the requests in flight at the end
                await clients_done.wait()
            report.samples.append({"t": round(now - t0, 2), "rss": await asyncio.to_thread(rss_mib, pids)})
            if now >= next_window or now >= end:
                w = window_row(outcomes[seen:], next_window - window_s - t0,
                               (time.perf_counter() if now >= end else min(now, next_window)) - t0,
                               report.samples[-1]["rss"])
                seen = len(outcomes)
                report.windows.append(w)
                if on_window is not None:
                    on_window(w)
                next_window += window_s
            if now >= end:
                return
            await asyncio.sleep(min(sample_s, max(0.05, end - now)))

    async with httpx.AsyncClient(base_url=url, timeout=hang_s + 5, limits=limits) as client:
        sampling = asyncio.create_task(sampler())
        try:
            await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        finally:
            clients_done.set()
        await sampling
    finish_report(report, outcomes, growth_mib, growth_pct)
    return report


def window_row(outcomes: list[Outcome], t0: float, t1: float, rss: dict) -> dict:
    row = {"t0": round(t0, 1), "t1": round(t1, 1), **{k: 0 for k in KINDS}}
    for o in outcomes:
        row[o.kind] += 1
    ok = [o for o in outcomes if o.kind == "ok"]
    row["p50_s"] = percentile([o.latency_s for o in ok], 50)
    row["p99_s"] = percentile([o.latency_s for o in ok], 99)
    row["ttft_p50_s"] = percentile([o.ttft_s for o in ok if o.ttft_s is not None], 50)
    row["rss"] = dict(rss)
    return row


def finish_report(report: Report, outcomes: list[Outcome], growth_mib: float, growth_pct: float) -> None:
    report.totals = {"sent": len(outcomes), **{k: sum(o.kind == k for o in outcomes) for k in KINDS}}
    for o in outcomes:
        if o.kind not in ("ok", "cancelled"):
            key = f"{o.kind}: {o.error[:80]}"
            report.errors[key] = report.errors.get(key, 0) + 1
    # memory: per process, the slope over the second half of the run
    names = sorted({n for s in report.samples for n in s["rss"]})
    half = report.duration_s / 2
    flagged = []
    for name in names:
        pts = [(s["t"], s["rss"][name]) for s in report.samples if s["rss"].get(name) is not None]
        second = [p for p in pts if p[0] >= half]
        slope = slope_per_min(second)
        span_min = (second[-1][0] - second[0][0]) / 60 if len(second) >= 2 else 0.0
        start = second[0][1] if second else (pts[0][1] if pts else 0.0)
        growth = slope * span_min
        flag = growth > growth_mib and growth > start * growth_pct / 100
        report.growth[name] = {"slope_mib_per_min": round(slope, 3), "growth_mib": round(growth, 2),
                               "start_mib": round(start, 1), "end_mib": round(pts[-1][1], 1) if pts else None,
                               "flag": flag}
        if flag:
            flagged.append(name)
    # latency drift: the last window with completions against the first
    with_p = [w for w in report.windows if w["p50_s"] is not None]
    if len(with_p) >= 2:
        first, last = with_p[0], with_p[-1]
        report.drift = {"p50_first_s": first["p50_s"], "p50_last_s": last["p50_s"],
                        "p50_ratio": round(last["p50_s"] / first["p50_s"], 3) if first["p50_s"] else None,
                        "p99_first_s": first["p99_s"], "p99_last_s": last["p99_s"],
                        "p99_ratio": round(last["p99_s"] / first["p99_s"], 3) if first["p99_s"] else None}
    worst = max(report.growth.items(), key=lambda kv: kv[1]["slope_mib_per_min"], default=(None, None))
    if flagged:
        report.verdict = ("GROWTH: " + ", ".join(f"{n} +{report.growth[n]['growth_mib']:.1f} MiB "
                                                  f"({report.growth[n]['slope_mib_per_min']:+.2f} MiB/min)"
                                                  for n in flagged) + " over the second half")
    elif worst[0] is not None:
        report.verdict = (f"flat: no process grew more than {growth_mib:g} MiB and {growth_pct:g}% over the second "
                          f"half (steepest {worst[0]} {worst[1]['slope_mib_per_min']:+.2f} MiB/min, "
                          f"{worst[1]['growth_mib']:+.1f} MiB)")
    else:
        report.verdict = "no samples"


# --- output -------------------------------------------------------------------------------------


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def window_header(names: list[str]) -> str:
    return (f"{'t (s)':>11} {'ok':>5} {'wrong':>5} {'err':>4} {'brkn':>4} {'hung':>4} {'cncl':>4} "
            f"{'e2e50':>6} {'e2e99':>6} {'ttft50':>6} | RSS MiB: " + " ".join(f"{n:>12}" for n in names))


def window_line(w: dict, names: list[str]) -> str:
    return (f"{w['t0']:>5.0f}-{w['t1']:<5.0f} {w['ok']:>5} {w['wrong']:>5} {w['error']:>4} {w['broken']:>4} "
            f"{w['hung']:>4} {w['cancelled']:>4} {_f(w['p50_s']):>6} {_f(w['p99_s']):>6} "
            f"{_f(w['ttft_p50_s'], '{:.3f}'):>6} |          " + " ".join(f"{_f(w['rss'].get(n), '{:.1f}'):>12}"
                                                                        for n in names))


def format_summary(report: Report) -> str:
    t = report.totals
    lines = [f"totals: sent {t['sent']}, ok {t['ok']}, wrong {t['wrong']}, error {t['error']}, broken {t['broken']}, "
             f"hung {t['hung']}, cancelled {t['cancelled']}"]
    for k, v in sorted(report.errors.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {v} x {k}")
    if report.drift:
        d = report.drift
        lines.append(f"latency drift (last window / first): p50 {_f(d['p50_first_s'])} -> {_f(d['p50_last_s'])} s "
                     f"(x{_f(d['p50_ratio'])}), p99 {_f(d['p99_first_s'])} -> {_f(d['p99_last_s'])} s "
                     f"(x{_f(d['p99_ratio'])})")
    lines.append("RSS over the second half (MiB/min, MiB): " + ", ".join(
        f"{n} {g['slope_mib_per_min']:+.2f} ({g['start_mib']:.0f}->{_f(g['end_mib'], '{:.0f}')})"
        for n, g in report.growth.items()))
    lines.append(f"verdict: {report.verdict}")
    return "\n".join(lines)


# --- command line -------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration-s", type=float, default=600.0, help="how long to load the mesh (default 600)")
    p.add_argument("--url", default=None, help="a running gateway (its processes are found by command line); "
                                                "default: start a mesh here (--mesh)")
    p.add_argument("--mesh", choices=("mock", "real"), default="mock",
                   help="the mesh started here: mock workers (default) or the real model")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers of the mesh started here (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode workers of the mesh started here (default 2)")
    p.add_argument("--concurrency", type=int, default=8, help="clients in the closed loop (default 8)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples (default 5)")
    p.add_argument("--window-s", type=float, default=60.0, help="seconds per table row (default 60)")
    p.add_argument("--hang-s", type=float, default=60.0, help="a request not ended in this long is hung (default 60)")
    p.add_argument("--max-tokens", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"),
                   help="output tokens per request, uniform (default 8 48)")
    p.add_argument("--cancel", type=float, default=0.15, help="share of streams the client drops (default 0.15)")
    p.add_argument("--growth-mib", type=float, default=32.0,
                   help="GROWTH when a process grows more than this over the second half ... (default 32)")
    p.add_argument("--growth-pct", type=float, default=10.0, help="... and more than this %% (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    p.add_argument("--out", default=None, help="directory for soak.json")


MOCK_ARGS = ["--engine", "mock", "--heartbeat-s", "0.5"]
MOCK_PREFILL_COST = "0.004,3e-4,1e-9,1e-7"  # as tests/reliability/test_reliability_mesh.py: ~0.3 ms a prompt token
MOCK_DECODE_COST = "0.02,1e-4,1e-9,1e-7"  # 20 ms a step


def start_mesh(kind: str, prefill: int, decode: int, progress=None):
    from deepinfer.launcher import Mesh

    if kind == "mock":
        extra = {"prefill": [*MOCK_ARGS, "--mock-cost", MOCK_PREFILL_COST],
                 "decode": [*MOCK_ARGS, "--mock-cost", MOCK_DECODE_COST]}
    else:
        extra = {"prefill": ["--no-calibrate", "--kv-cache-gb", "0.5"], "decode": ["--no-calibrate", "--kv-cache-gb", "0.5"]}
    mesh = Mesh(services=("tokenizer", "kvindex", "prefill", "decode", "gateway"),
                replicas={"prefill": prefill, "decode": decode}, extra_args=extra)
    return mesh.start(timeout=600, progress=progress)


def check_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first bad option (before any mesh is started)."""
    positive = {"--duration-s": args.duration_s, "--concurrency": args.concurrency, "--sample-s": args.sample_s,
                "--window-s": args.window_s, "--hang-s": args.hang_s, "--prefill": args.prefill,
                "--decode": args.decode}
    for name, value in positive.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    lo, hi = args.max_tokens
    if not 1 <= lo <= hi:
        raise ValueError(f"--max-tokens MIN MAX needs 1 <= MIN <= MAX, got {lo} {hi}")
    if not 0 <= args.cancel <= 1:
        raise ValueError(f"--cancel is a share in [0, 1], got {args.cancel}")
    if args.url and not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must be an http(s) URL, got {args.url!r}")


def run(args: argparse.Namespace) -> Report:
    """The soak the command line asks for; prints the table as it goes. Raises ValueError for bad
    options, OSError / httpx.HTTPError / LauncherError when the mesh cannot be started or reached."""
    check_arguments(args)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    mesh = None
    try:
        if args.url:
            url, pids, oracle = args.url.rstrip("/"), find_processes(), None
        else:
            mesh = start_mesh(args.mesh, args.prefill, args.decode, progress=say)
            url, pids = mesh.gateway_url, mesh_processes(mesh)
            oracle = MockOracle(mesh.model_dir) if args.mesh == "mock" else None
        names = list(pids)
        say(f"soak: {url}, {args.duration_s:g} s, {args.concurrency} clients, processes {pids}")
        print(window_header(names), flush=True)
        mix = Mix(cancel=args.cancel, max_tokens=tuple(args.max_tokens))
        report = asyncio.run(soak(url, pids, args.duration_s, args.concurrency, args.sample_s, args.window_s,
                                  args.hang_s, mix, args.seed, oracle, args.growth_mib, args.growth_pct,
                                  on_window=lambda w: print(window_line(w, names), flush=True)))
        print(format_summary(report), flush=True)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "soak.json").write_text(json.dumps(asdict(report), indent=1))
        return report
    finally:
        if mesh is not None:
            mesh.stop()


def failed(report: Report) -> str | None:
    """Why the soak failed (exit 1), or None: no request completed, any wrong / broken / hung /
    error outcome (a healthy mesh has none; cancellations are the client's), or memory GROWTH."""
    t = report.totals
    if t["ok"] == 0:
        return "no request completed"
    bad = {k: t[k] for k in ("wrong", "broken", "hung", "error") if t[k]}
    if bad:
        return f"requests failed: {bad}"
    if report.verdict.startswith("GROWTH"):
        return report.verdict
    return None


def cli(args: argparse.Namespace) -> int:
    """Exit 2 with one ``error:`` line for bad options or a mesh that cannot be started or reached,
    1 when the soak failed (``failed``), else 0."""
    from deepinfer.bench import run_cli
    from deepinfer.launcher import LauncherError

    return run_cli(run, args, failed, errors=(LauncherError,))
