"""Expert placements in the engine's MoE layers: replicas, EP rank accounting, memory,
and model outputs that no placement changes (tiny random Qwen2-MoE, Qwen3-MoE and GPT-OSS)."""

import pytest
import torch

from deepinfer.balancer.eplb import rebalance_experts
from deepinfer.engine import dtype_choice
from deepinfer.engine.dtype_choice import Bf16WeightsChoice
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.kernels import cpu_gemv
from deepinfer.models.layers import Linear
from deepinfer.engine.sequence import Sequence
from deepinfer.models.expert_placement import ExpertPlacement
from deepinfer.protocol import SamplingParams
from model_helpers import engine_greedy, prompts, save_tiny

E, TOP_K, LAYERS, HIDDEN, MOE_I = 8, 2, 2, 64, 32
COMMON = dict(vocab_size=512, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=MOE_I,
              num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.2, num_experts=E, num_experts_per_tok=TOP_K, tie_word_embeddings=False)
PROMPT_LENS = [7, 30, 19, 44]


def build(family, path):
    from transformers import GptOssConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if family == "qwen2_moe":
        return save_tiny(path, Qwen2MoeConfig(**COMMON, shared_expert_intermediate_size=48, norm_topk_prob=False))
    if family == "qwen3_moe":
        return save_tiny(path, Qwen3MoeConfig(**COMMON, head_dim=16, norm_topk_prob=True))
    return save_tiny(path, GptOssConfig(vocab_size=512, hidden_size=HIDDEN, intermediate_size=MOE_I,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, max_position_embeddings=256, initializer_range=0.2,
                                        num_local_experts=E, num_experts_per_tok=TOP_K, sliding_window=8,
                                        tie_word_embeddings=False))


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe", "gpt_oss"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build(request.param, path)
    return path


def make_engine(path, **cfg):
    return LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=4 << 20, batch_invariant=True,
                                        enable_prefix_caching=False, **cfg))


def all_logits(engine, ps):
    """Logits after every prompt token, all prompts in one forward pass: [sum(lens), vocab] float32."""
    seqs = []
    for i, p in enumerate(ps):
        seq = Sequence(f"t{i}", list(p), len(p), SamplingParams(max_tokens=1))
        engine.block_manager.allocate(seq, len(p))
        seq.num_computed_tokens, seq.num_scheduled_tokens = 0, len(p)
        seqs.append(seq)
    inputs = engine.runner.prepare(seqs)
    inputs.logits_index = torch.arange(sum(map(len, ps)))
    try:
        return engine.runner.execute(inputs)
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)


