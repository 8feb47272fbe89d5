"""Images through the gateway (issue #11): OpenAI ``image_url`` parts (data: URLs, http(s) URLs)
and Anthropic image blocks reach the vision service (a real one on the tiny LLaVA) and the
prefill request carries each image's placeholder run and content hash; every bad image is a 400
in the API's own error shape; a text-only model refuses image parts.

The mesh: a private nats-server, the fake prefill / decode workers of ``test_gateway``, a fake
tokenizer that runs the real recipe on the tiny LLaVA, a real ``VisionService``, in-process gateways
(one on the tiny LLaVA, one on the text-only default model)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
import time

import httpx
import numpy as np
import pytest
import pytest_asyncio
import uvicorn
from PIL import Image

from deepinfer.gateway.app import create_app
from deepinfer.gateway.config import GatewayConfig, load_model
from deepinfer.gateway.stream import StreamTimeouts
from deepinfer.launcher import free_port
from deepinfer.gateway.errors import OpenAIError, mesh_errors
from deepinfer.mesh import MeshClient, NoResponders, RemoteError, RequestTimeout
from deepinfer.models.tiny_vlm import make_tiny_llava
from deepinfer.protocol import EncodeChatReply, EncodeChatRequest, ErrorReply, ProtocolError
from deepinfer.recipe import ChatRecipe
from deepinfer.vision.service import VisionService, image_hash
from test_gateway import MODEL_DIR, FakeWorkers, InProcessGateway, assert_openai_error, start_nats_server
from test_gateway_anthropic import assert_anthropic_error

MAX_IMAGE_BYTES = 100_000


def picture(seed=0, size=(40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def file_bytes(img: Image.Image, fmt="PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media="image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def chat(url: str, text="What is in this picture?") -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]}


class ImageFakes(FakeWorkers):
    """The fakes, with a tokenizer that renders image parts with the tiny LLaVA's recipe."""

    recipe: ChatRecipe | None = None

    async def on_encode(self, req: EncodeChatRequest):
        self.tokenizer_requests.append(req)
        try:
            ids, images = self.recipe.encode_chat_images(req.messages, req.tools, req.add_generation_prompt)
        except ValueError as e:
            return ErrorReply(error=str(e), kind="bad_request")
        return EncodeChatReply(req.request_id, ids, images=[list(i) for i in images])


class Gateway(InProcessGateway):
    def __init__(self, nats_url: str, model: str):  # noqa: the parent's __init__ builds the default model's app
        self.config = GatewayConfig(nats_url=nats_url, model=model, served_model_name="m", max_model_len=256,
                                    port=free_port(),
                                    worker_id="gateway-images", max_image_bytes=MAX_IMAGE_BYTES,
                                    image_fetch_timeout_s=2.0,
                                    timeouts=StreamTimeouts(inactivity_s=4.0, handoff_s=1.0, tick_s=0.1))
        self.app = create_app(self.config, load_model(self.config))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.config.port,
                                                    log_level="warning", lifespan="on"))
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.model = self.app.state.gateway.model.served_name
        self.task = None


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def image_server():
    """A local HTTP server: /pic.png (an image), /big.png (over the limit), anything else 404."""
    files = {"/pic.png": file_bytes(picture(9)), "/big.png": b"\x89PNG" + bytes(MAX_IMAGE_BYTES + 10)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest_asyncio.fixture(scope="module")
async def mesh(llava_dir, tmp_path_factory):
    proc, url = start_nats_server()
    conn = await MeshClient.connect(url, name="fake-workers")
    fakes = ImageFakes(conn)
    fakes.recipe = ChatRecipe.from_pretrained(llava_dir)
    await fakes.start()
    vision = VisionService(url, str(llava_dir), str(tmp_path_factory.mktemp("kv")), worker_id="vision-gw-test",
                           max_image_bytes=MAX_IMAGE_BYTES, max_pixels=200 * 200)
    await vision.start()
    async with Gateway(url, str(llava_dir)) as vlm, Gateway(url, str(MODEL_DIR)) as text:
        for gw in (vlm, text):
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
                deadline = time.monotonic() + 5
                while (await c.get("/health")).status_code != 200:
                    assert time.monotonic() < deadline, "gateway never saw the fake workers"
                    await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=vlm.url, timeout=30) as vc, \
                httpx.AsyncClient(base_url=text.url, timeout=30) as tc:
            yield fakes, vision, vc, tc
    await vision.stop()
    await fakes.stop()
    await conn.close()
    proc.stop()


async def test_image_reaches_prefill_with_its_hash_and_is_encoded_once(mesh):
    fakes, vision, client, _ = mesh
    pic = picture(1)
    forwards = vision.forwards
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={**chat(data_url(file_bytes(pic))), "stream": stream})
        assert r.status_code == 200, r.text
        req = fakes.prefill_requests[-1]
        assert len(req.images) == 1
        offset, length, h = req.images[0]
        assert length == 16 and h == image_hash(pic) and req.embeddings_fingerprint == vision.fingerprint
        assert req.prompt_token_ids[offset : offset + 16] == [fakes.recipe.image_token_id] * 16
        sent = fakes.tokenizer_requests[-1].messages[0]["content"]
        assert {"type": "image", "image_hash": h} in sent  # the tokenizer never sees the bytes
    assert vision.forwards == forwards + 1  # the second request hit the embedding cache


