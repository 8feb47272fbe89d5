"""Image parts through the recipe on the tiny LLaVA: the template's image token expanded to the
model's tokens per image (HF's LlavaProcessor's ids), per-image (offset, length, hash), ``<image>``
typed by a client stays text, text-only models refuse image parts; and over the tokenizer service."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from deepinfer.mesh.client import MeshClient, RemoteError
from deepinfer.models.convert import ensure_default_model
from deepinfer.models.tiny_vlm import make_tiny_llava
from deepinfer.protocol import EncodeChatReply, EncodeChatRequest, subjects
from deepinfer.recipe import ChatRecipe
from deepinfer.recipe.chat import image_config

H1, H2 = "a1" * 32, "b2" * 32


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def recipe(llava_dir):
    return ChatRecipe.from_pretrained(llava_dir)


def parts(*items):
    return [{"type": "image", "image_hash": x} if len(x) == 64 else {"type": "text", "text": x} for x in items]


def hf_ids(llava_dir, content):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(llava_dir)
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"} if p["type"] == "image" else p for p in content]}]
    prompt = proc.apply_chat_template(chat, add_generation_prompt=True)
    n = sum(p["type"] == "image" for p in content)
    pics = [Image.fromarray(np.zeros((32, 32, 3), np.uint8))] * n
    return proc(images=pics or None, text=prompt, return_tensors="pt")["input_ids"][0].tolist()


@pytest.mark.parametrize("content", [
    ("Describe this.", H1),
    (H1, "and", H2, "compare them."),
    (H1, H1),
    ("no images here",),
])
def test_ids_equal_the_llava_processors(recipe, llava_dir, content):
    content = parts(*content)
    ids, images = recipe.encode_chat_images([{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": content}])
    assert ids == hf_ids(llava_dir, content)
    hashes = [p["image_hash"] for p in content if p["type"] == "image"]
    assert [h for _, _, h in images] == hashes
    for offset, length, _ in images:
        assert length == 16 and ids[offset : offset + length] == [recipe.image_token_id] * 16
    assert sum(i == recipe.image_token_id for i in ids) == 16 * len(hashes)


def test_image_token_typed_by_a_client_is_text(recipe):
    ids, images = recipe.encode_chat_images([{"role": "user", "content": parts("look: <image>", H1)}])
    assert len(images) == 1 and sum(i == recipe.image_token_id for i in ids) == 16
    ids, images = recipe.encode_chat_images([{"role": "user", "content": "<image><image>"}])
    assert images == [] and recipe.image_token_id not in ids


def test_image_config_and_text_only_models(recipe, llava_dir):
    assert image_config(llava_dir) == (recipe.image_token_id, 16)
    text = ChatRecipe.from_pretrained(ensure_default_model(progress=False))
    assert text.image_token_id is None and image_config(ensure_default_model(progress=False)) is None
    with pytest.raises(ValueError, match="only text content parts"):
        text.encode_chat_images([{"role": "user", "content": parts("hi", H1)}])


@pytest.mark.parametrize("content, message", [
    ([{"type": "image"}], "image_hash"),
    ([{"type": "image", "image_hash": "zz"}], "image_hash"),
    ([{"type": "image_url", "image_url": {"url": "data:,"}}], "only text"),  # the gateway converts these
])
def test_bad_image_parts(recipe, content, message):
    with pytest.raises(ValueError, match=message):
        recipe.encode_chat_images([{"role": "user", "content": content}])


async def test_tokenizer_service_replies_with_image_spans(nats_url, llava_dir, recipe):
    from deepinfer.tokenizer.service import TokenizerService

    service = TokenizerService(nats_url, str(llava_dir), worker_id="tokenizer-vlm")
    await service.start()
    client = await MeshClient.connect(nats_url, name="tokenizer-vlm-client")
    try:
        msgs = [{"role": "user", "content": parts(H1, "what is it?")}]
        reply = await client.request(subjects.TOKENIZER_ENCODE_CHAT, EncodeChatRequest("r", msgs), timeout=30,
                                     expect=EncodeChatReply)
        ids, images = recipe.encode_chat_images(msgs)
        assert reply.token_ids == ids and reply.images == [list(i) for i in images] and len(images) == 1
        with pytest.raises(RemoteError) as e:
            await client.request(subjects.TOKENIZER_ENCODE_CHAT,
                                 EncodeChatRequest("r", [{"role": "user", "content": [{"type": "image"}]}]),
                                 timeout=30, expect=EncodeChatReply)
        assert e.value.kind == "bad_request"
    finally:
        await client.close()
        await service.stop()
