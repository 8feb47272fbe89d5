"""Images through the engine (tiny LLaVA): ``add_request(images=, image_embeds=)`` feeds each image's
embeddings for its placeholder rows, also when prefill chunks cut an image apart, and gives
transformers' greedy tokens; the prefix cache keys blocks by image content: same text + another
image is no hit, the same image is."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer.engine.interface import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.models.tiny_vlm import make_tiny_llava
from deepinfer.protocol import SamplingParams

BLOCK = 8


def picture(seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 36, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = make_tiny_llava(tmp_path_factory.mktemp("llava"))
    hf = LlavaForConditionalGeneration.from_pretrained(path).eval()
    return path, hf, AutoProcessor.from_pretrained(path)


def prompt(proc, n_images, seed=0, text="Describe this image in detail please."):
    chat = [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]
    x = proc(images=[picture(seed + i) for i in range(n_images)],
             text=proc.apply_chat_template(chat, add_generation_prompt=True), return_tensors="pt")
    return x


def images_of(ids, token_id, per_image, hashes):
    out, pos = [], 0
    while pos < len(ids):
        if ids[pos] == token_id:
            out.append((pos, per_image, hashes[len(out)]))
            pos += per_image
        else:
            pos += 1
    return out


def generate(engine, rid, ids, images, embeds, n=6):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine.add_request(rid, ids, sp, images=images, image_embeds=embeds)
    out, cached = [], 0
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
            cached = max(cached, getattr(o, "num_cached_tokens", 0) or 0)
    return out, cached


@pytest.mark.parametrize("chunk", [4096, 12])  # whole prompt / chunks that cut each image apart
def test_greedy_tokens_equal_transformers(setup, chunk):
    path, hf, proc = setup
    engine = LLMEngine(path, EngineConfig(block_size=BLOCK, kv_cache_bytes=4 << 20, max_num_batched_tokens=chunk))
    x = prompt(proc, 2)
    ids = x["input_ids"][0].tolist()
    embeds = list(engine.model.encode_images(x["pixel_values"]))
    images = images_of(ids, engine.model.image_token_id, 16, ["a" * 64, "b" * 64])
    with torch.inference_mode():
        ref = hf.generate(**x, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    out, _ = generate(engine, "r", ids, images, embeds)
    assert out == ref
    text_only, _ = generate(engine, "t", ids, [], None)  # placeholders as plain tokens: another answer
    assert text_only != ref


def test_prefix_cache_keys_blocks_by_image(setup):
    path, hf, proc = setup
    engine = LLMEngine(path, EngineConfig(block_size=BLOCK, kv_cache_bytes=4 << 20))
    x1, x2 = prompt(proc, 1, seed=1), prompt(proc, 1, seed=2)
    ids = x1["input_ids"][0].tolist()
    assert ids == x2["input_ids"][0].tolist()  # same text, other picture
    e1, e2 = (list(engine.model.encode_images(x["pixel_values"])) for x in (x1, x2))
    tid = engine.model.image_token_id
    im1, im2 = images_of(ids, tid, 16, ["1" * 64]), images_of(ids, tid, 16, ["2" * 64])
    with torch.inference_mode():
        refs = [hf.generate(**x, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
                for x in (x1, x2)]
    assert refs[0] != refs[1]
    out1, c1 = generate(engine, "a", ids, im1, e1)
    out2, c2 = generate(engine, "b", ids, im2, e2)  # no false hit: the image's blocks differ
    out3, c3 = generate(engine, "c", ids, im1, e1)  # the same image: a hit
    assert (out1, out2, out3) == (refs[0], refs[1], refs[0])
    offset = im1[0][0]
    assert c2 <= offset // BLOCK * BLOCK  # only blocks before the image can be shared
    assert c3 > offset + 16


def test_bad_image_arguments(setup):
    from deepinfer.engine.interface import RequestError

    path, _, proc = setup
    engine = LLMEngine(path, EngineConfig(block_size=BLOCK, kv_cache_bytes=4 << 20))
    ids = prompt(proc, 1)["input_ids"][0].tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(RequestError, match="outside the prompt"):
        engine.add_request("x", ids, sp, images=[(len(ids) - 2, 16, "a" * 64)])
    with pytest.raises(RequestError, match="do not match"):
        engine.add_request("y", ids, sp, images=[(3, 16, "a" * 64)], image_embeds=[torch.zeros(15, 64)])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_image_rows_without_embeddings_fail_that_request_alone(setup, async_scheduling):
    """A request whose image rows would have to be computed without their embeddings (a decode
    worker recomputing a preempted multimodal prompt) ends with "error"; the step's other
    requests go on."""
    path, hf, proc = setup
    engine = LLMEngine(path, EngineConfig(block_size=BLOCK, kv_cache_bytes=4 << 20,
                                          async_scheduling=async_scheduling))
    x = prompt(proc, 1)
    ids = x["input_ids"][0].tolist()
    images = images_of(ids, engine.model.image_token_id, 16, ["c" * 64])
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("no-embeds", ids, sp, images=images)  # hashed only, as on a decode worker
    engine.add_request("text", ids[:10], sp)
    finish, tokens = {}, {"no-embeds": [], "text": []}
    step = engine.step_async if async_scheduling else engine.step
    while engine.has_unfinished():
        for o in step():
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    assert finish == {"no-embeds": "error", "text": "length"}
    assert tokens["no-embeds"] == [] and len(tokens["text"]) == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