def random_placement(num_slots, num_ranks, seed, version):
    """Every expert once, the spare slots random experts, all shuffled, per layer."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(LAYERS):
        row = torch.cat([torch.arange(E), torch.randint(0, E, (num_slots - E,), generator=g)])
        rows.append(row[torch.randperm(num_slots, generator=g)])
    return ExpertPlacement.from_phy2log(torch.stack(rows), E, num_ranks, version)


def expected_rank_counts(counts, placement):
    """Round-robin from a fresh cursor: replica j of an expert with n pairs and c replicas gets
    n // c + (j < n % c) pairs; summed over each rank's slots. [L, P]."""
    out = torch.zeros(placement.num_layers, placement.num_ranks, dtype=torch.int64)
    for layer in range(placement.num_layers):
        for e in range(E):
            n, c = int(counts[layer, e]), int(placement.logcnt[layer, e])
            for j in range(c):
                slot = int(placement.log2phy[layer, e, j])
                out[layer, slot // placement.slots_per_rank] += n // c + (j < n % c)
    return out


def test_logits_are_identical_under_any_placement(model_dir):
    engine = make_engine(model_dir)
    model = engine.model
    ps = prompts(512, PROMPT_LENS)
    original = [[t.clone() for t in b.slot_tensors(e)] for b in model.moe_blocks() for e in range(E)]
    model.reset_expert_counts()
    reference = all_logits(engine, ps)
    counts = model.expert_counts().clone()
    assert counts.sum() == sum(PROMPT_LENS) * TOP_K * LAYERS
    eplb = ExpertPlacement(*rebalance_experts(counts, 12, num_ranks=4), num_ranks=4, version=2)
    for placement in (ExpertPlacement.identity(LAYERS, E, 4), eplb, random_placement(16, 4, seed=5, version=3),
                      random_placement(16, 2, seed=6, version=4), ExpertPlacement.identity(LAYERS, E, 1)):
        model.apply_expert_placement(placement)
        assert torch.equal(model.expert_placement().phy2log, placement.phy2log)
        # every slot holds a copy of its logical expert's weights
        for i, block in enumerate(model.moe_blocks()):
            for slot, e in enumerate(placement.phy2log[i].tolist()):
                assert all(torch.equal(a, b) for a, b in zip(block.slot_tensors(slot), original[i * E + e]))
        logits = all_logits(engine, ps)
        assert torch.equal(logits, reference)
        assert torch.equal(model.expert_counts(), counts)  # routing is untouched
        assert torch.equal(model.rank_counts(), expected_rank_counts(counts, placement))
        model.reset_expert_counts()
    assert model.expert_memory()[1] == 0  # back to one slot per expert


@pytest.mark.skipif(not cpu_gemv.available(), reason=f"no bf16-weights kernel: {cpu_gemv.unavailable_reason()}")
def test_bf16_weight_copies_follow_the_experts_a_placement_moves(model_dir, monkeypatch):
    """bfloat16-weights: small steps read bf16 copies of the weights (``Linear.weight_bf16``); a
    placement that moves experts between slots (or adds slots) renews them, so every slot's copy
    holds its new expert and the logits stay those of the unmoved model."""
    monkeypatch.setattr(dtype_choice, "choose_bf16_weight_rows", lambda _t, **_: Bf16WeightsChoice(512, "forced"))
    engine = LLMEngine(model_dir, EngineConfig(block_size=8, kv_cache_bytes=4 << 20, dtype="bfloat16-weights",
                                               enable_prefix_caching=False))
    model = engine.model
    ps = prompts(512, PROMPT_LENS)
    reference = all_logits(engine, ps)
    copies = [m for m in model.modules() if isinstance(m, Linear) and m.weight_bf16 is not None]
    assert copies and all(m.bf16w_max_rows == 512 for m in copies)
    for placement in (random_placement(16, 4, seed=5, version=2), ExpertPlacement.identity(LAYERS, E, 1)):
        model.apply_expert_placement(placement)
        for block in model.moe_blocks():
            for m in block.modules():
                if isinstance(m, Linear) and m.bf16w_max_rows:
                    assert m.weight_bf16 is not None and torch.equal(m.weight_bf16.float(), m.weight)
        assert torch.allclose(all_logits(engine, ps), reference, rtol=1e-4, atol=1e-4)


def test_a_placement_applied_between_steps_keeps_requests_running_with_the_same_tokens(model_dir):
    ps = prompts(512, PROMPT_LENS, seed=4)
    reference = engine_greedy(make_engine(model_dir, async_scheduling=False), ps, 16)
    engine = make_engine(model_dir)  # async scheduling: a forward pass may be in flight
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, sp)
    out = {str(i): [] for i in range(len(ps))}
    steps, applied = 0, []
    while engine.has_unfinished():
        for o in engine.step_async():
            out[o.request_id] += o.new_token_ids
        steps += 1
        if steps in (3, 9):  # twice, mid-decode, with a step in flight
            placement = random_placement(12 if steps == 3 else 16, 4, seed=steps, version=len(applied) + 1)
            applied.append(engine.between_steps(engine.model.apply_expert_placement, placement))
    assert [out[str(i)] for i in range(len(ps))] == reference
    assert engine.model.expert_placement_version == 2 and all(n > 0 for n in applied)


def test_replicas_cost_their_slots_bytes(model_dir):
    model = make_engine(model_dir).model
    per_expert = (3 * HIDDEN * MOE_I) * 4  # gate, up, down (fp32)
    if model.config.model_type == "gpt_oss":
        per_expert = (HIDDEN * 2 * MOE_I + 2 * MOE_I + MOE_I * HIDDEN + HIDDEN) * 4  # fused, with biases
    else:
        per_expert *= 2  # and the packed GEMM copy
    assert model.expert_memory() == (LAYERS * E * per_expert, 0)
    model.apply_expert_placement(random_placement(12, 4, seed=1, version=1))
    assert model.expert_memory() == (LAYERS * E * per_expert, LAYERS * 4 * per_expert)


def test_a_placement_for_another_model_shape_is_refused(model_dir):
    model = make_engine(model_dir).model
    with pytest.raises(ValueError, match="placement for 2 MoE layers x 4 experts"):
        model.apply_expert_placement(ExpertPlacement.identity(LAYERS, 4, 1))
    assert model.expert_placement().num_slots == E