async def test_remote_image_url_is_fetched(mesh, image_server):
    fakes, _, client, _ = mesh
    r = await client.post("/v1/chat/completions", json=chat(f"{image_server}/pic.png"))
    assert r.status_code == 200, r.text
    assert fakes.prefill_requests[-1].images[0][2] == image_hash(picture(9))


def truncated() -> bytes:
    data = file_bytes(picture(3, (64, 64)))
    return data[: len(data) // 2]


BAD = {
    "not an image": (lambda s: data_url(b"hello, I am text"), "not an image"),
    "truncated": (lambda s: data_url(truncated()), "truncated"),
    "unsupported format": (lambda s: data_url(file_bytes(picture(4), "TIFF"), "image/tiff"),
                           "unsupported image format"),
    "too many pixels": (lambda s: data_url(file_bytes(Image.new("RGB", (300, 300)))), "too many pixels"),
    "too large": (lambda s: data_url(bytes(MAX_IMAGE_BYTES + 1)), "image too large"),
    "bad base64": (lambda s: "data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    "not base64": (lambda s: "data:image/png,rawbytes", "must be base64"),
    "unreachable": (lambda s: f"http://127.0.0.1:{free_port()}/x.png", "could not fetch"),
    "http 404": (lambda s: f"{s}/missing.png", "HTTP 404"),
    "remote too large": (lambda s: f"{s}/big.png", "image too large"),
    "scheme": (lambda s: "ftp://example.com/x.png", "data: URL or an http(s) URL"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_bad_images_are_openai_400s(mesh, image_server, case):
    fakes, _, client, _ = mesh
    url, message = BAD[case]
    before = len(fakes.prefill_requests)
    r = await client.post("/v1/chat/completions", json=chat(url(image_server)))
    err = assert_openai_error(r, 400, param="messages[0].content[1]")
    assert message in err["message"], err
    assert len(fakes.prefill_requests) == before


async def test_openai_client_sends_an_image(mesh):
    from openai import OpenAI

    fakes, _, client, _ = mesh
    oai = OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused")
    body = chat(data_url(file_bytes(picture(5))))
    out = await asyncio.to_thread(oai.chat.completions.create, model="m", messages=body["messages"], max_tokens=4)
    assert out.choices[0].message.content is not None
    assert fakes.prefill_requests[-1].images[0][2] == image_hash(picture(5))


def anthropic(data: bytes, media="image/png") -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": media,
                                     "data": base64.b64encode(data).decode()}},
        {"type": "text", "text": "Describe it."}]}]}


async def test_anthropic_image_blocks(mesh):
    fakes, _, client, _ = mesh
    r = await client.post("/v1/messages", json=anthropic(file_bytes(picture(6))))
    assert r.status_code == 200, r.text
    assert fakes.prefill_requests[-1].images[0][2] == image_hash(picture(6))
    for data, message in ((b"not an image at all", "not an image"), (truncated(), "truncated"),
                          (bytes(MAX_IMAGE_BYTES + 1), "image too large")):
        r = await client.post("/v1/messages", json=anthropic(data))
        err = assert_anthropic_error(r, 400, "invalid_request_error")
        assert message in err["message"]


async def test_text_only_models_refuse_images(mesh):
    fakes, _, _, text_client = mesh
    r = await text_client.post("/v1/chat/completions", json=chat(data_url(file_bytes(picture(7)))))
    err = assert_openai_error(r, 400, param="messages[0].content[1]")
    assert "text-only" in err["message"] and "image" in err["message"]
    r = await text_client.post("/v1/messages", json=anthropic(file_bytes(picture(7))))
    assert "text-only" in assert_anthropic_error(r, 400, "invalid_request_error")["message"]


@pytest.mark.parametrize("failure, status, message", [
    (NoResponders("x"), 503, "no vision worker is running"),
    (RequestTimeout("x"), 503, "the vision service did not answer within 7s"),
    (RemoteError("not an image", kind="bad_request"), 400, "not an image"),
    (RemoteError("out of memory"), 500, "vision service failed: out of memory"),
    (ProtocolError("schema version 9 != 1"), 500, "bad reply from the vision service: schema version 9"),
])
def test_mesh_failures_become_http_errors(failure, status, message):
    # one mapping for every mesh service the gateway asks (tokenizer, vision)
    with pytest.raises(OpenAIError) as e, mesh_errors("vision", "vision service", 7.0, "messages[0]", "invalid_image"):
        raise failure
    assert e.value.status == status and message in e.value.message
    assert (e.value.param, e.value.code) == (("messages[0]", "invalid_image") if status == 400 else (None, e.value.code))
