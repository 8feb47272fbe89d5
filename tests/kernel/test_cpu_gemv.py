"""libs/kernels/cpu_gemv: the weight-only bf16 linear kernel (AVX2 C, built on first use) against
``x @ w.float().T (+ bias)``, its input checks, its fallback when no compiler is found, and its build cache."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from deepinfer.kernels import cpu_gemv


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts and ends with no cached verdict (tests below change $CC and the cache dir)."""
    cpu_gemv._reset()
    yield
    cpu_gemv._reset()


@pytest.fixture
def kernel():
    """The kernel, built (or found in the cache); skips where the CPU or the compiler rule it out."""
    if reason := cpu_gemv._cpu_reason():
        pytest.skip(f"cpu_gemv needs avx2 + fma: {reason}")
    if shutil.which(cpu_gemv._compiler()[0]) is None:
        pytest.skip(f"no C compiler {cpu_gemv._compiler()[0]!r}")
    assert cpu_gemv.available(), cpu_gemv.unavailable_reason()  # a build failure here is a real failure
    assert cpu_gemv.unavailable_reason() == ""
    return cpu_gemv.linear_bf16w


def _check(y, x, w, bias):
    ref = x @ w.float().T
    if bias is not None:
        ref = ref + bias
    k = x.shape[1]
    assert y.dtype == torch.float32 and y.shape == ref.shape and y.is_contiguous()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4 * max(1.0, k / 512))


@pytest.mark.parametrize("k", [8, 576, 1536, 100, 3, 24, 37])  # 24, 37: leftover 8 / tail paths
@pytest.mark.parametrize("m", [*range(1, 10), 16])
def test_matches_torch(kernel, m, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    for n in (1, 7, 576, 113):  # 113: an odd last chunk of weight rows when m > 4 (k=576)
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g).bfloat16()
        b = torch.randn(n, generator=g)
        _check(kernel(x, w), x, w, None)
        _check(kernel(x, w, b), x, w, b)
        out = torch.full((m, n), float("nan"))
        assert kernel(x, w, b, out=out) is out
        _check(out, x, w, b)


@pytest.mark.parametrize("m", [1, 3, 5])
def test_non_contiguous_x(kernel, m):
    k, n = 100, 7
    g = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    xt = torch.randn(k, m, generator=g).T              # transposed view
    xs = torch.randn(m, 2 * k, generator=g)[:, ::2]    # strided columns
    xr = torch.randn(2 * m, k, generator=g)[::2]       # strided rows
    for x in (xt, xs, xr):
        assert not x.is_contiguous() or (m == 1 and x is not xs)  # a single row's view is contiguous
        _check(kernel(x, w, b), x, w, b)


@pytest.mark.parametrize("m", [1, 3, 5, 16])
def test_threads_give_the_same_bits(kernel, m):
    """A call split over the helper pool writes every column, with the single-threaded call's bits."""
    g = torch.Generator().manual_seed(m)
    for n, k in ((2001, 576), (1536, 576), (600, 1536), (113, 576)):  # odd n: a part boundary mid-pair
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g).bfloat16()
        b = torch.randn(n, generator=g)
        one = kernel(x, w, b, threads=1)
        _check(one, x, w, b)
        for threads in (2, 3, 4, 8):
            out = torch.full((m, n), float("nan"))
            kernel(x, w, b, out=out, threads=threads)
            assert torch.equal(out, one), (n, k, threads)
    assert cpu_gemv.pool_helpers() >= 1  # the large weights were split: helper threads exist


def test_pool_with_concurrent_callers_and_sleeping_helpers(kernel):
    """Python threads calling at once (the kernel releases the GIL) each get their own exact result,
    with helpers that spin and with helpers that sleep between calls (the futex path)."""
    import threading

    g = torch.Generator().manual_seed(7)
    w = torch.randn(4096, 576, generator=g).bfloat16()
    xs = [torch.randn(2, 576, generator=g) for _ in range(4)]
    refs = [kernel(x, w, threads=1) for x in xs]
    errors = []

    def caller(i):
        for _ in range(50):
            if not torch.equal(kernel(xs[i], w, threads=2), refs[i]):
                errors.append(i)

    try:
        for spin_us in (200, 0):
            cpu_gemv.set_spin_us(spin_us)
            threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not any(t.is_alive() for t in threads), "a call never returned"
            assert errors == []
    finally:
        cpu_gemv.set_spin_us(200)


