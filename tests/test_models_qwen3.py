"""Qwen3 dense in the engine against transformers' Qwen3ForCausalLM on the same tiny random weights."""

import pytest
import torch

from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
from deepinfer.protocol import SamplingParams

NEW_TOKENS = 12
PROMPT_LENS = [5, 23, 40]


def save_tiny(tmp_path, config, seed=0):
    """Build a random model from ``config`` and save it like a Hub checkpoint (safetensors).

    Norm weights (1-D) get noise too, so a norm loaded wrongly changes the outputs.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(tmp_path)
    return model


def prompts(vocab, lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def hf_greedy(model, ids, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def engine_greedy(engine, prompt_ids, n):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = {str(i): [] for i in range(len(prompt_ids))}
    for i, ids in enumerate(prompt_ids):
        engine.add_request(str(i), ids, sp)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompt_ids))]


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
