"""``probe_cache``: start-up timings kept on disk per machine and settings, so the next process reads
them; an engine built with the cache warm times nothing and makes the same choices."""

import json
import os

import pytest
import torch

from deepinfer import probe_cache
from deepinfer.engine import calibration
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.models import layers
from deepinfer.models.convert import ensure_default_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_PROBE_CACHE", str(tmp_path))
    return tmp_path


def counting(value):
    calls = []

    def measure():
        calls.append(1)
        return value

    measure.calls = calls
    return measure


def test_a_timing_is_measured_once_then_read_from_the_file(cache):
    first = counting([0.5, 1.25])
    assert probe_cache.measured("linears", [[576, 192, 2], "torch.float32"], first) == [0.5, 1.25]
    again = counting([9.0, 9.0])
    assert probe_cache.measured("linears", [[576, 192, 2], "torch.float32"], again) == [0.5, 1.25]
    assert len(first.calls) == 1 and again.calls == []
    other_key = counting(2.0)
    assert probe_cache.measured("linears", [[576, 192, 2], "torch.bfloat16"], other_key) == 2.0
    assert probe_cache.measured("step", [[576, 192, 2], "torch.float32"], counting(3.0)) == 3.0  # other kind
    (path,) = cache.glob("*.json")
    data = json.loads(path.read_text())
    assert data["machine"] == probe_cache.machine() and len(data["entries"]) == 3


def test_other_settings_or_an_old_entry_are_timed_again(cache, monkeypatch):
    probe_cache.measured("step", [1], counting(1.0))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE" if os.environ.get("OMP_WAIT_POLICY") != "ACTIVE" else "PASSIVE")
    assert probe_cache.measured("step", [1], counting(2.0)) == 2.0  # another wait policy: another file
    assert len(list(cache.glob("*.json"))) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert probe_cache.measured("step", [1], counting(3.0)) == 3.0  # other thread count
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(probe_cache, "MAX_AGE_S", 0.0)
    assert probe_cache.measured("step", [1], counting(4.0)) == 4.0  # too old: timed again


def test_off_or_broken_the_cache_only_costs_the_timing(cache, monkeypatch):
    monkeypatch.setenv("DEEPINFER_PROBE_CACHE", "0")
    measure = counting(1.0)
    assert probe_cache.measured("step", [1], measure) == probe_cache.measured("step", [1], measure) == 1.0
    assert len(measure.calls) == 2 and not list(cache.iterdir())
    monkeypatch.setenv("DEEPINFER_PROBE_CACHE", str(cache))
    probe_cache.measured("step", [1], counting(1.0))
    (path,) = cache.glob("*.json")
    path.write_text("{not json")
    assert probe_cache.measured("step", [1], counting(5.0)) == 5.0  # unreadable: timed, rewritten
    assert probe_cache.measured("step", [1], counting(6.0)) == 5.0
    blocked = cache / "file"
    blocked.write_text("")
    monkeypatch.setenv("DEEPINFER_PROBE_CACHE", str(blocked / "sub"))  # cannot be created
    assert probe_cache.measured("step", [1], counting(7.0)) == 7.0


def test_an_engine_started_on_a_warm_cache_times_nothing_and_chooses_the_same(cache, monkeypatch):
    """The first engine's timings (faked here, to be quick and distinct) fill the cache; a second
    one, as in a new process, reads every one of them (its own timers would give other figures)."""
    model_dir = ensure_default_model(progress=False)
    config = dict(kv_cache_bytes=64 << 20, calibrate=True, dtype="float32")

    def fake_timers(seconds_per_token: float, rows: int):
        timed = []
        monkeypatch.setattr(calibration, "time_dummy_step", lambda engine, pieces, threads=None: timed.append(pieces)
                            or seconds_per_token * sum(n + c / 64 for n, c in pieces) * (1.5 if threads == 1 else 1))
        monkeypatch.setattr(layers, "_measure_crossover", lambda layer, grid: timed.append(layer) or rows)
        monkeypatch.setattr(calibration, "_STEP_THREADS", {})  # as in a new process
        monkeypatch.setattr(layers, "_PACKED_ROWS", {})
        return timed

    timed = fake_timers(1e-3, 64)
    first = LLMEngine(model_dir, EngineConfig(**config))
    assert timed and first.cost_model.samples and {m.packed_max_rows for m in first.model.modules()
                                         if isinstance(m, layers.Linear)} == {64}
    timed = fake_timers(9.0, 8)
    second = LLMEngine(model_dir, EngineConfig(**config))
    assert timed == []
    assert second.step_threads.seconds == first.step_threads.seconds
    assert second.step_threads.single_max_tokens == first.step_threads.single_max_tokens
    assert {m.packed_max_rows for m in second.model.modules() if isinstance(m, layers.Linear)} == {64}
    assert list(second.cost_model.samples) == list(first.cost_model.samples)
    monkeypatch.setenv("DEEPINFER_PROBE_CACHE", "0")
    timed = fake_timers(9.0, 8)
    LLMEngine(model_dir, EngineConfig(**config))
    assert timed  # off: timed again


def test_a_timing_that_could_not_run_is_not_kept(cache):
    for key, failed in enumerate((None, float("inf"))):  # e.g. a dummy step that did not fit the KV cache
        assert probe_cache.measured("step", [key], counting(failed)) == failed
        again = counting(2.0)
        assert probe_cache.measured("step", [key], again) == 2.0 and again.calls == [1]


def test_processes_that_start_together_time_each_thing_once(cache):
    """Two at once (threads here; the lock is a file lock, so processes alike): one times, the
    other waits for it and reads its figure, instead of timing on the same cores meanwhile."""
    import threading
    import time

    calls, results = [], []

    def slow():
        calls.append(threading.get_ident())
        time.sleep(0.3)
        return 0.25

    threads = [threading.Thread(target=lambda: results.append(probe_cache.measured("step", ["shared"], slow)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [0.25, 0.25] and len(calls) == 1
    nested = probe_cache.measured("step", ["outer"], lambda: probe_cache.measured("step", ["inner"], lambda: 1.5))
    assert nested == 1.5  # a timing inside a timing does not wait on its own lock
