"""Arrival processes of a serving benchmark: when each request (or conversation) is sent.

``request_rate`` is the mean arrival rate in requests per second; ``inf`` sends every
request at time 0 (then only ``--max-concurrency`` paces the run: a closed loop).

- ``poisson``: exponential gaps with mean ``1 / rate`` (a gamma process of shape 1).
- ``gamma``: gaps drawn from Gamma(shape = ``burstiness``, scale = ``1 / (rate * burstiness)``):
  the same mean rate, with a coefficient of variation ``1 / sqrt(burstiness)`` of the gaps:
  ``burstiness`` < 1 is burstier than Poisson, > 1 more regular (vLLM's ``--burstiness``).
- ``fixed``: one request every ``1 / rate`` seconds exactly.

The first request arrives at time 0 and times are cumulative gaps, as in vLLM.
"""

from __future__ import annotations

import math
import random

PROCESSES = ("poisson", "gamma", "fixed")


def arrival_times(n: int, request_rate: float, process: str = "poisson", burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests; non-decreasing, the first 0.

    Raises ValueError for an unknown ``process``, a rate or burstiness <= 0, or n < 0.
    """
    if process not in PROCESSES:
        raise ValueError(f"unknown arrival process {process!r} (one of {', '.join(PROCESSES)})")
    if n < 0 or not request_rate > 0 or not burstiness > 0:
        raise ValueError("n must be >= 0, request_rate and burstiness > 0")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    shape = 1.0 if process == "poisson" else burstiness
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += 1.0 / request_rate if process == "fixed" else rng.gammavariate(shape, 1.0 / (request_rate * shape))
        out.append(t)
    return out
