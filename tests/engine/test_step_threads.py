"""Intra-op threads per step: the start-up choice (each branch by a fake probe), the engine
applying it per step, and greedy output that does not depend on it."""

import pytest
import torch

from deepinfer.engine import calibration
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.step_threads import PROBE_TOKENS, StepThreads, choose_step_threads
from deepinfer.models.convert import ensure_default_model

from model_helpers import engine_greedy


def fake_probe(one_thread_factor: dict[int, float]):
    """A host where a step of n tokens takes ``one_thread_factor[n]`` times as long on one
    thread as on all; records the calls."""
    calls = []

    def time_step(n, threads):
        calls.append((n, threads))
        return 0.001 * n * (one_thread_factor[n] if threads == 1 else 1.0)

    time_step.calls = calls
    return time_step


def test_one_thread_wins_small_steps_only():
    probe = fake_probe({1: 0.6, 16: 0.7, 64: 1.3, 256: 0.5})
    choice = choose_step_threads(probe, 2, tokens=(1, 16, 64, 256))
    assert choice.single_max_tokens == 16
    assert [choice.threads_for(n) for n in (1, 16, 17, 64, 300)] == [1, 1, 2, 2, 2]
    assert (256, 1) not in probe.calls  # probing stops at the first size where one thread lost
    assert "16 tokens 0.70x" in choice.reason and choice.seconds[1][16] == pytest.approx(0.0112)


def test_all_threads_win_everywhere():
    probe = fake_probe({n: 1.1 for n in PROBE_TOKENS})
    choice = choose_step_threads(probe, 4)
    assert choice.single_max_tokens == 0 and choice.threads_for(1) == 4
    assert probe.calls == [(1, 1), (1, 4)]


def test_one_thread_wins_everywhere_and_noise_is_not_a_win():
    assert choose_step_threads(fake_probe({n: 0.5 for n in PROBE_TOKENS}), 2).single_max_tokens == PROBE_TOKENS[-1]
    # within MIN_GAIN of each other: all threads stay
    assert choose_step_threads(fake_probe({n: 0.97 for n in PROBE_TOKENS}), 2).single_max_tokens == 0


def test_a_size_that_cannot_be_timed_ends_the_probe():
    probe = fake_probe({1: 0.5, 16: 0.5, 64: 0.5})
    choice = choose_step_threads(lambda n, t: float("inf") if n == 16 else probe(n, t), 2)
    assert choice.single_max_tokens == 1 and (64, 1) not in probe.calls


def test_one_thread_available_times_nothing():
    probe = fake_probe({})
    assert choose_step_threads(probe, 1).threads_for(1000) == 1 and probe.calls == []


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model(progress=False)


def test_engine_applies_the_choice_per_step(model_dir, monkeypatch):
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("needs 2 intra-op threads")
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, single_thread_max_tokens=8,
                                               async_scheduling=False))
    assert engine.step_threads.threads_for(8) == 1 and engine.step_threads.threads_for(9) == threads
    seen.clear()
    engine_greedy(engine, [list(range(100, 130))], 3)  # a 30-token prefill step, then decode steps
    assert seen[0] == threads and set(seen[1:]) == {1}
    real(threads)


def test_engine_times_the_choice_once_per_process(model_dir, monkeypatch):
    threads, calls = torch.get_num_threads(), []

    def fake_choose(time_step, max_threads):
        calls.append(time_step(1, 1) > 0)  # the engine's dummy step runs
        return StepThreads(max_threads, 1, reason="fake")

    monkeypatch.setattr(calibration, "choose_step_threads", fake_choose)
    monkeypatch.setattr(calibration, "_STEP_THREADS", {})
    first = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, num_threads=2))
    second = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, num_threads=2))
    assert calls == [True] and first.step_threads is second.step_threads
    assert first.step_threads.single_max_tokens == 1
    batch_invariant = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, batch_invariant=True))
    assert batch_invariant.step_threads.single_max_tokens == 0 and calls == [True]
    torch.set_num_threads(threads)


def test_greedy_output_does_not_depend_on_the_thread_cut(model_dir):
    prompts = [list(range(200, 240)), list(range(300, 317)), list(range(400, 470))]
    outs = [engine_greedy(LLMEngine(model_dir, EngineConfig(kv_cache_bytes=64 << 20, single_thread_max_tokens=cut)),
                          prompts, 12) for cut in (0, 4096)]
    assert outs[0] == outs[1]
