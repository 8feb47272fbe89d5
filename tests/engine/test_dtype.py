"""``--dtype auto``: the start-up choice between fp32 and bf16 (each branch by a fake probe), the
engine it builds, and bf16 greedy output against ``transformers`` in bf16 on the same weights."""

import pytest
import torch

from deepinfer.engine import dtype_choice
from deepinfer.engine.dtype_choice import PROBE_ROWS, Bf16WeightsChoice, choose_dtype, linear_shapes, time_linears
from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.kernels import cpu_gemv
from deepinfer.kvstore.hashing import model_fingerprint
from deepinfer.models.config import ModelConfig
from deepinfer.models.convert import ensure_default_model
from deepinfer.models.layers import Linear, bf16_gemm_supported
from deepinfer.protocol import SamplingParams

from model_helpers import engine_greedy


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def cfg(model_dir):
    return ModelConfig.from_dir(model_dir)


def fake_probe(bf16_factor):
    """A CPU on which bf16 GEMMs take ``bf16_factor`` times fp32's at every row count."""
    calls = []

    def probe(shapes, dtype):
        calls.append(dtype)
        factor = bf16_factor if dtype == torch.bfloat16 else 1.0
        return {m: 0.001 * m * factor for m in PROBE_ROWS}

    probe.calls = calls
    return probe


def test_auto_picks_bf16_where_the_probe_says_it_is_faster(cfg):
    probe = fake_probe(0.4)
    choice = choose_dtype(cfg, "auto", bf16_supported=lambda: True, probe=probe)
    assert choice.dtype == "bfloat16" and probe.calls == [torch.float32, torch.bfloat16]
    assert "0.40x" in choice.reason and set(choice.seconds) == {"float32", "bfloat16"}
    assert choice.log_fields()["probe_ms"]["bfloat16"][1] == pytest.approx(0.4)


def test_auto_keeps_fp32_where_bf16_is_slower_or_not_clearly_faster(cfg):
    choice = choose_dtype(cfg, "auto", bf16_supported=lambda: True, probe=fake_probe(2.5))
    assert choice.dtype == "float32" and "2.50x" in choice.reason
    # near parity (workers timing apart could choose differently): fp32
    assert choose_dtype(cfg, "auto", bf16_supported=lambda: True, probe=fake_probe(0.9)).dtype == "float32"


def test_auto_keeps_fp32_without_a_bf16_gemm_and_in_batch_invariant_mode(cfg):
    probe = fake_probe(0.1)
    assert choose_dtype(cfg, "auto", bf16_supported=lambda: False, probe=probe).dtype == "float32"
    assert choose_dtype(cfg, "auto", batch_invariant=True, bf16_supported=lambda: True, probe=probe).dtype \
        == "float32"
    assert probe.calls == []  # nothing timed: there was no choice to make


def test_an_explicit_dtype_is_kept_and_a_bad_one_refused(cfg):
    probe = fake_probe(0.1)
    for name in ("float32", "bfloat16"):
        assert choose_dtype(cfg, name, bf16_supported=lambda: False, probe=probe).dtype == name
    assert probe.calls == []
    with pytest.raises(ValueError, match="dtype must be"):
        choose_dtype(cfg, "int8")


def test_the_probe_times_the_models_linear_shapes(cfg):
    shapes = linear_shapes(cfg)
    assert (cfg.hidden_size, cfg.vocab_size, 1) in shapes
    assert sum(n for *_, n in shapes) == 7 * cfg.num_hidden_layers + 1  # q, k, v, o, gate, up, down; head
    small = [(64, 96, 3), (96, 64, 1)]
    seconds = time_linears(small, torch.float32, rows=(1, 8))
    assert set(seconds) == {1, 8} and all(s > 0 for s in seconds.values())


