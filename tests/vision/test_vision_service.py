"""The vision service over NATS on the tiny LLaVA: embeddings equal the model's, stored in the tier by
content hash; a repeated image (even re-encoded in another format) is encoded once; bad images are
``bad_request`` errors naming the problem; block hashes include image content hashes."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer.kvstore.hashing import block_hashes, image_keys
from deepinfer.kvstore.store import BlockStore
from deepinfer.mesh.client import MeshClient, RemoteError
from deepinfer.models.llava import preprocess
from deepinfer.models.tiny_vlm import make_tiny_llava
from deepinfer.protocol import VisionEncodeReply, VisionEncodeRequest, pack, subjects, unpack
from deepinfer.vision.service import EMBEDDINGS_CLASS, VisionService, decode_image, image_hash, read_embeddings


def picture(seed: int, size=(40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def file_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
async def vision(nats_url, llava_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    service = VisionService(nats_url, str(llava_dir), str(root), worker_id="vision-test", max_image_bytes=200_000,
                            max_pixels=300 * 300)
    await service.start()
    client = await MeshClient.connect(nats_url, name="vision-test-client")
    yield service, client
    await client.close()
    await service.stop()


async def encode(client, images, rid="r1") -> VisionEncodeReply:
    return await client.request(subjects.VISION_ENCODE, VisionEncodeRequest(rid, images), timeout=60,
                                expect=VisionEncodeReply)


def test_messages_round_trip():
    req = VisionEncodeRequest("r", [b"\x89PNG\x00\xff"])
    assert unpack(pack(req)) == req
    rep = VisionEncodeReply("r", ["ab" * 32], 16, "f" * 16, [True])
    assert unpack(pack(rep)) == rep


async def test_embeddings_are_the_models_and_a_repeated_image_is_encoded_once(vision, llava_dir):
    service, client = vision
    a, b = picture(1), picture(2, (50, 64))
    forwards = service.forwards
    rep = await encode(client, [file_bytes(a), file_bytes(b)])
    assert service.forwards == forwards + 1  # both misses in one forward
    assert rep.tokens_per_image == 16 and rep.cached == [False, False]
    assert rep.image_hashes == [image_hash(a.convert("RGB")), image_hash(b.convert("RGB"))]
    store = BlockStore(service.store.root, rep.embeddings_fingerprint)
    ref = service.model.encode_images(preprocess([a, b], llava_dir))
    for h, r in zip(rep.image_hashes, ref):
        got = read_embeddings(store, h)
        assert got.shape == (16, 64) and torch.allclose(got, r, atol=1e-6, rtol=0)
        assert store.path(h, EMBEDDINGS_CLASS).parent.parent.name == EMBEDDINGS_CLASS
    # the same pictures again, one as lossless WebP: hits, no forward
    rep2 = await encode(client, [file_bytes(b, "WEBP"), file_bytes(a)], rid="r2")
    assert rep2.image_hashes == rep.image_hashes[::-1] and rep2.cached == [True, True]
    assert service.forwards == forwards + 1
    report = service.load_report()
    assert report.vision_forwards == service.forwards and report.vision_cache_hits >= 2


async def test_concurrent_requests_for_one_image_share_a_forward(vision):
    import asyncio

    service, client = vision
    data = file_bytes(picture(7))
    forwards = service.forwards
    reps = await asyncio.gather(*(encode(client, [data], rid=f"c{i}") for i in range(3)))
    assert len({r.image_hashes[0] for r in reps}) == 1
    assert service.forwards == forwards + 1


@pytest.mark.parametrize("damage", ["flipped byte", "cut short"])
async def test_damaged_stored_embeddings_are_encoded_again(vision, llava_dir, damage):
    service, client = vision
    img = picture(11 if damage == "flipped byte" else 12)
    rep = await encode(client, [file_bytes(img)], rid="d1")
    path = service.store.path(rep.image_hashes[0], EMBEDDINGS_CLASS)
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":
        data[-5] ^= 0xFF  # a payload byte: the checksum no longer matches
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))
    forwards = service.forwards
    rep2 = await encode(client, [file_bytes(img)], rid="d2")
    assert rep2.cached == [False] and service.forwards == forwards + 1  # not taken as a hit: encoded again
    got = read_embeddings(BlockStore(service.store.root, rep2.embeddings_fingerprint), rep2.image_hashes[0])
    ref = service.model.encode_images(preprocess([img], llava_dir))[0]
    assert got is not None and torch.allclose(got, ref, atol=1e-6, rtol=0)
    rep3 = await encode(client, [file_bytes(img)], rid="d3")
    assert rep3.cached == [True] and service.forwards == forwards + 1


async def test_embeddings_stay_out_of_the_kvindex(vision):
    # a kvindex replay scans the tier: image embeddings are no KV blocks (no retention, no capacity)
    from deepinfer.kvstore.scan import scan_blocks

    service, client = vision
    rep = await encode(client, [file_bytes(picture(13))], rid="s1")
    assert service.store.path(rep.image_hashes[0], EMBEDDINGS_CLASS).exists()
    assert list(scan_blocks(service.store.root)) == []
    BlockStore(service.store.root, rep.embeddings_fingerprint).put("ab" * 32, torch.zeros(2, 2), "chat")
    assert [b.retention_class for b in scan_blocks(service.store.root)] == ["chat"]


async def test_metrics_show_forwards_and_cache_hits_and_misses(vision):
    """/metrics (the worker's metrics server, collected on the service's loop) counts vision forwards
    and the tier's hits and misses: a new image is a miss and a forward, the same one again a hit."""
    import asyncio

    import httpx
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from deepinfer.launcher import free_port
    from deepinfer.telemetry import metrics

    service, client = vision
    port = free_port()
    server = metrics.start_metrics_server(port, metrics.ServiceCollector(service, asyncio.get_running_loop()),
                                          addr="127.0.0.1", registry=CollectorRegistry(auto_describe=True))

    async def scrape() -> dict[str, float]:
        text = (await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/metrics", timeout=10)).text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if not s.labels or s.name == "deepinfer_kvstore_reads_total" and s.labels == {"result": "hit"}}

    try:
        before = await scrape()
        data = file_bytes(picture(21))
        await encode(client, [data], rid="m1")
        after_miss = await scrape()
        await encode(client, [data, data], rid="m2")
        after_hit = await scrape()
    finally:
        server.shutdown()
    names = ("deepinfer_vision_forwards_total", "deepinfer_vision_cache_hits_total",
             "deepinfer_vision_cache_misses_total", "deepinfer_vision_images_encoded_total",
             "deepinfer_vision_requests_total")
    moved = [[after[n] - prev[n] for n in names] for prev, after in ((before, after_miss), (after_miss, after_hit))]
    assert moved == [[1, 0, 1, 1, 1], [0, 2, 0, 0, 1]]
    assert after_hit["deepinfer_vision_forwards_total"] == service.forwards
    assert after_hit["deepinfer_kvstore_reads_total"] > after_miss["deepinfer_kvstore_reads_total"]


def truncated_png() -> bytes:
    data = file_bytes(picture(3, (64, 64)))
    return data[: len(data) // 2]


@pytest.mark.parametrize("data, message", [
    (b"this is not an image", "not an image"),
    (b"", "empty image"),
    (None, "truncated"),
    ("tiff", "unsupported image format TIFF"),
    ("big", "too many pixels"),
    ("heavy", "image too large"),
])
async def test_bad_images_are_bad_requests(vision, data, message):
    _, client = vision
    if data is None:
        data = truncated_png()
    elif data == "tiff":
        data = file_bytes(picture(4), "TIFF")
    elif data == "big":
        data = file_bytes(Image.new("RGB", (400, 400)))
    elif data == "heavy":
        data = file_bytes(picture(5, (290, 290)), "BMP")  # 290 * 290 * 3 bytes of pixels > the 200 kB limit
    with pytest.raises(RemoteError) as e:
        await encode(client, [file_bytes(picture(6)), data])
    assert e.value.kind == "bad_request"
    assert message in str(e.value) and "image 1" in str(e.value)


def test_decode_image_converts_to_rgb_and_hashes_pixels():
    rgba = Image.new("RGBA", (5, 4), (10, 20, 30, 255))
    rgb = decode_image(file_bytes(rgba))
    assert rgb.mode == "RGB" and rgb.size == (5, 4)
    assert image_hash(rgb) == image_hash(Image.new("RGB", (5, 4), (10, 20, 30)))
    assert image_hash(rgb) != image_hash(Image.new("RGB", (4, 5), (10, 20, 30)))  # the size is hashed


def test_block_hashes_include_images_overlapping_each_block():
    fp, bs = "f" * 16, 4
    ids = [1, 2, 3, 9, 9, 9, 9, 9, 9, 4, 5, 6]  # an image of 6 placeholders at offset 3: blocks 0-2
    h1, h2 = "11" * 32, "22" * 32
    text = block_hashes(ids, bs, fp)
    one = block_hashes(ids, bs, fp, images=[(3, 6, h1)])
    two = block_hashes(ids, bs, fp, images=[(3, 6, h2)])
    assert block_hashes(ids, bs, fp, images=[]) == text  # text-only hashes unchanged
    assert len(set(text) | set(one) | set(two)) == 9  # every block of every variant differs
    assert block_hashes(ids, bs, fp, images=[(3, 6, h1)]) == one  # same image: same hashes (a hit)
    assert block_hashes(ids, bs, fp, images=[(4, 5, h1)]) != one  # the offset is a key too
    # keys only for blocks the image overlaps ([3, 9) here); later blocks differ through the chain
    assert image_keys([(3, 6, h1)], 9, 13) == b"" and image_keys([(3, 6, h1)], 8, 12) != b""
    longer = ids + [7, 7, 7, 7]
    assert block_hashes(longer, bs, fp, images=[(3, 6, h1)])[3] != block_hashes(longer, bs, fp, images=[(3, 6, h2)])[3]


def test_launcher_adds_vision_workers_for_vision_language_models(llava_dir, tmp_path):
    import subprocess
    import sys

    from deepinfer.launcher import is_multimodal
    from deepinfer.models.convert import ensure_default_model

    assert is_multimodal(llava_dir) and not is_multimodal(ensure_default_model(progress=False))
    assert not is_multimodal(tmp_path)  # no config.json
    r = subprocess.run([sys.executable, "-m", "deepinfer.cli", "serve", "vision", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--max-image-bytes" in r.stdout
