"""Step-time model for cutting prefill chunks by compute time.

A step that feeds ``n_r`` new tokens after ``c_r`` cached/computed tokens for
each request r is predicted to take

    t = a + b * sum_r n_r + d * sum_r n_r * (c_r + n_r / 2) + e * sum_r (c_r + n_r)   [seconds]

``a``: fixed per-step cost (weights read once per step, Python overhead);
``b``: per-token cost (the linear layers); ``d``: per token-pair cost
(attention: each new token attends to about c + n/2 keys); ``e``: per key
gathered from the paged cache (each sequence's whole context is read once
per step, whatever its n).

NOTE: ``e`` is our addition to the usual three-term model (a, b, d). Measured on
the 2-core CPU: 16 decodes at context 1024 cost ~840 ms against ~110 ms for
one, although their token-pairs are few; the block gather, not the dot
products, dominates decode attention, so without ``e`` the fit was off by
2-3x for chunks at long contexts. The coefficients
are fitted at start-up from a few timed forward passes and refitted online by
least squares over the most recent steps (Mooncake's regression TTFT
predictor does the same). ``max_chunk`` inverts the model: the largest n
whose predicted cost fits the time left in the step.

Parameters (defaults): window=256 recent steps, refit_every=16 steps, and
at once after a step whose prediction was off by more than refit_error=25%
of its measured time (so the model follows a shift, e.g. into contexts
longer than calibration saw, within a step or two).
"""

from __future__ import annotations

import math
from collections import deque

import torch

Piece = tuple[int, int]  # (new tokens n, context tokens before them c)


def features(pieces: list[Piece]) -> list[float]:
    """[1, sum n, sum n(c + n/2), sum (c + n)] of a step's pieces."""
    return [1.0, float(sum(n for n, _ in pieces)), float(sum(n * (c + n / 2) for n, c in pieces)),
            float(sum(c + n for n, c in pieces))]


class StepCostModel:
    def __init__(self, a: float = 0.01, b: float = 1e-3, d: float = 1e-7, e: float = 0.0,
                 window: int = 256, refit_every: int = 16, refit_error: float = 0.25,
                 fitted: tuple[int, ...] = (1, 2, 3)):
        self.a, self.b, self.d, self.e = a, b, d, e
        self.fitted = fitted  # which of b, d, e (1, 2, 3) ``fit`` may change; a always is
        self.samples: deque[tuple[list[float], float]] = deque(maxlen=window)
        self.refit_every = refit_every
        self.refit_error = refit_error
        self._since_fit = 0
        self.num_fits = 0  # times ``fit`` ran (0: a, b, d, e are still the constructor's)
        self.errors: deque[tuple[float, float]] = deque(maxlen=window)  # (predicted, measured)

    def predict(self, pieces: list[Piece]) -> float:
        """Predicted seconds of one step feeding ``pieces``."""
        _, sn, sq, sk = features(pieces)
        return self.a + self.b * sn + self.d * sq + self.e * sk

    def piece_cost(self, n: int, c: int) -> float:
        """Marginal seconds that one request's piece adds to a step."""
        return self.b * n + self.d * n * (c + n / 2) + self.e * (c + n)

    def max_chunk(self, c: int, seconds: float) -> int:
        """Largest n with ``piece_cost(n, c) <= seconds`` (0 if none fits)."""
        return self._tokens_within(c, seconds - self.e * c)

    def efficient_chunk(self, c: int) -> int:
        """Largest n whose own compute after ``c`` context tokens (``piece_cost`` less the context
        read ``e * c``) is at most the step's fixed cost there, ``a + e * c``: a step feeding at
        least this many tokens spends at least half its time on them (>= 1)."""
        return max(1, self._tokens_within(c, self.a + self.e * c))

    def _tokens_within(self, c: int, seconds: float) -> int:
        """Largest n with ``b n + d n (c + n/2) + e n <= seconds`` (0 if none fits)."""
        if seconds <= 0:
            return 0
        # (d/2) n^2 + (b + d c + e) n - seconds <= 0
        qa, qb = self.d / 2, self.b + self.d * c + self.e
        if qa <= 0:
            return int(seconds / qb) if qb > 0 else 1 << 30
        return max(0, int((-qb + math.sqrt(qb * qb + 4 * qa * seconds)) / (2 * qa)))

    def observe(self, pieces: list[Piece], seconds: float) -> None:
        """Record a measured step; refit every ``refit_every`` observations or after a bad miss."""
        predicted = self.predict(pieces)
        self.errors.append((predicted, seconds))
        self.samples.append((features(pieces), seconds))
        self._since_fit += 1
        missed = abs(predicted - seconds) > self.refit_error * seconds
        if (self._since_fit >= self.refit_every or missed) and len(self.samples) >= 3:
            self.fit()

    def fit(self) -> None:
        """Non-negative least squares over the recent samples.

        Ordinary least squares, then any negative coefficient is pinned to 0
        and the rest refitted (the active-set idea of Lawson-Hanson NNLS).
        A coefficient whose feature does not vary in the window (e.g. only
        decode steps seen), or that is not in ``fitted``, keeps its current value.
        """
        self._since_fit = 0
        self.num_fits += 1
        x = torch.tensor([f for f, _ in self.samples], dtype=torch.float64)
        y = torch.tensor([t for _, t in self.samples], dtype=torch.float64)
        coef = [self.a, self.b, self.d, self.e]
        free = [0] + [j for j in self.fitted if x[:, j].max() - x[:, j].min() > 0]
        fixed = [j for j in range(x.shape[1]) if j not in free]
        y_adj = y - sum(coef[j] * x[:, j] for j in fixed) if fixed else y
        scale = x[:, free].abs().max(dim=0).values.clamp(min=1e-12)  # condition the columns
        while free:
            # SVD driver: features can be collinear (c = 0 makes sum n and sum (c + n) equal); the
            # minimum-norm solution is then well defined, where QR-based gelsy varied with the CPU
            sol = torch.linalg.lstsq(x[:, free] / scale, y_adj[:, None], rcond=1e-10,
                                     driver="gelsd").solution[:, 0] / scale
            if (sol >= 0).all():
                for j, v in zip(free, sol.tolist()):
                    coef[j] = v
                break
            drop = free[int(sol.argmin())]
            coef[drop] = 0.0
            keep = [i for i, j in enumerate(free) if j != drop]
            free = [free[i] for i in keep]
            scale = scale[keep]
        self.a, self.b, self.d, self.e = coef

    def mean_abs_error(self) -> float | None:
        """Mean |predicted - measured| seconds over recent steps (None before any)."""
        if not self.errors:
            return None
        return sum(abs(p - m) for p, m in self.errors) / len(self.errors)