@pytest.mark.skipif(not bf16_gemm_supported(), reason="no oneDNN bf16 GEMM on this CPU")
def test_packed_bf16_linear_equals_plain_bf16():
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=True).to(torch.bfloat16)
    assert layer.pack() and layer.packed.dtype == torch.bfloat16
    for m in (1, 5, 40):
        x = torch.randn(m, 96, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        assert torch.allclose(layer.packed_forward(x).float(), ref, atol=0.1, rtol=0.02)


def test_engine_resolves_auto_and_keys_its_kv_by_the_chosen_dtype(model_dir, monkeypatch):
    """The engine builds what the choice says (weights, KV cache, fingerprint), for each branch."""
    fp = {}
    # (auto's third branch, bf16 weights when fp32 is kept, has its own tests: test_bf16_weights.py)
    monkeypatch.setattr(dtype_choice, "choose_bf16_weight_rows", lambda _time, **_: Bf16WeightsChoice(0, "fake"))
    for factor, want, torch_dtype in ((0.5, "bfloat16", torch.bfloat16), (2.0, "float32", torch.float32)):
        monkeypatch.setattr(dtype_choice, "time_linears", fake_probe(factor))
        monkeypatch.setattr(dtype_choice, "bf16_gemm_supported", lambda: True)
        engine = LLMEngine(model_dir, EngineConfig(dtype="auto", kv_cache_bytes=16 << 20))
        assert engine.config.dtype == want and engine.dtype_choice.dtype == want
        assert engine.runner.kv_cache.dtype == torch_dtype
        assert next(engine.model.parameters()).dtype == torch_dtype
        assert engine.fingerprint == model_fingerprint(model_dir, want, 16)
        fp[want] = engine.fingerprint
    assert fp["bfloat16"] != fp["float32"]  # a bf16 block is never read as fp32


def test_bf16_prefill_export_is_bf16_and_decodes_the_same_as_one_engine(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "Name a large ocean. " * 6}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    cfg = dict(dtype="bfloat16", kv_cache_bytes=32 << 20)
    (whole,) = engine_greedy(LLMEngine(model_dir, EngineConfig(**cfg)), [ids], 12)
    pre = LLMEngine(model_dir, EngineConfig(prefill_only=True, **cfg))
    pre.add_request("a", ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    (first,) = pre.step()
    assert first.kv_blocks.dtype == torch.bfloat16
    dec = LLMEngine(model_dir, EngineConfig(**cfg))
    dec.add_request("a", ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                    output_token_ids=first.new_token_ids, kv_blocks=first.kv_blocks,
                    num_kv_tokens=first.num_kv_tokens)
    rest = []
    while dec.has_unfinished():
        for o in dec.step():
            rest += o.new_token_ids
    assert first.new_token_ids + rest == whole


needs_kernel = pytest.mark.skipif(not cpu_gemv.available(), reason=f"no bf16-weights kernel: {cpu_gemv.unavailable_reason()}")


@needs_kernel
def test_a_bf16_linear_through_the_kernel_rounds_like_the_bf16_gemm():
    """Steps of few rows of a bf16 model may run ``kernels.cpu_gemv`` on the bf16 weights in place
    (fp32 sums, output rounded to bf16): the exact product rounded once, as oneDNN's bf16 GEMM
    gives up to its own summation order."""
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=True).to(torch.bfloat16)
    assert layer.keep_bf16_weight() and layer.weight_bf16.data_ptr() == layer.weight.data_ptr()
    for m in (1, 3, 8):
        x = torch.randn(m, 96, dtype=torch.bfloat16)
        layer.bf16w_max_rows = 0
        gemm = layer(x)
        layer.bf16w_max_rows = 8
        ours = layer(x)
        exact = (x.double() @ layer.weight.double().T + layer.bias.double()).float()
        assert ours.dtype == torch.bfloat16 and ours.shape == (m, 80)
        assert torch.allclose(ours.float(), exact, rtol=2 ** -8, atol=1e-3)  # within one bf16 rounding
        assert torch.allclose(ours.float(), gemm.float(), rtol=2 ** -7, atol=2e-3)


@needs_kernel
def test_a_bf16_engine_reads_its_weights_through_the_kernel_where_the_probe_says_so(model_dir, monkeypatch):
    """bf16: the kernel is timed against oneDNN's bf16 GEMM (taken when faster at all: only the
    kernel changes, not the weights); chosen, every linear layer reads its own weight in place and
    the dtype and KV cache stay bf16; not chosen, nothing is kept. Batch-invariant mode never asks."""
    asked = []
    for rows in (8, 0):
        monkeypatch.setattr(dtype_choice, "choose_bf16_weight_rows",
                            lambda _time, rows=rows, **kw: asked.append(kw) or Bf16WeightsChoice(rows, "fake"))
        engine = LLMEngine(model_dir, EngineConfig(dtype="bfloat16", kv_cache_bytes=16 << 20))
        assert engine.config.dtype == "bfloat16" and engine.runner.kv_cache.dtype == torch.bfloat16
        linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
        if rows:
            assert all(m.bf16w_max_rows == 8 and m.weight_bf16.data_ptr() == m.weight.data_ptr() for m in linears)
        else:
            assert all(m.weight_bf16 is None and m.bf16w_max_rows == 0 for m in linears)
    assert asked == [{"baseline": "bf16 GEMM", "first_max_ratio": 1.0}] * 2
    LLMEngine(model_dir, EngineConfig(dtype="bfloat16", kv_cache_bytes=16 << 20, batch_invariant=True))
    assert len(asked) == 2


# bf16 on a CPU without a bf16 GEMM (AVX2 only) runs torch's reference matmul, ~100x slower than fp32
# (both transformers and a bf16 engine): there the agreement is measured on fewer prompts and tokens
BF16_PROMPTS, BF16_TOKENS = (5, 32) if bf16_gemm_supported() else (2, 12)


@pytest.fixture(scope="module")
def bf16_prompts_and_refs(model_dir):
    """``BF16_PROMPTS`` chat prompts and ``transformers``' greedy output for each in bf16 (to EOS or
    ``BF16_TOKENS`` tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    texts = ["What is the capital of France?", "List three primary colors.", "Write a haiku about the sea.",
             "Explain photosynthesis in one sentence.", "Summarise this: " + "The quick brown fox jumps. " * 12]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for t in texts[:BF16_PROMPTS]]
    with torch.inference_mode():
        refs = [hf.generate(torch.tensor([p]), max_new_tokens=BF16_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    return prompts, refs


@pytest.mark.parametrize("kernel_rows", [0, pytest.param(16, marks=needs_kernel)], ids=["bf16-gemm", "cpu-gemv"])
def test_bf16_greedy_agrees_with_transformers_in_bf16(model_dir, bf16_prompts_and_refs, kernel_rows, monkeypatch,
                                                      capsys):
    """Greedy decoding in bf16 on the same weights as ``transformers`` in bf16, decode steps on
    oneDNN's bf16 GEMM or on ``kernels.cpu_gemv``. bf16 rounding differs between any two
    implementations (GEMM blocking, fused ops), so a near-tie can flip a token and the texts part
    from there: the agreement is reported, and pinned loosely (every first token equal, most
    tokens in common prefixes)."""
    prompts, refs = bf16_prompts_and_refs
    monkeypatch.setattr(dtype_choice, "choose_bf16_weight_rows", lambda _t, **_: Bf16WeightsChoice(kernel_rows, "forced"))
    calls = []
    kernel = cpu_gemv.linear_bf16w
    monkeypatch.setattr(cpu_gemv, "linear_bf16w", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    ours = engine_greedy(LLMEngine(model_dir, EngineConfig(dtype="bfloat16", kv_cache_bytes=64 << 20)),
                         prompts, BF16_TOKENS, ignore_eos=False)
    assert (len(calls) > 0) == (kernel_rows > 0)  # decode steps went through the kernel when chosen
    common = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), min(len(r), len(o)))
              for r, o in zip(refs, ours)]
    exact = sum(r == o for r, o in zip(refs, ours))
    agreement = sum(common) / sum(len(r) for r in refs)
    with capsys.disabled():
        print(f"\nbf16 ({'cpu_gemv' if kernel_rows else 'bf16 GEMM'}) vs transformers bf16: {exact}/{len(prompts)} "
              f"outputs equal, common prefix {sum(common)}/{sum(len(r) for r in refs)} tokens ({agreement:.0%}); "
              f"per prompt {common}")
    assert all(r[0] == o[0] for r, o in zip(refs, ours))
    assert agreement >= 0.5
