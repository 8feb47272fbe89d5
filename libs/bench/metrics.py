"""Serving benchmark metrics, defined as vLLM's ``vllm bench serve`` (``benchmark_serving``) and
SGLang's ``bench_serving`` define them.

Per request (times in seconds on the run's clock; a request is *completed* when it answered
HTTP 200 and streamed at least one token):

- TTFT: send -> first streamed chunk that carries output.
- ITL: the gaps between consecutive output chunks of a request (pooled over requests; a
  chunk that carries several tokens is one gap, as in vLLM).
- TPOT: ``(E2E - TTFT) / (output_tokens - 1)``, only for requests with more than one output
  token (``output_tokens`` from the reply's ``usage``).
- E2E: send -> the last byte of the reply.

Over a run of ``duration`` seconds (first send -> last reply):

- request throughput: completed requests / duration (requests/s);
- output / input / total token throughput: output, prompt, prompt + output tokens of the
  completed requests / duration (tokens/s);
- goodput: completed requests that met *every* SLO given (TTFT, TPOT, E2E; a request with one
  output token has no TPOT and passes that SLO) / duration (requests/s);
- cached-token share: ``usage.prompt_tokens_details.cached_tokens`` / ``usage.prompt_tokens``,
  summed over the completed requests (0..1);
- each latency as mean, median, p90 and p99, percentiles linearly interpolated between ranks
  (numpy's default, as vLLM computes them).
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
    output_text: the generated text (what a multi-turn session sends back as the assistant's turn).
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
    output_text: str = ""

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
              slo_tpot_s: float | None = None, slo_e2e_s: float | None = None) -> dict:
    """Run-level metrics of ``results`` over ``duration_s`` seconds (definitions: module docstring).

    Returns ``{"requests": {...counts}, "ttft_s" | "tpot_s" | "itl_s" | "e2e_s": distribution,
    "request_throughput" (requests/s), "output_throughput" | "input_throughput" |
    "total_token_throughput" (tokens/s), "goodput" (requests/s meeting every SLO given),
    "cached_share" (cached / prompt tokens over completed requests), "prompt_tokens",
    "cached_tokens", "output_tokens"}``. Raises ValueError if ``duration_s`` <= 0.
    """
    if duration_s <= 0:
        raise ValueError("duration_s must be > 0")
    done = [r for r in results if r.ok]
    good = [r for r in done if (slo_ttft_s is None or r.ttft <= slo_ttft_s)
            and (slo_tpot_s is None or r.tpot is None or r.tpot <= slo_tpot_s)
            and (slo_e2e_s is None or r.e2e <= slo_e2e_s)]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    return {
        "requests": {"sent": len(results), "completed": len(done),
                     "rejected_429": sum(r.status == 429 for r in results),
                     # a refusal a client cannot pace itself by
                     "rejected_429_without_retry_after": sum(r.status == 429 and r.retry_after_s is None
                                                             for r in results),
                     "failed": sum(not r.ok and r.status != 429 for r in results)},
        "ttft_s": distribution([r.ttft for r in done]),
        "tpot_s": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl_s": distribution([g for r in done for g in r.itls]),
        "e2e_s": distribution([r.e2e for r in done]),
        "request_throughput": len(done) / duration_s,
        "output_throughput": output / duration_s,
        "input_throughput": prompt / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "goodput": len(good) / duration_s,
        "cached_share": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in done),
        "output_tokens": output,
    }


def throughput_series(results: list[RequestResult], bin_s: float, t0: float = 0.0) -> tuple[list[float], list[float]]:
    """Output tokens per second in consecutive ``bin_s``-second bins from ``t0`` (run clock).

    Each completed request's ``output_tokens`` are spread evenly over its output chunks (one
    token per chunk when the server streams token by token), and a chunk counts in the bin
    of its arrival time. Returns ``(bin start times, tokens/s per bin)``, up to the last chunk.
    """
    if bin_s <= 0:
        raise ValueError("bin_s must be > 0")
    done = [r for r in results if r.ok]
    last = max((r.token_times[-1] for r in done), default=t0)
    counts = [0.0] * (int((last - t0) // bin_s) + 1)
    for r in done:
        per_chunk = r.output_tokens / len(r.token_times) if r.output_tokens else 1.0
        for t in r.token_times:
            counts[int((t - t0) // bin_s)] += per_chunk
    return [t0 + i * bin_s for i in range(len(counts))], [c / bin_s for c in counts]


def strict_json(x):
    """``x`` with every float NaN (an empty distribution) as None, so it dumps as strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x
