"""Start-up timings of an engine's own forward passes on dummy sequences: the step cost model's
fit (``calibrate``) and the intra-op thread count per step size (``choose_step_threads``).

Both time real steps of the loaded model on this machine, so they run once per machine and
settings: each timing is kept in ``probe_cache`` under ``probe_key`` (what a dummy step's time
depends on besides the machine).
"""

from __future__ import annotations

import os
import time

import torch

from deepinfer import probe_cache
from deepinfer.engine.cost_model import features
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.step_threads import StepThreads, choose_step_threads
from deepinfer.models.layers import Linear
from deepinfer.protocol import SamplingParams
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

# (model dir, dtype, threads, OMP_WAIT_POLICY, GOMP_SPINCOUNT) -> the timed choice, once per process
_STEP_THREADS: dict[tuple, StepThreads] = {}

# calibrate's shapes, [(new tokens, context tokens)] per dummy sequence: prefills of 16..256 tokens at
# contexts 0..2048, decode batches of 1..16 at contexts 128..1024 (seconds of compute on 2 CPU cores);
# the first is a warm-up, not recorded
CALIBRATION_SHAPES = [[(16, 0)], [(16, 0)], [(64, 0)], [(256, 0)], [(64, 1024)], [(128, 512)], [(256, 2048)],
                      [(1, 128)], [(1, 1024)] * 8, [(1, 256)] * 16, [(1, 512)] * 4]


def probe_key(engine) -> list:
    """What a dummy step's time depends on besides the machine (``probe_cache``)."""
    cfg = engine.config
    bf16w_rows = max((m.bf16w_max_rows for m in engine.model.modules() if isinstance(m, Linear)), default=0)
    return [engine.fingerprint, cfg.dtype, cfg.block_size, cfg.batch_invariant, cfg.packed_weights,
            str(engine.kernels), bf16w_rows]


def time_dummy_step(engine, pieces: list[tuple[int, int]], threads: int | None = None) -> float | None:
    """Seconds of one forward pass of ``engine`` (an ``LLMEngine``) feeding ``pieces`` [(new tokens,
    context tokens)], one dummy sequence each, on ``threads`` intra-op threads (default:
    ``engine.step_threads``' choice for the step); None when they do not fit the KV cache or
    ``max_model_len``."""
    bm, seqs = engine.block_manager, []
    for i, (n, c) in enumerate(pieces):
        seq = Sequence(f"__calibrate_{i}", [0] * (c + n), c + n, SamplingParams(max_tokens=1))
        if c + n > engine.max_model_len or not bm.can_allocate(seq, c + n):
            break
        bm.allocate(seq, c + n)
        seq.num_computed_tokens, seq.num_scheduled_tokens = c, n
        seqs.append(seq)
    seconds = None
    if len(seqs) == len(pieces):
        torch.set_num_threads(threads or engine.step_threads.threads_for(sum(n for n, _ in pieces)))
        t0 = time.perf_counter()
        engine.runner.run(seqs)
        seconds = time.perf_counter() - t0
        torch.set_num_threads(engine.step_threads.max_threads)
    for seq in seqs:
        bm.free(seq)
    return seconds


def calibrate(engine) -> None:
    """Fit ``engine.cost_model`` from timed forward passes of ``CALIBRATION_SHAPES``."""
    key = [*probe_key(engine), engine.step_threads.single_max_tokens]
    warmed = False

    def measure(pieces: list[tuple[int, int]]) -> float | None:
        nonlocal warmed
        if not warmed:  # the first timed step of a process warms up, once
            time_dummy_step(engine, CALIBRATION_SHAPES[0])
            warmed = True
        return time_dummy_step(engine, pieces)

    for pieces in CALIBRATION_SHAPES[1:]:
        seconds = probe_cache.measured("calibrate", [*key, pieces], lambda: measure(pieces))
        if seconds is not None:
            engine.cost_model.samples.append((features(pieces), seconds))
    if len(engine.cost_model.samples) >= 3:
        engine.cost_model.fit()


def choose_engine_step_threads(engine) -> StepThreads:
    """``EngineConfig.single_thread_max_tokens``, or (None) timed on dummy steps: decode batches at
    context 128 (``step_threads.choose_step_threads``; once per process for a model, dtype, thread
    count and wait policy). Logged as ``step threads chosen``."""
    cfg, threads = engine.config, torch.get_num_threads()
    if cfg.single_thread_max_tokens is not None or cfg.batch_invariant:  # (a row's bits may depend on threads)
        return StepThreads(threads, cfg.single_thread_max_tokens or 0, reason="configured")
    key = (str(engine.model_dir), cfg.dtype, threads, os.environ.get("OMP_WAIT_POLICY"),
           os.environ.get("GOMP_SPINCOUNT"))
    if key not in _STEP_THREADS:
        def measure(n: int, t: int) -> float:
            pieces = [(1, 128)] * n
            times = [time_dummy_step(engine, pieces, t) for _ in range(4)][1:]  # the first warms up
            return float("inf") if None in times else min(times)  # inf: the batch does not fit

        def time_step(n: int, t: int) -> float:
            return probe_cache.measured("step", [*probe_key(engine), n, t], lambda: measure(n, t))
        engine.step_threads = StepThreads(threads)  # (the dummy steps' default)
        _STEP_THREADS[key] = choose_step_threads(time_step, threads)
        log.info("step threads chosen", **_STEP_THREADS[key].log_fields())
    return _STEP_THREADS[key]
