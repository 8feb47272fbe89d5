"""LLaVA (vision tower + projector + Llama decoder) against transformers' LlavaForConditionalGeneration
on the same tiny random weights (``models.tiny_vlm``): image features, full-prompt logits with one
and two images (one sequence, and two packed in one step), text-only prompts, greedy decoding
after an image, and the other checkpoint layouts / configs real LLaVA checkpoints use."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.kernels.attention import build_metadata
from deepinfer.models.config import ModelConfig
from deepinfer.models.llava import LlavaForConditionalGeneration as OurLlava
from deepinfer.models.llava import preprocess
from deepinfer.models.loader import load_model
from deepinfer.models.tiny_vlm import make_tiny_llava
from model_helpers import engine_greedy, hf_greedy, prompts

BLOCK = 8


def images(n, seed=0):
    """Random RGB images of assorted sizes (the processor resizes and crops them)."""
    rng = np.random.default_rng(seed)
    sizes = [(40, 50), (64, 64), (33, 70)]
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % 3], 3), dtype=np.uint8)) for i in range(n)]


def load_with_cache(path):
    """``load_model`` plus a KV cache (64 blocks) attached to its attention layers."""
    model, cfg = load_model(path)
    ModelRunner(model, BLOCK, 64, torch.float32)
    return model, cfg


def chat(n_images, text="Describe this."):
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = make_tiny_llava(tmp_path_factory.mktemp("llava"))
    hf = LlavaForConditionalGeneration.from_pretrained(path).eval()
    engine = LLMEngine(path, EngineConfig(block_size=BLOCK, kv_cache_bytes=4 << 20))
    return path, hf, AutoProcessor.from_pretrained(path), engine


def inputs(proc, n_images, seed=0, text="Describe this."):
    prompt = proc.apply_chat_template(chat(n_images, text), add_generation_prompt=True)
    return proc(images=images(n_images, seed) or None, text=prompt, return_tensors="pt")


def run(model, seqs):
    """One prefill step of packed sequences [(input_ids [T], pixel_values or None)]: logits [sum T, V]."""
    ids = torch.cat([s for s, _ in seqs])
    lens = [len(s) for s, _ in seqs]
    tables, start = [], 0
    for n in lens:
        tables.append(list(range(start, start + -(-n // BLOCK))))
        start += len(tables[-1])
    pixels = [p for _, p in seqs if p is not None]
    override = model.image_embeds_override(ids, model.encode_images(torch.cat(pixels))) if pixels else None
    meta = build_metadata(lens, lens, tables, BLOCK)
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        return model(ids, positions, meta, torch.arange(len(ids)), input_embeds_override=override)


def test_config_and_loader(llava):
    path, hf, proc, engine = llava
    model, cfg = engine.model, engine.model_config
    assert type(model).__name__ == "LlavaForConditionalGeneration" and cfg.model_type == "llava"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size) == (64, 2, 2, 49153)
    assert model.image_token_id == hf.config.image_token_id == proc.tokenizer.convert_tokens_to_ids("<image>")
    assert model.tokens_per_image == 16 and model.image_size == 32
    assert len(model.vision_tower.encoder.layers) == 1  # feature layer -2 of 2: the last layer is never run
    assert cfg.eos_token_ids == [proc.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(model.vision_tower.pre_layrnorm.bias, hf.model.vision_tower.pre_layrnorm.bias)


def test_encode_images_matches_transformers(llava):
    path, hf, proc, engine = llava
    pixels = preprocess(images(3), path)
    assert pixels.shape == (3, 3, 32, 32) and pixels.dtype == torch.float32
    assert torch.equal(pixels, proc.image_processor(images(3), return_tensors="pt")["pixel_values"])
    ours = engine.model.encode_images(pixels)
    with torch.inference_mode():
        ref = torch.stack(hf.get_image_features(pixel_values=pixels).pooler_output)
    assert ours.shape == (3, 16, 64)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0)
    # a pure function of each image's own pixels
    assert torch.allclose(engine.model.encode_images(pixels[1:2])[0], ours[1], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="pixel_values must be"):
        engine.model.encode_images(torch.zeros(1, 3, 24, 24))


@pytest.mark.parametrize("n_images", [1, 2])
def test_prompt_logits_with_images_match_transformers(llava, n_images):
    path, hf, proc, engine = llava
    x = inputs(proc, n_images)
    ids = x["input_ids"][0]
    assert (ids == engine.model.image_token_id).sum() == 16 * n_images
    ours = run(engine.model, [(ids, x["pixel_values"])])
    with torch.inference_mode():
        ref = hf(**x).logits[0]
        text_only = hf(input_ids=x["input_ids"]).logits[0]  # placeholders as plain tokens
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0)
    assert not torch.allclose(ours[-1], text_only[-1], atol=1e-2)  # the image really shapes the logits


def test_packed_step_with_images_and_text_matches_transformers(llava):
    """Three sequences in one step (2 images, none, 1 image): each row's features land on its own rows."""
    path, hf, proc, engine = llava
    xs = [inputs(proc, 2, seed=1), inputs(proc, 0, text="Hello there"), inputs(proc, 1, seed=2, text="What?")]
    ours = run(engine.model, [(x["input_ids"][0], x.get("pixel_values")) for x in xs])
    offset = 0
    for x in xs:
        n = x["input_ids"].shape[1]
        with torch.inference_mode():
            ref = hf(**x).logits[0]
        assert torch.allclose(ours[offset:offset + n], ref, atol=1e-4, rtol=0)
        offset += n


