"""Weight-only bf16 linear layer for decode on CPUs without a bf16 GEMM (AVX2 + FMA, no AVX512-BF16 / AMX).

Computes ``y = x @ w.float().T (+ bias)`` with

* ``x``: [M, K] float32 (activations; made contiguous if needed),
* ``w``: [N, K] bfloat16, contiguous (the weight as stored in the checkpoint, never widened in memory),
* ``bias``: [N] float32 or None,
* ``y``: [M, N] float32,

widening each bf16 weight to fp32 in registers and accumulating in fp32 (results match the fp32 GEMM
on the same bf16-rounded weights up to summation order).

Why: decoding 1-8 tokens per step is bound by memory bandwidth, not arithmetic (~14 GB/s on one thread of
the project's CPUs): a linear layer reads every weight once and does only M multiply-adds with it. At 2
bytes per weight instead of fp32's 4 the pass over the weights takes about half the time of an fp32 GEMM
(MKL included); torch's own bf16 ``F.linear`` has no fast path on CPUs without AVX512-BF16 / AMX and
also needs bf16 activations. The kernel is ``cpu_gemv.c`` next to this file (plain C with AVX2 intrinsics).

Threads: a call runs on ``threads`` threads (default: ``set_threads``, else ``torch.get_num_threads()``):
the caller and a pool of helper threads (pthreads, started on first need, never stopped) claim parts of
the weight rows; weights under ~256 KB run on the caller alone. One thread alone reads ~14 GB/s on
the project's 2-core hosts, two together ~20 GB/s, so a decode step's weight pass gets shorter. Each
output column is computed by the same code whatever the thread count, so results are bitwise equal to
the single-threaded call's. Idle helpers spin for ``set_spin_us`` microseconds (default 200: the next
layer's call comes within that in a decode step) and then sleep on a futex, so an idle engine uses no
CPU. Two Python threads calling at once do not share the pool: the second runs on its own thread.

Cost: one ``gcc -O3 -mavx2 -mfma -mf16c -shared -fPIC`` compile (~1 s) on first use per machine, cached in
``$DEEPINFER_CACHE/kernels`` (default ``~/.cache/deepinfer/kernels``) under a name hashed from the source,
the compiler and the flags, written atomically so parallel processes can share the cache. ``available()``
says whether the kernel can run here (x86 Linux with avx2 + fma, a C compiler named by ``$CC`` or ``gcc``,
a successful build); ``unavailable_reason()`` says why not. Both are computed once per process and never
raise; ``linear_bf16w`` raises RuntimeError when the kernel is not available.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

__all__ = ["available", "unavailable_reason", "linear_bf16w", "set_threads", "set_spin_us", "pool_helpers"]

_SRC = Path(__file__).with_name("cpu_gemv.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC", "-pthread")
_CPU_FLAGS = ("avx2", "fma")

# Per-process state: None until the first available() / linear_bf16w(); then (_fn, reason), where _fn is
# the ctypes function or None and reason is "" when available. _reset() clears it (tests).
_state: tuple | None = None
_fn = None  # the ctypes function once loaded: the hot path checks only this global
_lib = None  # the loaded library (pool settings)
_threads: int | None = None  # set_threads: the default thread count of a call


def _reset() -> None:
    """Forget the loaded kernel and the availability verdict (tests: a changed $CC or cache dir)."""
    global _state, _fn
    _state = None
    _fn = None


def _cache_dir() -> Path:
    root = os.environ.get("DEEPINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return Path(root) / "kernels"


def _compiler() -> list[str]:
    """The compiler command: $CC (may carry arguments, e.g. 'ccache gcc') or 'gcc'."""
    return shlex.split(os.environ.get("CC") or "gcc") or ["gcc"]


def _cpu_reason() -> str:
    """'' when /proc/cpuinfo lists avx2 and fma, else why not."""
    if not sys.platform.startswith("linux"):
        return f"needs x86 Linux with avx2 + fma (platform is {sys.platform})"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
            else:
                return "no 'flags' line in /proc/cpuinfo (not an x86 CPU?)"
    except OSError as e:
        return f"cannot read /proc/cpuinfo: {e}"
    missing = [f for f in _CPU_FLAGS if f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else ""


def _so_path(cc: list[str], src: bytes) -> Path:
    h = hashlib.sha256(src + "\0".join([*cc, *_FLAGS]).encode()).hexdigest()[:16]
    return _cache_dir() / f"cpu_gemv_{h}.so"


def _build(cc: list[str], so: Path) -> None:
    """Compile cpu_gemv.c to ``so``: into a temp file in the same folder, then os.replace (atomic)."""
    so.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=so.stem + ".", suffix=".tmp.so", dir=so.parent)
    os.close(fd)
    try:
        r = subprocess.run([*cc, *_FLAGS, "-o", tmp, str(_SRC)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-800:]}")
        os.chmod(tmp, 0o755)  # mkstemp made it 0600; a shared cache wants it readable by all
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> tuple:
    """(ctypes function or None, reason). Never raises."""
    try:
        cc = _compiler()
        if shutil.which(cc[0]) is None:
            return None, f"C compiler {cc[0]!r} not found (set $CC to a C compiler)"
        reason = _cpu_reason()
        if reason:
            return None, reason
        src = _SRC.read_bytes()
        so = _so_path(cc, src)
        if not so.exists():
            try:
                _build(cc, so)
            except Exception as e:  # noqa: BLE001 - the reason is the report
                return None, f"building {_SRC.name} with {' '.join(cc)} failed: {e}"
        lib = ctypes.CDLL(str(so))
        fn = lib.linear_bf16w_mt
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        fn.restype = None
        lib.set_spin_ns.argtypes = [ctypes.c_long]
        lib.set_spin_ns.restype = None
        lib.pool_helpers.argtypes = []
        lib.pool_helpers.restype = ctypes.c_int
        global _lib
        _lib = lib
        return fn, ""
    except Exception as e:  # noqa: BLE001 - available() must never raise
        return None, f"{type(e).__name__}: {e}"


def _ensure() -> tuple:
    global _state, _fn
    if _state is None:
        _state = _load()
        _fn = _state[0]
    return _state


def available() -> bool:
    """Whether linear_bf16w can run in this process (CPU flags, compiler, build); cached, never raises."""
    return _ensure()[0] is not None


def unavailable_reason() -> str:
    """Why available() is False; '' when it is True."""
    return _ensure()[1]


def set_threads(threads: int | None) -> None:
    """The thread count of calls that do not name one (None: ``torch.get_num_threads()`` at each call).
    An engine sets its intra-op thread count here, so its linears use every core even in steps it runs
    on one intra-op thread (measured on a 2-core AMD EPYC, SmolLM2-135M decode step at batch 1: 40 ms
    with the kernel on one thread, 34 ms on two)."""
    global _threads
    _threads = None if threads is None else max(1, int(threads))


def set_spin_us(us: float) -> None:
    """How long idle helper threads spin before they sleep, in microseconds (0: sleep at once).
    RuntimeError when the kernel is not available."""
    if not available():
        raise RuntimeError(f"cpu_gemv kernel unavailable: {_state[1]}")
    _lib.set_spin_ns(int(us * 1000))


def pool_helpers() -> int:
    """Helper threads started in this process so far (0 when the kernel is not available)."""
    return _lib.pool_helpers() if available() else 0


def linear_bf16w(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """``x @ w.float().T (+ bias)``: x [M, K] float32, w [N, K] bfloat16 (contiguous), bias [N] float32 or
    None; returns (or writes into ``out``, [M, N] float32 contiguous) [M, N] float32. All on the CPU.
    ``threads``: at most this many threads (None: ``set_threads``' count, else ``torch.get_num_threads()``);
    the bits do not depend on it.
    ValueError on other dtypes, shapes or devices; RuntimeError when the kernel is not available."""
    fn = _fn
    if fn is None:
        fn = _ensure()[0]
        if fn is None:
            raise RuntimeError(f"cpu_gemv kernel unavailable: {_state[1]}")
    if x.dtype != torch.float32 or w.dtype != torch.bfloat16 or x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"need x [M, K] float32 and w [N, K] bfloat16; got x {x.dtype} {tuple(x.shape)}, "
                         f"w {w.dtype} {tuple(w.shape)}")
    m, k = x.shape
    n, kw = w.shape
    if kw != k or not x.is_cpu or not w.is_cpu or not w.is_contiguous():
        raise ValueError(f"need x [M, K] and contiguous w [N, K] on the CPU; got x {tuple(x.shape)} on {x.device}, "
                         f"w {tuple(w.shape)} on {w.device} (contiguous: {w.is_contiguous()})")
    if not x.is_contiguous():
        x = x.contiguous()
    bp = None
    if bias is not None:
        if bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_cpu or not bias.is_contiguous():
            raise ValueError(f"need bias [{n}] float32 contiguous on the CPU; got {bias.dtype} "
                             f"{tuple(bias.shape)} on {bias.device}")
        bp = bias.data_ptr()
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != (m, n) or not out.is_cpu or not out.is_contiguous():
        raise ValueError(f"need out [{m}, {n}] float32 contiguous on the CPU; got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    fn(x.data_ptr(), w.data_ptr(), bp, out.data_ptr(), m, n, k,
       max(1, int(threads)) if threads is not None else _threads or torch.get_num_threads())
    return out
