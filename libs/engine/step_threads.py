"""Intra-op threads per step: one thread for small steps, all of them for big ones, chosen by timing.

A decode step runs a few hundred small parallel regions (GEMMs, batched
matmuls, gathers). Each one wakes the other threads of the OpenMP team, and
where threads sleep while they wait (``OMP_WAIT_POLICY=PASSIVE``, what the
launcher sets so that the services' processes do not steal each other's cores
by spinning) every wake-up costs tens of microseconds. Measured on a 2-core
Xeon (SmolLM2-135M, bf16, passive): a decode step of 1 sequence took 41.7 ms
on 2 threads and 18.6 ms on 1; of 16 sequences 45.7 against 36.4 ms; of 64
both ~114 ms; while a 1,600-token prefill took 1.6 s on 2 threads against
2.85 s on 1. With threads that spin (libgomp's default, in-process) 2 threads
win at every size (16 against 18 ms at 1 sequence). The cut is a property of
the host and of the wait policy, so it is timed at start-up
(``choose_step_threads``) on dummy steps of the loaded model, logged, and
applied per step by the forward thread (``StepThreads.threads_for``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable

# Steps timed: decode batches of 1, 16 and 64 sequences (their token counts). Bigger steps (prefill
# chunks) always run on all threads: timed alone, a 1.6k-token prefill took 1.6 s on 2 threads and
# 2.85 s on 1, but a start-up probe runs beside the other workers' start-up (their probes too), where
# one thread looked faster at 256 tokens as well; with that cut a lone cold 1.6k prompt in the
# mesh took 2.8 s to its first token instead of 1.9 s.
PROBE_TOKENS = (1, 16, 64)
# one thread must be at least this much faster to be taken (timing noise on shared cores)
MIN_GAIN = 0.95


@dataclass
class StepThreads:
    """max_threads: the engine's intra-op threads; single_max_tokens: steps feeding at most
    this many tokens run on one thread (0: none do); seconds: the probe's timings,
    {threads: {tokens: best seconds}} (empty when nothing was timed); reason: one log line."""

    max_threads: int
    single_max_tokens: int = 0
    seconds: dict[int, dict[int, float]] = field(default_factory=dict)
    reason: str = ""

    def threads_for(self, num_tokens: int) -> int:
        """Intra-op threads for a step feeding ``num_tokens`` tokens."""
        return 1 if num_tokens <= self.single_max_tokens else self.max_threads

    def log_fields(self) -> dict:
        return {"max_threads": self.max_threads, "single_thread_max_tokens": self.single_max_tokens,
                "reason": self.reason,
                "probe_ms": {t: {n: round(s * 1e3, 2) for n, s in v.items()} for t, v in self.seconds.items()}}


def choose_step_threads(time_step: Callable[[int, int], float], max_threads: int,
                        tokens: tuple[int, ...] = PROBE_TOKENS) -> StepThreads:
    """Time ``time_step(num_tokens, threads)`` (seconds of one step, best of a few) on one and
    on ``max_threads`` threads for each of ``tokens`` (ascending), and return the cut: the
    largest probed token count up to which one thread was faster at every probed size (by
    ``MIN_GAIN``); probing stops at the first size where it was not, or that could not be
    timed (``time_step`` returned inf: e.g. the batch does not fit the KV cache). One thread
    available: nothing is timed."""
    if max_threads <= 1:
        return StepThreads(max_threads, 0, reason="one intra-op thread: nothing to choose")
    seconds: dict[int, dict[int, float]] = {1: {}, max_threads: {}}
    cut = 0
    for n in tokens:
        one, many = time_step(n, 1), time_step(n, max_threads)
        seconds[1][n], seconds[max_threads][n] = one, many
        if not (math.isfinite(one) and math.isfinite(many)) or one > MIN_GAIN * many:
            break
        cut = n
    ratios = ", ".join(f"{n} tokens {seconds[1][n] / seconds[max_threads][n]:.2f}x" for n in seconds[1])
    policy = os.environ.get("OMP_WAIT_POLICY", "default")
    reason = f"1-thread/{max_threads}-thread step time (OMP_WAIT_POLICY {policy}): {ratios}"
    return StepThreads(max_threads, cut, seconds, reason)
