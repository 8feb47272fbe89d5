"""Prompt logprobs in the engine (``SamplingParams.prompt_logprobs``, vLLM's): computed from the prefill
logits, equal to transformers' fp32 log-softmax of the same weights, however the prompt is chunked
and whether or not its prefix is cached (a request that wants them computes its whole prompt);
the mock engine's are deterministic.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.interface import EngineConfig, RequestError
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.mock import MockConfig, MockEngine
from deepinfer.models.convert import ensure_default_model
from deepinfer.protocol import SamplingParams

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a screw press adapted from wine making. ") * 2


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def prompt_ids(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def reference(model_dir, prompt_ids):
    """transformers' fp32 log-softmax at every prompt position: [P, V]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)


def run(engine: LLMEngine, request_id: str, ids: list[int], sampling: SamplingParams, overlapped: bool) -> list:
    engine.add_request(request_id, ids, sampling)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in (engine.step_async() if overlapped else engine.step()) if o.request_id == request_id]
    return outs


def assert_matches(entries: list, ids: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        e = entries[p]
        assert e.token_id == ids[p]
        assert abs(e.logprob - reference[p - 1, ids[p]].item()) < 1e-3, p
        assert len(e.top) == k
        want_vals = reference[p - 1].topk(k).values
        assert [v for _, v in e.top] == pytest.approx(want_vals.tolist(), abs=1e-3)
        assert [reference[p - 1, t].item() for t, _ in e.top] == pytest.approx(want_vals.tolist(), abs=1e-3)


@pytest.mark.parametrize("overlapped", [False, True])
def test_prompt_logprobs_match_transformers_chunked_and_past_a_cached_prefix(model_dir, prompt_ids, reference,
                                                                            overlapped):
    cfg = EngineConfig(dtype="float32", kv_cache_bytes=64 << 20, max_num_batched_tokens=32,
                       single_thread_max_tokens=0)
    engine = LLMEngine(model_dir, cfg)
    assert len(prompt_ids) > 2 * 32  # three chunks at least
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    warm = run(engine, "warm", prompt_ids, greedy, overlapped)
    assert warm[0].prompt_logprobs is None  # not asked, not computed
    outs = run(engine, "scored", prompt_ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                            prompt_logprobs=3), overlapped)
    assert outs[0].num_cached_tokens == 0  # the cached prefix was not read: its positions need logits
    assert_matches(outs[0].prompt_logprobs, prompt_ids, reference, 3)
    assert all(o.prompt_logprobs is None for o in outs[1:])  # with the first token only
    assert outs[0].new_token_ids == warm[0].new_token_ids
    again = run(engine, "again", prompt_ids, greedy, overlapped)
    assert again[0].num_cached_tokens > 0  # the prefix cache still serves requests that do not ask


def test_a_prefill_only_engine_sends_them_with_its_first_token(model_dir, prompt_ids, reference):
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", kv_cache_bytes=64 << 20, prefill_only=True,
                                               single_thread_max_tokens=0))
    (out,) = run(engine, "p", prompt_ids, SamplingParams(max_tokens=8, prompt_logprobs=0), False)
    assert out.finish_reason == "handoff"
    assert_matches(out.prompt_logprobs, prompt_ids, reference, 0)
    wire = out.wire_prompt_logprobs()
    assert wire[0] is None and wire[1] == [out.prompt_logprobs[1].logprob, []]


def test_out_of_range_prompt_logprobs_are_refused(model_dir):
    engine = MockEngine(model_dir, EngineConfig(kv_cache_bytes=16 << 20))
    with pytest.raises(RequestError, match="prompt_logprobs"):
        engine.check_request([1, 2, 3], sampling=SamplingParams(prompt_logprobs=21))


def test_the_mock_engine_gives_deterministic_prompt_logprobs_without_the_cache(model_dir):
    engine = MockEngine(model_dir, EngineConfig(kv_cache_bytes=16 << 20, max_num_batched_tokens=16),
                        MockConfig(cost=(0.0, 0.0, 0.0, 0.0)))
    ids = list(range(100, 150))
    run(engine, "warm", ids, SamplingParams(max_tokens=1), False)
    (out,) = run(engine, "scored", ids, SamplingParams(max_tokens=1, prompt_logprobs=1), True)
    assert out.num_cached_tokens == 0
    assert out.wire_prompt_logprobs() == [None] + [[0.0, [[t, 0.0]]] for t in ids[1:]]
