"""The whole mesh on the tiny LLaVA with a vision worker (``deepinfer up``'s launcher adds it for a
vision-language model): a chat request with an image gives transformers' greedy tokens and
logprobs; a repeated image is encoded once (the vision worker's load report) and its prompt's
blocks are a prefix-cache hit; the same text with another image is no hit and another answer."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer.launcher import Mesh
from deepinfer.mesh import MeshClient
from deepinfer.models.tiny_vlm import make_tiny_llava
from deepinfer.protocol import LoadReport, subjects

N = 8


def picture(seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))


def data_url(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


TEXT = "What do you see in this picture? Answer briefly."


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = make_tiny_llava(tmp_path_factory.mktemp("llava"))
    return path, LlavaForConditionalGeneration.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


@pytest.fixture(scope="module")
def vlm_mesh(llava, tmp_path_factory):
    m = Mesh(model=str(llava[0]), workdir=tmp_path_factory.mktemp("vlm-mesh"))
    m.start(timeout=300)
    yield m
    m.stop()


def ask(client, img):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=N, temperature=0, logprobs=True,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img)}},
                                               {"type": "text", "text": TEXT}]}],
        extra_body={"return_token_ids": True, "ignore_eos": True}).to_dict()


def reference(llava, img):
    _, hf, proc = llava
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    x = proc(images=[img], text=proc.apply_chat_template(chat, add_generation_prompt=True), return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**x, max_new_tokens=N, min_new_tokens=N, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)
    ids = x["input_ids"][0].tolist()
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens)]
    return ids, tokens, logprobs


async def vision_report(nats_url) -> LoadReport:
    client = await MeshClient.connect(nats_url, name="vision-report-reader")
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on(msg):
        from deepinfer.protocol import unpack

        report = unpack(msg.data)
        if report.role == "vision" and not got.done():
            got.set_result(report)

    await client.nc.subscribe(subjects.LOAD_ALL, cb=on)
    try:
        return await asyncio.wait_for(got, 10)
    finally:
        await client.close()


def test_images_through_the_mesh(vlm_mesh, llava):
    import openai

    assert "vision" in vlm_mesh.services
    client = openai.OpenAI(base_url=vlm_mesh.gateway_url + "/v1", api_key="x", max_retries=0, timeout=120)
    a, b = picture(1), picture(2)
    ref_ids, ref_tokens, ref_logprobs = reference(llava, a)

    first = ask(client, a)
    assert first["prompt_token_ids"] == ref_ids
    assert first["choices"][0]["token_ids"] == ref_tokens
    got = [e["logprob"] for e in first["choices"][0]["logprobs"]["content"]]
    assert np.allclose(got, ref_logprobs, atol=1e-4, rtol=0), (got, ref_logprobs)

    image_at = ref_ids.index(llava[2].tokenizer.convert_tokens_to_ids("<image>"))
    again = ask(client, a)  # same image: embedding cache hit, prefix-cache hit past the image
    assert again["choices"][0]["token_ids"] == ref_tokens
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > image_at + 16

    other = ask(client, b)  # same text, other image: no false hit, another answer
    _, ref_b, _ = reference(llava, b)
    assert other["choices"][0]["token_ids"] == ref_b != ref_tokens
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= image_at

    report = asyncio.run(vision_report(vlm_mesh.nats_url))
    assert report.vision_forwards == 2 and report.vision_images == 2 and report.vision_cache_hits == 1


def test_damaged_embeddings_in_the_tier_are_encoded_again(vlm_mesh, llava):
    # the vision worker verifies a stored file before taking it as a hit; else prefill would fail (a 500)
    import openai

    from deepinfer.vision.service import image_hash

    client = openai.OpenAI(base_url=vlm_mesh.gateway_url + "/v1", api_key="x", max_retries=0, timeout=120)
    img = picture(3)
    first = ask(client, img)
    path = next(vlm_mesh.kv_root.glob(f"*/embeddings/*/{image_hash(img.convert('RGB'))}.kvb"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    forwards = asyncio.run(vision_report(vlm_mesh.nats_url)).vision_forwards
    again = ask(client, img)
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert asyncio.run(vision_report(vlm_mesh.nats_url)).vision_forwards == forwards + 1


# --- decode failover of image requests --------------------------------------------------------
FAST_START = ["--no-calibrate", "--kv-cache-gb", "0.1"]
BLOCK = 16  # the workers' default --block-size


def failover_requests(llava, salt: str, max_tokens: int) -> list[dict]:
    """Streaming chat requests, each with its own picture. The first puts the image first (the
    prompt's full blocks, stored by prefill, cover its rows); the others put it last, with text
    padded so its rows run into the prompt's partial last block, which a resumed decode worker must
    recompute (from the image's embeddings in the storage tier). One request is seeded sampling."""
    _, _, proc = llava
    reqs = []
    for i in range(6):
        img, image_last = picture(20 + i), i > 0
        for pad in range(BLOCK):
            text = f"Story {i}: describe this picture in detail" + " please" * pad
            parts = [{"type": "image_url", "image_url": {"url": data_url(img)}}, {"type": "text", "text": text}]
            chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            if image_last:
                parts, chat[0]["content"] = parts[::-1], chat[0]["content"][::-1]
            ids = proc(images=[img], text=proc.apply_chat_template(chat, add_generation_prompt=True),
                       return_tensors="pt")["input_ids"][0].tolist()
            image_end = max(j for j, t in enumerate(ids) if t == proc.tokenizer.convert_tokens_to_ids("<image>")) + 1
            covered = len(ids) // BLOCK * BLOCK
            if (image_end > covered) == image_last:  # image last: some image rows past the full blocks
                break
        else:
            raise AssertionError("no padding gives the wanted layout")
        kw = dict(messages=[{"role": "user", "content": parts}], max_tokens=max_tokens,
                  extra_body={"ignore_eos": True, "cache_salt": salt, "return_token_ids": True})
        if i == 3:  # NOTE: top_k: the tiny random model's full distribution is near-uniform over 49k tokens,
            # where float noise between a recompute and the original decode steps moves a seeded draw
            kw.update(temperature=0.8, seed=77)
            kw["extra_body"]["top_k"] = 5
        else:
            kw.update(temperature=0)
        reqs.append(kw)
    return reqs


def test_decode_worker_killed_mid_stream_image_requests_resume_with_the_same_tokens(make_mesh, llava):
    import openai

    from test_failover import busiest_decoding, log_count, process, until

    # two requests at a time per decode worker: the others wait there, so streams are still under way
    # (or waiting for a decode slot) when one worker is killed
    m = make_mesh(model=str(llava[0]), replicas={"decode": 2},
                  extra_args={"prefill": FAST_START, "decode": [*FAST_START, "--max-num-seqs", "2"]})
    max_tokens = 200
    model = llava[0].name

    async def streams(reqs, on_token=None):
        client = openai.AsyncOpenAI(base_url=m.gateway_url + "/v1", api_key="x", max_retries=0, timeout=180)

        async def one(i):
            tokens = []
            async for chunk in await client.chat.completions.create(model=model, stream=True, **reqs[i]):
                if chunk.choices:
                    tokens += (chunk.choices[0].model_extra or {}).get("token_ids") or []
                    if on_token:
                        on_token(i, len(tokens))
            return tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(len(reqs))), return_exceptions=True)
        finally:
            await client.close()

    async def scenario():
        reference = await streams(failover_requests(llava, "reference", max_tokens))
        assert all(isinstance(t, list) and len(t) == max_tokens for t in reference), reference
        counts = {}
        run = asyncio.ensure_future(streams(failover_requests(llava, "failover", max_tokens),
                                            lambda i, n: counts.__setitem__(i, n)))
        await until(lambda: max(counts.values(), default=0) >= 40 or run.done(), 120, "streams to be under way")
        assert not run.done(), "the streams finished before the kill: lengthen them"
        victim, on_victim = busiest_decoding(m)  # by its log: its load reports lag
        assert on_victim, "no decode worker is decoding"
        await asyncio.to_thread(process(m, victim).kill)
        got = await run
        return reference, got, victim, on_victim

    reference, got, victim, on_victim = asyncio.run(scenario())
    errors = [g for g in got if isinstance(g, BaseException)]
    assert not errors, errors
    for i, (g, r) in enumerate(zip(got, reference)):  # greedy and seeded, resumed or not: the uninterrupted tokens
        assert g == r, f"stream {i}: first difference at token {next(k for k, (a, b) in enumerate(zip(g, r)) if a != b)}"
    survivor = next(p.name for p in m.processes["decode"] if p.name != victim)
    resumed = log_count(m, "gateway-0", "failover_done")
    log = process(m, survivor).log_path.read_text()
    print(f"\nkilled {victim} ({len(on_victim)} decoding); {resumed} streams resumed on {survivor}")
    assert resumed >= 1
    assert log.count('"kv_prefix_loaded"') >= 1  # the prompt's stored blocks (image hashes in their keys)
    assert log.count('"image_embeddings": true') >= 1  # image rows recomputed from the tier's embeddings
