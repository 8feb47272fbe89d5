"""Serving benchmark metrics, defined as vLLM's ``vllm bench serve`` defines them (TECHNIQUES §11).

Per request (all times in seconds, from the moment the request was sent):

- TTFT: send -> first streamed token.
- ITL: gaps between consecutive later token arrivals (pooled over requests).
- TPOT: ``(E2E - TTFT) / (output_tokens - 1)``, for requests with > 1 output token.
- E2E: send -> last byte of the reply.

Over a run: request and output-token throughput (per second of the run's
duration), goodput (requests per second that finished and met every SLO
given), cached-token share (cached prompt tokens / prompt tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """One request's outcome, as the client saw it.

    sent: when the request was sent (seconds, run clock). token_times: arrival
    time of every streamed chunk that carried output (seconds, run clock).
    prompt_tokens / cached_tokens / output_tokens: from the reply's ``usage``.
    status: HTTP status (0 = no response); error: message when it failed.
    """

    sent: float
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    status: int = 0
    error: str = ""
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.end - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default); nan if empty."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def distribution(values: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 of ``values`` (nan when empty)."""
    return {"mean": sum(values) / len(values) if values else math.nan, "median": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None) -> dict:
    """Run-level metrics of ``results`` over ``duration_s`` seconds.

    Returns ``{"requests": {...counts}, "ttft_s" | "tpot_s" | "itl_s" | "e2e_s": distribution,
    "request_throughput", "output_throughput" (tokens/s), "goodput" (requests/s meeting every
    SLO given), "cached_share" (cached / prompt tokens over finished requests)}``.
    Raises ValueError if ``duration_s`` <= 0.
    """
    if duration_s <= 0:
        raise ValueError("duration_s must be > 0")
    done = [r for r in results if r.ok]
    good = [r for r in done if (slo_ttft_s is None or r.ttft <= slo_ttft_s)
            and (slo_tpot_s is None or r.tpot is None or r.tpot <= slo_tpot_s)]
    prompt = sum(r.prompt_tokens for r in done)
    return {
        "requests": {"sent": len(results), "completed": len(done),
                     "rejected_429": sum(r.status == 429 for r in results),
                     "failed": sum(not r.ok and r.status != 429 for r in results)},
        "ttft_s": distribution([r.ttft for r in done]),
        "tpot_s": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl_s": distribution([g for r in done for g in r.itls]),
        "e2e_s": distribution([r.e2e for r in done]),
        "request_throughput": len(done) / duration_s,
        "output_throughput": sum(r.output_tokens for r in done) / duration_s,
        "goodput": len(good) / duration_s,
        "cached_share": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in done),
    }
