"""Mixture-of-Experts families in the engine against transformers on the same tiny random weights:
Qwen2-MoE (shared expert behind a sigmoid gate, a dense layer via mlp_only_layers), Qwen3-MoE, and
GPT-OSS (attention sinks, sliding/full layers with an 8-token window, YaRN RoPE, fused experts)."""

import pytest
import torch

from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.models.moe import SparseMoeBlock
from model_helpers import save_tiny, prompts, hf_greedy, engine_greedy

NEW_TOKENS = 12
PROMPT_LENS = [5, 23, 40]
NUM_EXPERTS, TOP_K = 8, 2


COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
              num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    from transformers import Qwen2MoeConfig

    path = tmp_path_factory.mktemp("qwen2_moe")
    config = Qwen2MoeConfig(**COMMON, shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1])
    return path, save_tiny(path, config)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig

    path = tmp_path_factory.mktemp("qwen3_moe")
    config = Qwen3MoeConfig(**COMMON, head_dim=16, norm_topk_prob=True)
    return path, save_tiny(path, config)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from transformers import GptOssConfig

    path = tmp_path_factory.mktemp("gpt_oss")
    config = GptOssConfig(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          initializer_range=0.2, num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                          sliding_window=8, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 8.0,
                                           "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "truncate": False})
    return path, save_tiny(path, config)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"])
def test_moe_batched_greedy_matches_transformers(family, cfg, request):
    path, hf = request.getfixturevalue(family)
    ps = prompts(512, PROMPT_LENS)
    engine = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=4 << 20, **cfg))
    out = engine_greedy(engine, ps, NEW_TOKENS)
    assert out == [hf_greedy(hf, p, NEW_TOKENS) for p in ps]
    assert len({t for o in out for t in o}) >= 2 * len(ps)  # random weights, yet not one repeated token


def test_qwen2_moe_layers_follow_mlp_only_layers(qwen2_moe):
    path, _ = qwen2_moe
    model = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=1 << 20)).model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == [True, False, True]
    assert model.model.layers[0].mlp.shared_expert is not None


def test_expert_counts_add_up_to_routed_tokens_and_reset(qwen3_moe):
    path, _ = qwen3_moe
    engine = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=4 << 20, enable_prefix_caching=False))
    model = engine.model
    model.reset_expert_counts()
    ps = prompts(512, PROMPT_LENS)
    engine_greedy(engine, ps, NEW_TOKENS)
    counts = model.expert_counts()  # [moe layers, experts]
    fed = sum(PROMPT_LENS) + len(ps) * (NEW_TOKENS - 1)  # prompts once, then each sampled token but the last
    assert counts.shape == (3, NUM_EXPERTS) and counts.dtype == torch.int64
    assert counts.sum(1).tolist() == [fed * TOP_K] * 3
    assert (counts > 0).sum() > NUM_EXPERTS  # routing spreads over experts
    model.reset_expert_counts()
    assert model.expert_counts().sum() == 0


def test_gpt_oss_loads_sinks_windows_and_fused_experts(gpt_oss):
    path, hf = gpt_oss
    model = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=1 << 20)).model
    assert [a.sliding_window for a in model.attention_layers] == [8, None, 8]
    assert torch.equal(model.model.layers[2].self_attn.sinks, hf.model.layers[2].self_attn.sinks)
    assert torch.equal(model.model.layers[1].mlp.experts.gate_up_proj, hf.model.layers[1].mlp.experts.gate_up_proj)
