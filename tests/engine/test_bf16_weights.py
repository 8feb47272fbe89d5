"""``bfloat16-weights``: weights rounded to bf16 with fp32 activations, decode-sized steps reading the
bf16 copies (``kernels.cpu_gemv``): the start-up choice (each branch by a fake probe), the engine it
builds, and greedy output against ``transformers`` in fp32 on the same rounded weights."""

import pytest
import torch

from deepinfer.engine import dtype_choice
from deepinfer.engine.dtype_choice import Bf16WeightsChoice, choose_bf16_weight_rows
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.kernels import cpu_gemv
from deepinfer.models.convert import ensure_default_model
from deepinfer.models.layers import Linear

from model_helpers import engine_greedy

needs_kernel = pytest.mark.skipif(not cpu_gemv.available(), reason=f"no bf16-weights kernel: {cpu_gemv.unavailable_reason()}")


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model(progress=False)


def fake_pass(ratios: dict[int, float]):
    """A CPU on which a pass of m rows from bf16 weights takes ``ratios[m]`` times fp32's."""
    calls = []

    def time_pass(m, bf16):
        calls.append((m, bf16))
        return 0.01 * m * (ratios[m] if bf16 else 1.0)

    time_pass.calls = calls
    return time_pass


def test_the_cut_is_the_last_row_count_at_which_bf16_weights_were_faster():
    probe = fake_pass({1: 0.5, 4: 0.6, 8: 0.9, 16: 1.2, 32: 0.5})
    choice = choose_bf16_weight_rows(probe)
    assert choice.max_rows == 8 and "up to 8 rows" in choice.reason
    assert [m for m, _ in probe.calls] == [1, 1, 4, 4, 8, 8, 16, 16]  # stops at the first loss
    assert choice.log_fields()["probe_ms"][4] == [40.0, 24.0]


def test_no_cut_unless_one_row_is_clearly_faster():
    assert choose_bf16_weight_rows(fake_pass({1: 0.9, 4: 0.5})).max_rows == 0  # near parity: fp32
    choice = choose_bf16_weight_rows(fake_pass({1: 1.5}))
    assert choice.max_rows == 0 and "fp32 kept" in choice.reason


def test_for_a_bf16_model_the_kernel_needs_only_to_be_faster_than_the_bf16_gemm():
    """No dtype changes there (the weights are bf16 already), so no margin against noise between workers."""
    choice = choose_bf16_weight_rows(fake_pass({1: 0.9, 4: 0.95, 8: 1.1}), baseline="bf16 GEMM", first_max_ratio=1.0)
    assert choice.max_rows == 4 and "bf16-weights kernel/bf16 GEMM pass time" in choice.reason
    choice = choose_bf16_weight_rows(fake_pass({1: 1.02}), baseline="bf16 GEMM", first_max_ratio=1.0)
    assert choice.max_rows == 0 and "bf16 GEMM kept" in choice.reason


def test_an_explicit_bf16_weights_dtype_is_kept_and_refused_in_batch_invariant_mode(model_dir):
    from deepinfer.models.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    assert dtype_choice.choose_dtype(cfg, "bfloat16-weights").dtype == "bfloat16-weights"
    with pytest.raises(ValueError, match="batch-invariant"):
        dtype_choice.choose_dtype(cfg, "bfloat16-weights", batch_invariant=True)


def _auto_engine(model_dir, monkeypatch, max_rows: int) -> LLMEngine:
    """An ``auto`` engine on a CPU without bf16 GEMMs whose bf16-weights probe gives ``max_rows``."""
    monkeypatch.setattr(dtype_choice, "bf16_gemm_supported", lambda: False)
    monkeypatch.setattr(dtype_choice, "choose_bf16_weight_rows", lambda _time: Bf16WeightsChoice(max_rows, "fake"))
    return LLMEngine(model_dir, EngineConfig(dtype="auto", kv_cache_bytes=32 << 20, calibrate=False,
                                             single_thread_max_tokens=0))


@needs_kernel
def test_auto_takes_bf16_weights_where_the_probe_says_so_rounds_once_and_keys_kv_apart(model_dir, monkeypatch):
    engine = _auto_engine(model_dir, monkeypatch, 4)
    assert engine.config.dtype == "bfloat16-weights"
    assert engine.runner.kv_cache.dtype == torch.float32
    for p in engine.model.parameters():
        assert p.dtype == torch.float32 and torch.equal(p, p.to(torch.bfloat16).float())  # bf16 values
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    assert all(m.bf16w_max_rows == 4 and torch.equal(m.weight_bf16.float(), m.weight) for m in linears)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied
    fp32 = LLMEngine(model_dir, EngineConfig(dtype="float32", kv_cache_bytes=32 << 20, calibrate=False,
                                             single_thread_max_tokens=0))
    assert fp32.fingerprint != engine.fingerprint  # its blocks are never read as fp32 ones
    assert all(m.weight_bf16 is None for m in fp32.model.modules() if isinstance(m, Linear))


def test_auto_keeps_fp32_untouched_where_the_probe_or_the_kernel_says_no(model_dir, monkeypatch):
    if cpu_gemv.available():
        engine = _auto_engine(model_dir, monkeypatch, 0)
        assert engine.config.dtype == "float32"
        assert all(m.weight_bf16 is None for m in engine.model.modules() if isinstance(m, Linear))
        assert not all(torch.equal(p, p.to(torch.bfloat16).float()) for p in engine.model.parameters())
    monkeypatch.setattr(cpu_gemv, "available", lambda: False)
    engine = _auto_engine(model_dir, monkeypatch, 4)
    assert engine.config.dtype == "float32" and engine.bf16_weights is None


@needs_kernel
def test_bf16_weights_greedy_equals_transformers_fp32_on_the_rounded_weights(model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = []
    kernel = cpu_gemv.linear_bf16w

    def counted(*a, **k):
        calls.append(a[0].shape[0])
        return kernel(*a, **k)

    monkeypatch.setattr(cpu_gemv, "linear_bf16w", counted)
    monkeypatch.setattr(dtype_choice, "choose_bf16_weight_rows", lambda _time: Bf16WeightsChoice(16, "forced"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16))  # the values a bf16 checkpoint holds, computed in fp32
    texts = ["What is the capital of France?", "List three primary colors.", "Write a haiku about the sea.",
             "Summarise this: " + "The quick brown fox jumps. " * 12]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for t in texts]
    n = 24
    with torch.inference_mode():
        refs = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    engine = LLMEngine(model_dir, EngineConfig(dtype="bfloat16-weights", kv_cache_bytes=64 << 20, calibrate=False))
    calls.clear()
    ours = engine_greedy(engine, prompts, n, ignore_eos=False)
    assert ours == refs
    assert calls and max(calls) <= 16  # decode steps went through the kernel; prefill (more rows) did not