def test_text_only_prompts_equal_the_llama_family(llava, tmp_path):
    """The same text weights saved as a plain LlamaForCausalLM: same greedy tokens, through the engine."""
    from transformers import LlamaForCausalLM

    path, hf, proc, engine = llava
    llama = LlamaForCausalLM(hf.config.text_config).eval()
    llama.model.load_state_dict(hf.model.language_model.state_dict())
    llama.lm_head.load_state_dict(hf.lm_head.state_dict())
    llama.save_pretrained(tmp_path)
    plain = LLMEngine(tmp_path, EngineConfig(block_size=BLOCK, kv_cache_bytes=4 << 20))
    assert type(plain.model).__name__ == "LlamaForCausalLM"
    ps = prompts(49152, [5, 23, 40])
    out = engine_greedy(engine, ps, 8)
    assert out == engine_greedy(plain, ps, 8)
    assert out == [hf_greedy(hf, p, 8) for p in ps]
    assert len({t for o in out for t in o}) >= 6


def our_greedy(model, ids, pixels, n):
    """Prefill with the image features, then decode ``n - 1`` tokens one by one over the KV cache."""
    t = len(ids)
    table = list(range(-(-(t + n) // BLOCK)))
    override = model.image_embeds_override(ids, model.encode_images(pixels))
    with torch.inference_mode():
        logits = model(ids, torch.arange(t), build_metadata([t], [t], [table], BLOCK), torch.tensor([t - 1]),
                       input_embeds_override=override)
        out = [int(logits[0].argmax())]
        for pos in range(t, t + n - 1):
            logits = model(torch.tensor([out[-1]]), torch.tensor([pos]), build_metadata([1], [pos + 1], [table], BLOCK),
                           torch.tensor([0]))
            out.append(int(logits[0].argmax()))
    return out


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_after_images_matches_transformers_generate(llava, n_images):
    path, hf, proc, engine = llava
    x = inputs(proc, n_images, seed=3)
    ours = our_greedy(engine.model, x["input_ids"][0], x["pixel_values"], 10)
    with torch.inference_mode():
        ref = hf.generate(**x, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, x["input_ids"].shape[1]:]
    assert ours == ref.tolist()
    assert len(set(ours)) >= 3


@pytest.mark.parametrize("layer,strategy,tied", [([0, -1], "full", False), (-1, "default", True)])
def test_feature_layers_strategy_and_tied_head(tmp_path, layer, strategy, tied):
    """A list of feature layers (concatenated; 0 = the embeddings) with "full" (CLS kept: 17 tokens),
    and the last layer with a head tied to the embeddings."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = make_tiny_llava(tmp_path, seed=1, vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                           tie_word_embeddings=tied)
    hf = LlavaForConditionalGeneration.from_pretrained(path).eval()
    proc = AutoProcessor.from_pretrained(path)
    model, cfg = load_with_cache(path)
    assert cfg.tie_word_embeddings == tied and (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.tokens_per_image == 16 + (strategy == "full") and len(model.vision_tower.encoder.layers) == 2
    x = inputs(proc, 2, seed=4)
    assert (x["input_ids"] == model.image_token_id).sum() == 2 * model.tokens_per_image
    with torch.inference_mode():
        ref_feats = torch.stack(hf.get_image_features(pixel_values=x["pixel_values"]).pooler_output)
        ref = hf(**x).logits[0]
    assert torch.allclose(model.encode_images(x["pixel_values"]), ref_feats, atol=1e-5, rtol=0)
    assert torch.allclose(run(model, [(x["input_ids"][0], x["pixel_values"])]), ref, atol=1e-4, rtol=0)


def test_other_checkpoint_layouts_load(llava, tmp_path):
    """llava-1.5-hf names (``vision_tower.vision_model.*``) and transformers' in-memory ones
    (``model.language_model.*``...) load to the same model."""
    path, hf, proc, engine = llava
    state = load_file(path / "model.safetensors")
    layouts = {
        "llava15": {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in state.items()},
        "in_memory": dict(hf.state_dict()),
    }
    x = inputs(proc, 1, seed=5)
    want = run(engine.model, [(x["input_ids"][0], x["pixel_values"])])
    for name, tensors in layouts.items():
        d = tmp_path / name
        d.mkdir()
        for f in ("config.json", "generation_config.json"):
            (d / f).write_text((path / f).read_text())
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
        model, _ = load_with_cache(d)
        assert torch.equal(run(model, [(x["input_ids"][0], x["pixel_values"])]), want), name


# config.json of llava-hf/llava-1.5-7b-hf: sub-configs list only what differs from their defaults
LLAVA15_7B_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}


def test_llava15_config_builds_the_7b_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAVA15_7B_CONFIG))
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim) == (
        "llava", 4096, 32, 32, 128)
    assert cfg.eos_token_ids == [2] and cfg.dtype == "float16" and not cfg.tie_word_embeddings
    with torch.device("meta"):
        model = OurLlava(cfg)
    assert model.image_token_id == 32000 and model.tokens_per_image == 576 and model.image_size == 336
    assert len(model.vision_tower.encoder.layers) == 23
    assert model.multi_modal_projector.linear_1.weight.shape == (4096, 1024)
    assert model.vision_tower.embeddings.position_embedding.weight.shape == (577, 1024)
