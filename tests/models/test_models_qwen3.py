"""Qwen3 dense in the engine against transformers' Qwen3ForCausalLM on the same tiny random weights."""

import pytest
import torch

from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from model_helpers import save_tiny, prompts, hf_greedy, engine_greedy

NEW_TOKENS = 12
PROMPT_LENS = [5, 23, 40]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import Qwen3Config

    path = tmp_path_factory.mktemp("qwen3")
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=False)
    return path, save_tiny(path, config)


def test_qwen3_batched_greedy_matches_transformers(qwen3):
    path, hf = qwen3
    ps = prompts(512, PROMPT_LENS)
    engine = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=4 << 20))
    assert type(engine.model).__name__ == "Qwen3ForCausalLM"
    out = engine_greedy(engine, ps, NEW_TOKENS)
    assert engine.peak_batch_size == len(ps)
    assert out == [hf_greedy(hf, p, NEW_TOKENS) for p in ps]
    assert len({t for o in out for t in o}) >= 2 * len(ps)  # random weights, yet not one repeated token


def test_qwen3_loads_per_head_qk_norms(qwen3):
    path, hf = qwen3
    engine = LLMEngine(path, EngineConfig(block_size=8, kv_cache_bytes=1 << 20))
    ours = engine.model.model.layers[1].self_attn.k_norm.weight
    assert torch.equal(ours, hf.model.layers[1].self_attn.k_norm.weight)