def test_default_thread_count(kernel, monkeypatch):
    """A call without ``threads`` runs on set_threads' count, else on torch's intra-op thread count."""
    seen = []
    monkeypatch.setattr(cpu_gemv, "_fn", lambda *args: seen.append(args[-1]))
    x, w = torch.randn(1, 8), torch.randn(2, 8).bfloat16()
    try:
        cpu_gemv.set_threads(None)
        cpu_gemv.linear_bf16w(x, w)
        cpu_gemv.set_threads(3)
        cpu_gemv.linear_bf16w(x, w)
        cpu_gemv.linear_bf16w(x, w, threads=1)
        cpu_gemv.linear_bf16w(x, w, threads=0)
    finally:
        cpu_gemv.set_threads(None)
    assert seen == [torch.get_num_threads(), 3, 1, 1]


def test_empty_and_extreme_values(kernel):
    w = torch.randn(5, 16).bfloat16()
    assert kernel(torch.empty(0, 16), w).shape == (0, 5)
    b = torch.randn(5)
    torch.testing.assert_close(kernel(torch.empty(3, 0), torch.empty(5, 0, dtype=torch.bfloat16), b),
                               b.expand(3, 5))
    x = torch.zeros(1, 16)
    x[0, 3] = float("inf")
    w = torch.zeros(2, 16, dtype=torch.bfloat16)
    w[0, 3] = 1
    y = kernel(x, w)
    assert y[0, 0] == float("inf") and torch.isnan(y[0, 1])  # inf * 0 is nan, as in the reference


def test_bad_inputs_raise_value_error(kernel):
    x, w, b = torch.randn(2, 16), torch.randn(4, 16).bfloat16(), torch.randn(4)
    bad = [
        (x.double(), w, None, None),                 # x dtype
        (x.bfloat16(), w, None, None),
        (x, w.float(), None, None),                  # w dtype
        (x, w.half(), None, None),
        (x[0], w, None, None),                       # x 1-d
        (x.unsqueeze(0), w, None, None),             # x 3-d
        (x, w[0], None, None),                       # w 1-d
        (torch.randn(2, 15), w, None, None),         # K mismatch
        (x, torch.randn(16, 4).bfloat16().T, None, None),  # w not contiguous
        (x, w, b.double(), None),                    # bias dtype
        (x, w, torch.randn(5), None),                # bias length
        (x, w, torch.randn(1, 4), None),             # bias 2-d
        (x, w, None, torch.empty(2, 5)),             # out shape
        (x, w, None, torch.empty(2, 4, dtype=torch.float64)),  # out dtype
        (x, w, None, torch.empty(4, 2).T),           # out not contiguous
        (x.to("meta"), w, None, None),               # not on the CPU
        (x, w.to("meta"), None, None),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            kernel(*args)


def test_missing_compiler_is_unavailable_not_a_crash(monkeypatch, tmp_path):
    """Runs on every machine: no compiler -> available() False with the compiler named, calls raise."""
    monkeypatch.setenv("CC", "deepinfer-no-such-cc")
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    assert cpu_gemv.available() is False
    assert "deepinfer-no-such-cc" in cpu_gemv.unavailable_reason()
    assert cpu_gemv.available() is False  # cached verdict, still no raise
    with pytest.raises(RuntimeError, match="deepinfer-no-such-cc"):
        cpu_gemv.linear_bf16w(torch.randn(1, 8), torch.randn(2, 8).bfloat16())
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())


@pytest.mark.skipif(sys.platform == "win32", reason="a shell-script compiler")
def test_failing_build_is_unavailable_with_compiler_output(kernel, monkeypatch, tmp_path):
    cc = tmp_path / "bad-cc"
    cc.write_text("#!/bin/sh\necho 'fatal: the compiler says no' >&2\nexit 3\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "cache"))
    cpu_gemv._reset()
    assert cpu_gemv.available() is False
    reason = cpu_gemv.unavailable_reason()
    assert "the compiler says no" in reason and "exit 3" in reason, reason
    assert not list((tmp_path / "cache" / "kernels").glob("*"))  # no half-written .so left behind
    with pytest.raises(RuntimeError):
        cpu_gemv.linear_bf16w(torch.randn(1, 8), torch.randn(2, 8).bfloat16())


def test_built_library_is_reused_from_cache(kernel, monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    cpu_gemv._reset()
    assert cpu_gemv.available(), cpu_gemv.unavailable_reason()
    sos = list((tmp_path / "kernels").glob("*.so"))
    assert len(sos) == 1 and sos[0].name.startswith("cpu_gemv_"), sos
    mtime = os.stat(sos[0]).st_mtime_ns

    def no_build(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(cpu_gemv, "_build", no_build)
    cpu_gemv._reset()
    assert cpu_gemv.available(), cpu_gemv.unavailable_reason()
    assert os.stat(sos[0]).st_mtime_ns == mtime
    assert list((tmp_path / "kernels").iterdir()) == sos  # no temp files left
    x, w = torch.randn(2, 24), torch.randn(3, 24).bfloat16()
    _check(cpu_gemv.linear_bf16w(x, w), x, w, None)
