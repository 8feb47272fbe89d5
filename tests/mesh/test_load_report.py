"""Load reports: what a worker's heartbeat says about its queue, cache and cost model."""

import pytest

from deepinfer.engine.args import add_engine_args, engine_config, mock_config
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.mock import MockConfig
from deepinfer.mesh.args import service_parser
from deepinfer.models.convert import ensure_default_model
from deepinfer.prefill.service import PrefillService
from deepinfer.protocol import LoadReport, SamplingParams, pack, unpack
from deepinfer.protocol.messages import SCHEMA_VERSION

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model(progress=False)


def worker(model_dir, tmp_path, mock: MockConfig | None = MockConfig(), **cfg) -> PrefillService:
    """A prefill worker that is never started (no NATS): its engine and load report only."""
    return PrefillService("nats://127.0.0.1:1", str(model_dir), EngineConfig(prefill_only=True, **cfg),
                          str(tmp_path), "prefill-t", mock=mock, heartbeat_s=0.25)


@pytest.mark.parametrize("mock", [MockConfig(cost=(0.01, 1e-3, 1e-7, 1e-5)), None], ids=["mock", "native"])
def test_queued_prefill_seconds_grow_with_the_prompts_added_and_follow_the_cost_model(model_dir, tmp_path, mock):
    w = worker(model_dir, tmp_path, mock, kv_cache_bytes=128 << 20)
    empty = w.load_report()
    assert (empty.queued_prefill_tokens, empty.queued_prefill_s) == (0, 0.0)
    seen = []
    for i, n in enumerate((100, 400, 1200)):
        w.engine.add_request(str(i), [1000 + i] * n, SP)
        r = w.load_report()
        seen.append(r.queued_prefill_s)
        assert r.waiting_requests == i + 1 and r.queued_prefill_tokens == sum((100, 400, 1200)[: i + 1])
    cm = w.engine.cost_model
    assert seen[0] < seen[1] < seen[2]
    assert seen[2] - seen[1] == pytest.approx(cm.piece_cost(1200, 0))
    assert (r.cost_a, r.cost_b, r.cost_d, r.cost_e) == (cm.a, cm.b, cm.d, cm.e)
    assert r.engine == ("mock" if mock else "native") and r.block_size == 16
    assert r.kv_tokens_capacity == w.engine.kv_tokens_capacity > 0


def test_a_cached_prefix_is_not_counted_as_queued_work_and_shows_in_hit_counts(model_dir, tmp_path):
    w = worker(model_dir, tmp_path, kv_cache_bytes=64 << 20)
    e = w.engine
    prompt = list(range(500, 820))  # 320 tokens = 20 blocks
    e.add_request("a", prompt, SP)
    while e.has_unfinished():
        e.step()
    e.add_request("b", prompt[:-8] + [7, 7, 7, 7, 7, 7, 7, 7], SP)
    r = w.load_report()
    assert r.queued_prefill_tokens == 320 - 19 * 16  # 19 full blocks shared and cached
    assert r.queued_prefill_s == pytest.approx(e.cost_model.piece_cost(320 - 19 * 16, 19 * 16))
    while e.has_unfinished():
        e.step()
    r = w.load_report()
    assert (r.prefix_hit_tokens, r.prefix_queried_tokens) == (19 * 16, 640)
    assert r.queued_prefill_tokens == 0


def test_a_running_chunked_prefill_counts_only_what_is_left(model_dir, tmp_path):
    w = worker(model_dir, tmp_path, kv_cache_bytes=64 << 20, max_num_batched_tokens=128)
    w.engine.add_request("a", [3] * 1000, SP)
    w.engine.step()  # first chunk of 128
    r = w.load_report()
    assert r.active_requests == 1 and r.queued_prefill_tokens == 1000 - 128
    assert r.queued_prefill_s == pytest.approx(w.engine.cost_model.piece_cost(1000 - 128, 128))


def test_new_fields_are_optional_on_the_wire_both_ways():
    new = LoadReport(role="prefill", worker_id="p", queued_prefill_s=1.5, cost_b=1e-3, engine="mock")
    assert unpack(pack(new)) == new
    import msgpack

    old_wire = msgpack.packb({"v": SCHEMA_VERSION, "t": "LoadReport", "role": "decode", "worker_id": "d",
                              "active_requests": 3})
    old = unpack(old_wire)
    assert old.active_requests == 3 and old.queued_prefill_s == 0.0 and old.engine == ""


def test_worker_flags_choose_the_engine_cost_model_and_heartbeat(tmp_path):
    p = service_parser("prefill", "")
    add_engine_args(p)
    cost = tmp_path / "cost.json"
    cost.write_text('{"a": 0.5, "b": 0.25, "d": 0.0, "e": 0.125}')
    args = p.parse_args(["--engine", "mock", "--mock-cost-file", str(cost), "--heartbeat-s", "0.2"])
    assert mock_config(args).cost == (0.5, 0.25, 0.0, 0.125) and args.heartbeat_s == 0.2
    assert engine_config(args, prefill_only=True).num_threads == 1  # mock workers stay light
    args = p.parse_args(["--engine", "mock", "--mock-cost", "1,2,3,4", "--mock-cost-file", str(cost)])
    assert mock_config(args).cost == (1.0, 2.0, 3.0, 4.0)  # the flag wins over the file
    assert mock_config(p.parse_args([])) is None


def test_real_engine_reports_no_queue_once_idle(model_dir):
    e = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=32 << 20))
    e.add_request("a", [5] * 40, SP)
    assert e.queued_prefill()[0] == 40
    while e.has_unfinished():
        e.step()
    assert e.queued_prefill() == (0, 0.0)
