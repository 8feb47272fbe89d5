"""The step cost model behind compute-time chunking (a + b·n + d·n(c + n/2), plus a gather term)."""

import random

from deepinfer.engine.cost_model import StepCostModel, features


def test_fit_recovers_known_coefficients_from_noisy_steps():
    true = StepCostModel(a=0.1, b=2.5e-3, d=8e-7, e=3e-5)
    model = StepCostModel(refit_every=10_000)
    rng = random.Random(0)
    for _ in range(200):
        pieces = [(rng.choice([1, 1, 16, 64, 256]), rng.randrange(0, 2048)) for _ in range(rng.randint(1, 8))]
        model.samples.append((features(pieces), true.predict(pieces) * rng.uniform(0.98, 1.02)))
    model.fit()
    for got, want in ((model.a, 0.1), (model.b, 2.5e-3), (model.d, 8e-7), (model.e, 3e-5)):
        assert abs(got - want) / want < 0.1


def test_fit_never_returns_negative_coefficients():
    model = StepCostModel(refit_every=10_000)
    for n in (1, 2, 3, 4):  # time falls as n grows: OLS would give b < 0
        model.samples.append((features([(n, 100 * n)]), 1.0 - 0.01 * n))
    model.fit()
    assert min(model.a, model.b, model.d, model.e) >= 0


def test_fit_changes_only_the_fitted_coefficients_and_a():
    """``fitted=(1,)``: d and e are held where they are set and a, b fitted to the rest of each
    step's time (speculative decoding's decode-step model takes d and e from the engine's)."""
    true = StepCostModel(a=0.1, b=2.5e-3, d=8e-7, e=3e-5)
    model = StepCostModel(d=1e-6, e=2e-5, refit_every=10_000, fitted=(1,))
    rng = random.Random(0)
    for _ in range(100):
        pieces = [(rng.choice([1, 2, 3, 6]), rng.randrange(0, 2048)) for _ in range(rng.randint(1, 32))]
        model.samples.append((features(pieces), true.predict(pieces)))
    model.fit()
    assert (model.d, model.e) == (1e-6, 2e-5)
    assert model.a > 0 and model.b > 0


def test_max_chunk_is_the_largest_chunk_that_fits():
    m = StepCostModel(a=0.1, b=2e-3, d=1e-6, e=2e-5)
    for c in (0, 500, 4000):
        n = m.max_chunk(c, 0.3)
        assert m.piece_cost(n, c) <= 0.3 < m.piece_cost(n + 1, c)
    assert m.max_chunk(10**9, 0.3) == 0  # the gather alone exceeds the budget


def test_observe_refits_online_toward_the_machine():
    m = StepCostModel(a=0.0, b=1e-3, d=0.0, e=0.0, refit_every=8)
    for i in range(32):  # the machine is 3x slower per token than the prior
        pieces = [(16 * (1 + i % 4), 0)]
        m.observe(pieces, 0.05 + 3e-3 * pieces[0][0])
    # (with c = 0 the per-token and per-key features coincide; the prediction is what must be right)
    for n in (16, 48, 64):
        assert abs(m.predict([(n, 0)]) - (0.05 + 3e-3 * n)) < 0.002
    first, last = list(m.errors)[:8], list(m.errors)[-8:]
    err = lambda xs: sum(abs(p - t) for p, t in xs) / len(xs)
    assert err(last) < err(first) / 10
