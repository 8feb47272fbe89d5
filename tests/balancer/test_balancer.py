"""Balancer: the moving average and triggers on hand-made reports, and the whole loop
through a real nats-server: MoE decode workers -> stats -> balancer -> placement -> workers."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deepinfer.balancer.service import BalancerService
from deepinfer.balancer.tracker import BalancerConfig, ExpertLoad
from deepinfer.decode.service import DecodeService
from deepinfer.engine.experts import model_id
from deepinfer.engine.interface import EngineConfig
from deepinfer.mesh import MeshClient
from deepinfer.models.expert_placement import ExpertPlacement
from deepinfer.protocol import (BalancerStatus, BalancerStatusRequest, DecodeRequest, ExpertPlacementUpdate,
                                ExpertStats, SamplingParams, subjects, unpack)
from model_helpers import prompts, save_tiny
from waiting import eventually

L, E = 2, 8


def report(counts, worker="w0", version=0, ranks=None, num_ranks=4, num_slots=E):
    counts = torch.as_tensor(counts, dtype=torch.int64)
    if ranks is None:  # identity placement: rank p holds experts [p*E/P, (p+1)*E/P)
        ranks = counts.view(counts.shape[0], num_ranks, -1).sum(2)
    return ExpertStats(model="m", worker_id=worker, role="decode", counts=counts.tolist(), rank_counts=ranks.tolist(),
                       num_ranks=num_ranks, num_slots=num_slots, placement_version=version, window_s=1.0)


SKEWED = [[400, 300, 10, 10, 10, 10, 5, 5], [50, 50, 50, 50, 50, 50, 50, 400]]


def tracker(**cfg):
    cfg = {"redundant_experts": 4, "num_ranks": 4, "period_s": 0, "threshold": 1.1, "min_interval_s": 0,
           "min_tokens": 100, **cfg}
    return ExpertLoad("m", L, E, BalancerConfig(**cfg), ExpertPlacement.identity(L, E, 4), now=0.0)


def test_windows_fold_into_an_exponential_moving_average_summed_over_workers():
    t = tracker(ema_alpha=0.5, threshold=0)
    t.add(report([[10] * E] * L, "w0"))
    t.add(report([[30] * E] * L, "w1"))
    assert t.tick(1.0) is None and torch.equal(t.load, torch.full((L, E), 40.0, dtype=torch.float64))
    t.tick(2.0)  # no reports: the average stays
    t.add(report([[0] * E] * L))
    t.tick(3.0)
    assert torch.equal(t.load, torch.full((L, E), 20.0, dtype=torch.float64))  # 0.5 * 40 + 0.5 * 0


def test_measured_imbalance_above_the_threshold_publishes_a_better_placement_once():
    t = tracker()
    t.add(report(SKEWED))
    placement = t.tick(1.0)
    # identity on 4 ranks, 750 pairs per layer (187.5 per rank): layer 0 ranks hold 700, 20, 20, 10;
    # layer 1 100, 100, 100, 450
    assert t.measured_imbalance == pytest.approx((700 / 187.5 + 450 / 187.5) / 2)
    assert placement is not None and placement.version == 1 and placement.num_slots == 12
    assert t.predicted_imbalance() < t.measured_imbalance
    assert (placement.logcnt[0, :2] > 1).all()  # the two hot experts of layer 0 are replicated
    # same load under the new placement: measured falls, the candidate is the same -> nothing new
    t.add(report(SKEWED, version=1, ranks=torch.tensor([[180, 180, 190, 200], [187, 188, 187, 188]]),
                 num_slots=12))
    assert t.tick(2.0) is None and t.measured_imbalance == pytest.approx((200 / 187.5 + 188 / 187.5) / 2)


def test_no_placement_before_enough_tokens_or_the_interval_or_without_a_trigger():
    t = tracker(min_tokens=10_000)
    t.add(report(SKEWED))
    assert t.tick(1.0) is None  # 760 pairs in layer 0 < 10 000
    t = tracker(min_interval_s=5)
    t.add(report(SKEWED))
    assert t.tick(1.0) is None  # created at 0 s: the first attempt waits 5 s
    t.add(report(SKEWED))
    assert t.tick(6.0) is not None
    t = tracker(threshold=0, period_s=30)
    t.add(report(SKEWED))
    assert t.tick(10.0) is None  # no threshold, period not over
    t.add(report(SKEWED))
    assert t.tick(31.0) is not None


def test_a_balanced_load_is_left_alone():
    t = tracker(threshold=0, period_s=1)
    t.add(report([[100] * E] * L))
    assert t.tick(2.0) is None and t.rebalances == 0  # no gain over the identity placement


def test_a_report_of_another_shape_is_refused():
    t = tracker()
    with pytest.raises(ValueError, match="want 2 x 8"):
        t.add(report([[1] * 4] * L, num_ranks=1, num_slots=4))


def test_an_unknown_current_placement_is_replaced_by_the_first_candidate():
    t = ExpertLoad("m", L, E, BalancerConfig(redundant_experts=4, num_ranks=4, min_interval_s=0, min_tokens=0,
                                             threshold=0, period_s=0), None, now=0.0)
    t.add(report(SKEWED, version=6, num_slots=12, ranks=torch.zeros(L, 4, dtype=torch.int64)))
    placement = t.tick(1.0)
    assert placement is not None and placement.version == 7  # after the newest version workers run


@pytest.mark.parametrize("cfg,match", [
    (dict(redundant_experts=-1), "redundant_experts"), (dict(num_ranks=6, num_nodes=4), "6 EP ranks"),
    (dict(ema_alpha=0), "ema_alpha"), (dict(threshold=0.5), "threshold"), (dict(window_s=0), "window_s"),
])
def test_bad_balancer_config_is_a_value_error(cfg, match):
    with pytest.raises(ValueError, match=match):
        BalancerConfig(**cfg)
    with pytest.raises(ValueError, match="experts do not split evenly into 3 groups"):
        ExpertLoad("m", L, E, BalancerConfig(num_groups=3, num_nodes=1), None, now=0.0)


# --- the loop through NATS ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig

    path = tmp_path_factory.mktemp("qwen3_moe_balancer")
    save_tiny(path, Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                   num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, initializer_range=0.2, num_experts=E,
                                   num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False))
    return path


async def generate(client: MeshClient, worker: str, ps: list[list[int]], tag: str) -> list[list[int]]:
    """Submit every prompt to one decode worker at once; the greedy tokens of each."""
    out = {i: [] for i in range(len(ps))}
    done = asyncio.Event()
    finished = set()

    async def on_chunk(chunk):
        i = int(chunk.request_id.split("-")[1])
        out[i] += chunk.token_ids
        if chunk.finish_reason is not None:
            assert chunk.finish_reason == "length", chunk.error
            finished.add(i)
            if len(finished) == len(ps):
                done.set()

    sub = await client.subscribe(f"test.stream.{tag}.>", on_chunk)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(ps):
        reply = await client.request(subjects.decode_submit(worker), DecodeRequest(
            request_id=f"{tag}-{i}", prompt_token_ids=p, output_token_ids=[], sampling=sp,
            stream_subject=f"test.stream.{tag}.{i}", kv_block_keys=[], num_kv_tokens=0, block_size=8), timeout=10)
        assert reply.accepted, reply.error
    await asyncio.wait_for(done.wait(), 60)
    await sub.unsubscribe()
    return [out[i] for i in range(len(ps))]


async def test_workers_stats_reach_the_balancer_and_its_placement_reaches_every_worker(nats_url, moe_dir, tmp_path):
    client = await MeshClient.connect(nats_url, "balancer-test")
    js = client.nc.jetstream()
    try:  # the session's server may hold a placement of this (deterministic) model from another test
        await js.delete_key_value(subjects.EXPERTS_BUCKET)
    except Exception:
        pass
    seen: list = []

    async def collect(msg):
        seen.append(msg)

    await client.subscribe(subjects.EXPERTS_STATS, collect)
    await client.subscribe(subjects.EXPERTS_PLACEMENT, collect)
    balancer = BalancerService(nats_url, BalancerConfig(redundant_experts=4, num_ranks=4, window_s=0.2,
                                                        period_s=0, threshold=1.05, min_interval_s=0,
                                                        # low: on a loaded host a 0.2 s tick may hold only part
                                                        # of the prompts' routing, and the moving average of the
                                                        # decode windows after it stays small
                                                        min_tokens=50), worker_id="balancer-t")
    cfg = EngineConfig(block_size=8, kv_cache_bytes=4 << 20, batch_invariant=True)

    def worker(i):
        return DecodeService(nats_url, str(moe_dir), cfg, str(tmp_path / "kv"), f"decode-t{i}", heartbeat_s=0.5,
                             expert_stats_s=0.2, ep_ranks=4)

    workers = [worker(0), worker(1)]
    late = None
    try:
        await balancer.start()
        for w in workers:
            await w.start()
        ps = prompts(512, [12, 30, 21, 40, 9, 33], seed=7)
        first = await asyncio.gather(generate(client, "decode-t0", ps, "a0"), generate(client, "decode-t1", ps, "a1"))
        assert first[0] == first[1]

        # the loop: reports -> balancer -> placement -> both workers apply it
        update = await eventually(lambda: next((m for m in seen if isinstance(m, ExpertPlacementUpdate)), None),
                                    timeout=20)
        assert update.model == model_id(moe_dir) and update.version == 1 and update.policy == "global"
        assert update.imbalance_after < update.imbalance_before
        await eventually(lambda: all(w.engine.model.expert_placement_version >= 1 for w in workers), timeout=20)
        balancer.config.threshold = 0  # no more rebalancing from here (period_s is 0 too): a fixed placement
        await asyncio.sleep(3 * balancer.config.window_s)  # a tick in progress publishes
        version = balancer.models[update.model].version
        await eventually(lambda: all(w.engine.model.expert_placement_version == version for w in workers), timeout=20)
        placement = workers[0].engine.model.expert_placement()
        assert placement.num_slots == 12 and placement.num_ranks == 4
        assert torch.equal(workers[1].engine.model.expert_placement().phy2log, placement.phy2log)
        assert workers[0].experts.replica_bytes == 4 * L * workers[0].engine.model.moe_blocks()[0].slot_bytes()

        # same prompts under the new placement: the same tokens, a flatter load over the EP ranks
        again = await asyncio.gather(generate(client, "decode-t0", ps, "b0"), generate(client, "decode-t1", ps, "b1"))
        assert list(again) == list(first)
        await asyncio.sleep(0.5)  # the last window's reports

        def measured(pred):
            ranks = sum(torch.tensor(m.rank_counts) for m in seen if isinstance(m, ExpertStats) and pred(m))
            return float((ranks.max(1).values / ranks.double().mean(1)).mean())

        before, after = measured(lambda m: m.placement_version == 0), measured(lambda m: m.placement_version == version)
        assert after < before, (before, after)
        status = await client.request(subjects.BALANCER_STATUS, BalancerStatusRequest(), timeout=5,
                                      expect=BalancerStatus)
        (model,) = status.models
        assert model["version"] == version and model["workers"] == ["decode-t0", "decode-t1"]
        assert model["replica_bytes"] == workers[0].experts.replica_bytes

        # a worker that starts now reads the latest placement from the KV bucket
        stored = unpack((await (await js.key_value(subjects.EXPERTS_BUCKET)).get(
            subjects.placement_key(update.model))).value)
        assert stored.version == version
        late = worker(2)
        await late.start()
        assert late.engine.model.expert_placement_version == version
        assert torch.equal(late.engine.model.expert_placement().phy2log, placement.phy2log)

        # a placement that does not fit the model (4 experts) or is inconsistent is refused, serving goes on
        bad = ExpertPlacement.identity(L, 4, 2).to_lists()
        await client.publish(subjects.EXPERTS_PLACEMENT, ExpertPlacementUpdate(
            model=update.model, version=version + 1, phy2log=bad["phy2log"], log2phy=bad["log2phy"],
            logcnt=bad["logcnt"], num_ranks=2))
        await client.publish(subjects.EXPERTS_PLACEMENT, ExpertPlacementUpdate(
            model=update.model, version=version + 2, phy2log=[[0] * 12] * L, log2phy=[[[0]] * E] * L,
            logcnt=[[1] * E] * L, num_ranks=4))
        assert await generate(client, "decode-t2", ps, "c2") == first[0]
        await eventually(lambda: all(w.experts.refused == 2 for w in [*workers, late]), timeout=20)
        assert all(w.engine.model.expert_placement_version == version for w in [*workers, late])
    finally:
        for w in [*workers, late]:
            if w is not None:
                await w.stop()
        await balancer.stop()
        await client.close()
