"""Images through the gateway: OpenAI ``image_url`` parts (data: URLs, http(s) URLs) and Anthropic
image blocks reach the vision service (a real one on the tiny LLaVA) and the prefill request carries
each image's placeholder run and content hash; every bad image is a 400 in the API's own error
shape; a text-only model refuses image parts.

The mesh: a private nats-server, the fake prefill / decode workers of ``test_gateway``, a fake
tokenizer that runs the real recipe on the tiny LLaVA, a real ``VisionService``, in-process gateways
(one on the tiny LLaVA, one on the text-only default model)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
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
from deepinfer.gateway.stream.request_stream import StreamTimeouts
from deepinfer.launcher import free_port
from deepinfer.gateway.api.errors import OpenAIError, mesh_errors
from deepinfer.gateway.api.image_fetch import address_problem
from deepinfer.mesh import MeshClient, NoResponders, RemoteError, RequestTimeout
from deepinfer.models.tiny_vlm import make_tiny_llava
from deepinfer.protocol import EncodeChatReply, EncodeChatRequest, ErrorReply, ProtocolError
from deepinfer.recipe import ChatRecipe
from deepinfer.vision.service import VisionService, image_hash
from test_gateway import MODEL_DIR, FakeWorkers, InProcessGateway, assert_openai_error, start_nats_server
from test_gateway_anthropic import assert_anthropic_error

MAX_IMAGE_BYTES = 100_000
VLM_CONFIG: list[GatewayConfig] = []  # the tiny LLaVA gateway's settings (tests change them for a while)


@contextlib.contextmanager
def settings(**changes):
    """The tiny LLaVA gateway with ``changes`` to its settings, for the ``with`` block."""
    config = VLM_CONFIG[-1]
    before = {k: getattr(config, k) for k in changes}
    for k, v in changes.items():
        setattr(config, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(config, k, v)


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
                                    allow_private_image_urls=True,  # the test's image server is on loopback
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


class ImageServer(str):
    """The server's base URL (a str), with its port and the paths it was asked for."""

    def __new__(cls, url: str, port: int, hits: list):
        self = super().__new__(cls, url)
        self.port, self.hits = port, hits
        return self


@pytest.fixture(scope="module")
def image_server():
    """A local HTTP server: /pic.png (an image), /big.png (over the limit), /drip.png (an image sent
    a few bytes every 0.3 s: each read is quick, the whole takes long), /to/<url> (a 302 to <url>),
    anything else 404. ``hits`` counts requests."""
    files = {"/pic.png": file_bytes(picture(9)), "/big.png": b"\x89PNG" + bytes(MAX_IMAGE_BYTES + 10)}
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            if self.path.startswith("/to/"):
                self.send_response(302)
                self.send_header("Location", self.path[len("/to/"):])
                self.end_headers()
                return
            if self.path == "/drip.png":
                data = files["/pic.png"]
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    for i in range(0, len(data), 64):
                        self.wfile.write(data[i : i + 64])
                        self.wfile.flush()
                        time.sleep(0.3)
                except (BrokenPipeError, ConnectionResetError):  # the gateway gave up: as it should
                    pass
                return
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield ImageServer(url, server.server_address[1], hits)
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
        VLM_CONFIG.append(vlm.config)
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


URL_PARAM = "messages[0].content[1].image_url.url"  # the field holding the image's URL or data

BAD = {  # case: (url, words of the message, code)
    "not an image": (lambda s: data_url(b"hello, I am text"), "not an image", "invalid_image"),
    "truncated": (lambda s: data_url(truncated()), "truncated", "invalid_image"),
    "unsupported format": (lambda s: data_url(file_bytes(picture(4), "TIFF"), "image/tiff"),
                           "unsupported image format", "invalid_image"),
    "too many pixels": (lambda s: data_url(file_bytes(Image.new("RGB", (300, 300)))), "too many pixels",
                        "image_too_large"),
    "too large": (lambda s: data_url(bytes(MAX_IMAGE_BYTES + 1)), "image too large", "image_too_large"),
    "bad base64": (lambda s: "data:image/png;base64,@@@not-base64@@@", "not valid base64", "invalid_image"),
    "garbage among line breaks": (lambda s: "data:image/png;base64,iVBO\r\nR@@@\r\n", "not valid base64",
                                  "invalid_image"),
    "bad padding": (lambda s: "data:image/png;base64,iVBORw0KGgo", "not valid base64", "invalid_image"),
    "not base64": (lambda s: "data:image/png,rawbytes", "must be base64", "invalid_image_url"),
    "unreachable": (lambda s: f"http://127.0.0.1:{free_port()}/x.png", "connection refused", "image_fetch_failed"),
    "unresolvable": (lambda s: "http://no-such-host.invalid/x.png", "could not resolve host no-such-host.invalid",
                     "image_fetch_failed"),
    "http 404": (lambda s: f"{s}/missing.png", "HTTP 404", "image_fetch_failed"),
    "remote too large": (lambda s: f"{s}/big.png", "image too large", "image_too_large"),
    "no host": (lambda s: "http:///x.png", "not an http(s) URL with a host", "invalid_image_url"),
    "scheme": (lambda s: "ftp://example.com/x.png", "data: URL or an http(s) URL", "invalid_image_url"),
    "empty": (lambda s: "", "must be a non-empty string", "invalid_image_url"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_bad_images_are_openai_400s(mesh, image_server, case):
    fakes, _, client, _ = mesh
    url, message, code = BAD[case]
    before = len(fakes.prefill_requests)
    r = await client.post("/v1/chat/completions", json=chat(url(image_server)))
    err = assert_openai_error(r, 400, param=URL_PARAM, code=code)
    assert message in err["message"], err
    assert len(fakes.prefill_requests) == before


def wrapped(data: bytes) -> str:
    """MIME base64 (RFC 2045): lines of 76 characters ending in CRLF."""
    text = base64.b64encode(data).decode()
    return "\r\n".join(text[i : i + 76] for i in range(0, len(text), 76)) + "\r\n"


@pytest.mark.parametrize("case", ["upper-case scheme", "line-wrapped base64", "text/plain media type",
                                  "no media type"])
async def test_lenient_data_urls_are_accepted(mesh, case):
    # the scheme is case-insensitive (RFC 3986), MIME-wrapped base64 decodes, and the declared media
    # type of an OpenAI data: URL is not checked (as OpenAI): the vision service judges the bytes
    fakes, _, client, _ = mesh
    pic = picture(31)
    data = file_bytes(pic)
    url = {"upper-case scheme": "DATA:image/png;BASE64," + base64.b64encode(data).decode(),
           "line-wrapped base64": "data:image/png;base64," + wrapped(data),
           "text/plain media type": data_url(data, "text/plain"),
           "no media type": "data:;base64," + base64.b64encode(data).decode()}[case]
    r = await client.post("/v1/chat/completions", json=chat(url))
    assert r.status_code == 200, r.text
    assert fakes.prefill_requests[-1].images[0][2] == image_hash(pic)


def images_chat(n: int) -> dict:
    url = data_url(file_bytes(picture(32)))
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare these."}, *[{"type": "image_url", "image_url": {"url": url}}] * n]}]}


async def test_too_many_images_is_a_400_naming_the_first_image_over_the_limit(mesh):
    fakes, vision, client, _ = mesh
    with settings(max_images=8):
        requests = vision.requests
        r = await client.post("/v1/chat/completions", json=images_chat(9))
        err = assert_openai_error(r, 400, param="messages[0].content[9]", code="too_many_images")
        assert "too many images: 9 (limit 8)" in err["message"]
        assert vision.requests == requests  # refused before any image was sent to the vision service
        r = await client.post("/v1/chat/completions", json=images_chat(8))
        assert r.status_code == 200, r.text
        assert len(fakes.prefill_requests[-1].images) == 8


async def test_a_slow_remote_image_is_cut_by_one_deadline_for_the_whole_fetch(mesh, image_server):
    # every read gets bytes within 0.3 s (a per-read timeout never fires); the whole would take ~20 s
    _, _, client, _ = mesh
    started = time.monotonic()
    r = await client.post("/v1/chat/completions", json=chat(f"{image_server}/drip.png"))
    err = assert_openai_error(r, 400, param=URL_PARAM, code="image_fetch_failed")
    assert "no complete answer within 2 s" in err["message"]
    assert time.monotonic() - started < 2.0 + 1.5


async def test_remote_images_reach_only_public_addresses_by_default(mesh, image_server):
    _, _, client, _ = mesh
    asked = len(image_server.hits)
    with settings(allow_private_image_urls=False):  # the default
        for url, why in ((f"{image_server}/pic.png", "127.0.0.1 is a loopback address"),
                         (f"http://localhost:{image_server.port}/pic.png", "host localhost resolves to"),
                         (f"http://[::1]:{image_server.port}/pic.png", "::1 is a loopback address"),
                         ("http://169.254.169.254/latest/meta-data/", "a link-local address"),
                         ("http://10.1.2.3/x.png", "a private address")):
            r = await client.post("/v1/chat/completions", json=chat(url))
            err = assert_openai_error(r, 400, param=URL_PARAM, code="image_url_not_allowed")
            assert why in err["message"] and "--allow-private-image-urls" in err["message"], err
    assert len(image_server.hits) == asked  # refused before connecting


async def test_remote_images_can_be_turned_off_or_kept_to_listed_domains(mesh, image_server):
    _, _, client, _ = mesh
    with settings(allow_remote_images=False):
        r = await client.post("/v1/chat/completions", json=chat(f"{image_server}/pic.png"))
        err = assert_openai_error(r, 400, param=URL_PARAM, code="image_url_not_allowed")
        assert "does not fetch remote image URLs" in err["message"]
        r = await client.post("/v1/chat/completions", json=chat(data_url(file_bytes(picture(9)))))
        assert r.status_code == 200, r.text  # data: URLs still work
    local = f"http://localhost:{image_server.port}"
    with settings(allowed_media_domains=("localhost",)):
        r = await client.post("/v1/chat/completions", json=chat(f"{local}/pic.png"))
        assert r.status_code == 200, r.text
        for url in (f"{image_server}/pic.png", f"{local}/to/{image_server}/pic.png"):  # a redirect is checked too
            r = await client.post("/v1/chat/completions", json=chat(url))
            err = assert_openai_error(r, 400, param=URL_PARAM, code="image_url_not_allowed")
            assert "images from 127.0.0.1 are not allowed (allowed domains: localhost)" in err["message"]
    r = await client.post("/v1/chat/completions", json=chat(f"{image_server}/to/{image_server}/pic.png"))
    assert r.status_code == 200, r.text  # redirects are followed


@pytest.mark.parametrize("address, problem", [
    ("127.0.0.1", "a loopback address"), ("::1", "a loopback address"),
    ("169.254.169.254", "a link-local address"), ("fe80::1", "a link-local address"),
    ("10.0.0.7", "a private address"), ("192.168.1.1", "a private address"), ("fd00::1", "a private address"),
    ("::ffff:10.0.0.7", "a private address"), ("100.64.0.1", "not a public address"),
    ("224.0.0.1", "a multicast address"), ("0.0.0.0", "a private address"),
    ("8.8.8.8", None), ("2606:4700:4700::1111", None),
])
def test_only_public_addresses_pass(address, problem):
    assert address_problem(address) == problem


def test_image_settings_come_from_flags_and_environment(monkeypatch):
    from deepinfer.gateway.service import parse_args

    default = parse_args([])
    assert (default.allow_remote_images, default.allow_private_image_urls, default.allowed_media_domains) == \
        (True, False, ())
    monkeypatch.setenv("DEEPINFER_MAX_IMAGE_BYTES", "1000")
    monkeypatch.setenv("DEEPINFER_IMAGE_FETCH_TIMEOUT_S", "2.5")
    monkeypatch.setenv("DEEPINFER_MAX_IMAGES", "3")
    monkeypatch.setenv("DEEPINFER_VISION_TIMEOUT_S", "9")
    monkeypatch.setenv("DEEPINFER_ALLOW_REMOTE_IMAGES", "false")
    monkeypatch.setenv("DEEPINFER_ALLOW_PRIVATE_IMAGE_URLS", "1")
    monkeypatch.setenv("DEEPINFER_ALLOWED_MEDIA_DOMAINS", "Images.Example.com, cdn.example.org.")
    c = parse_args([])
    assert (c.max_image_bytes, c.image_fetch_timeout_s, c.max_images, c.vision_timeout_s) == (1000, 2.5, 3, 9.0)
    assert (c.allow_remote_images, c.allow_private_image_urls) == (False, True)
    assert c.allowed_media_domains == ("images.example.com", "cdn.example.org")
    c = parse_args(["--max-images", "5", "--allow-remote-images", "--no-allow-private-image-urls",
                    "--allowed-media-domains", ""])  # flags win over the environment
    assert (c.max_images, c.allow_remote_images, c.allow_private_image_urls, c.allowed_media_domains) == \
        (5, True, False, ())
    monkeypatch.setenv("DEEPINFER_ALLOW_PRIVATE_IMAGE_URLS", "maybe")
    with pytest.raises(SystemExit):
        parse_args([])


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


@pytest.fixture
def anthropic_codes(monkeypatch):
    """The (code, param) of each error the Anthropic API answers (its error shape has neither)."""
    from deepinfer.gateway.api import messages

    seen: list[tuple[str | None, str | None]] = []
    body = messages.error_body

    def recording(e):
        seen.append((e.code, e.param))
        return body(e)

    monkeypatch.setattr(messages, "error_body", recording)
    return seen


async def test_anthropic_image_errors_have_codes_and_field_paths(mesh, image_server, anthropic_codes):
    _, vision, client, _ = mesh
    block = "messages.0.content.0"
    bad_base64 = anthropic(b"")
    bad_base64["messages"][0]["content"][0]["source"]["data"] = "@@@not-base64@@@"
    remote = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": f"{image_server}/missing.png"}}]}]}
    for body, message, code, param in (
            (anthropic(b"not an image at all"), "not an image", "invalid_image", f"{block}.source.data"),
            (anthropic(truncated()), "truncated", "invalid_image", f"{block}.source.data"),
            (anthropic(bytes(MAX_IMAGE_BYTES + 1)), "image too large", "image_too_large", f"{block}.source.data"),
            (bad_base64, "not valid base64", "invalid_image", f"{block}.source.data"),
            (remote, "HTTP 404", "image_fetch_failed", f"{block}.source.url"),
            (anthropic(file_bytes(picture(33), "JPEG"), media="image/png"),
             "Image does not match the provided media type image/png", "invalid_image", f"{block}.source.media_type"),
            (anthropic(file_bytes(picture(33), "GIF"), media="image/webp"),
             "Image does not match the provided media type image/webp", "invalid_image",
             f"{block}.source.media_type")):
        del anthropic_codes[:]
        r = await client.post("/v1/messages", json=body)
        err = assert_anthropic_error(r, 400, "invalid_request_error")
        assert message in err["message"], err
        assert anthropic_codes == [(code, param)], (message, anthropic_codes)
    # every declared type that matches is accepted; MIME-wrapped base64 too
    for fmt, media in (("JPEG", "image/jpeg"), ("PNG", "image/png"), ("GIF", "image/gif"), ("WEBP", "image/webp")):
        r = await client.post("/v1/messages", json=anthropic(file_bytes(picture(34), fmt), media=media))
        assert r.status_code == 200, (fmt, r.text)
    body = anthropic(b"")
    body["messages"][0]["content"][0]["source"]["data"] = wrapped(file_bytes(picture(35)))
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    # too many images: the first block over the limit
    with settings(max_images=8):
        requests = vision.requests
        body = anthropic(file_bytes(picture(36)))
        body["messages"][0]["content"] = [body["messages"][0]["content"][0]] * 9 + [{"type": "text", "text": "?"}]
        del anthropic_codes[:]
        r = await client.post("/v1/messages", json=body)
        assert "too many images: 9 (limit 8)" in assert_anthropic_error(r, 400, "invalid_request_error")["message"]
        assert anthropic_codes == [("too_many_images", "messages.0.content.8")]
        assert vision.requests == requests
        body["messages"][0]["content"] = body["messages"][0]["content"][1:]
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text


async def test_anthropic_image_errors_use_anthropic_terms(mesh, image_server):
    _, _, client, _ = mesh

    def source_url(url):
        return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": url}}, {"type": "text", "text": "Describe it."}]}]}

    bad_base64 = anthropic(b"")
    bad_base64["messages"][0]["content"][0]["source"]["data"] = "@@@not-base64@@@"
    tiff = anthropic(file_bytes(picture(4), "TIFF"), media="image/tiff")
    for body, message in ((bad_base64, "image block: source.data is not valid base64"),
                          (source_url(f"{image_server}/missing.png"), "could not fetch source.url: HTTP 404"),
                          (source_url("ftp://example.com/x.png"), "source.url must be a data: URL or an http(s) URL"),
                          (tiff, "media_type")):
        r = await client.post("/v1/messages", json=body)
        err = assert_anthropic_error(r, 400, "invalid_request_error")
        assert message in err["message"] and "image_url" not in err["message"], err
    r = await client.post("/v1/messages", json=source_url(f"{image_server}/pic.png"))
    assert r.status_code == 200, r.text


def responses_input(*parts, **extra) -> dict:
    return {"model": "m", "max_output_tokens": 4, "store": False, **extra,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, *parts]}]}


async def test_responses_input_image_with_the_openai_client(mesh, image_server):
    from openai import OpenAI

    fakes, _, client, _ = mesh
    oai = OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0)
    for url, pic in ((data_url(file_bytes(picture(12))), picture(12)), (f"{image_server}/pic.png", picture(9))):
        body = responses_input({"type": "input_image", "image_url": url, "detail": "auto"})
        out = await asyncio.to_thread(oai.responses.create, **body)
        assert out.status in ("completed", "incomplete") and out.output_text
        req = fakes.prefill_requests[-1]
        assert req.images[0][2] == image_hash(pic) and len(req.images) == 1
        assert req.prompt_token_ids.count(fakes.recipe.image_token_id) == 16
    # errors in the Responses API's words, naming the input part's image_url (after instructions, too)
    for part, message, code in (
            ({"type": "input_image", "image_url": "data:image/png;base64,@@@"},
             "input_image: the data: URL is not valid base64", "invalid_image"),
            ({"type": "input_image", "image_url": "data:image/png,raw"}, "input_image: a data: URL must be base64",
             "invalid_image_url"),
            ({"type": "input_image", "image_url": "ftp://example.com/x.png"},
             "input_image.image_url must be a data: URL or an http(s) URL", "invalid_image_url"),
            ({"type": "input_image", "image_url": f"{image_server}/missing.png"},
             "could not fetch input_image.image_url: HTTP 404", "image_fetch_failed"),
            ({"type": "input_image", "image_url": data_url(bytes(MAX_IMAGE_BYTES + 1))}, "image too large",
             "image_too_large"),
            ({"type": "input_image", "image_url": data_url(b"plain text")}, "not an image", "invalid_image")):
        r = await client.post("/v1/responses", json=responses_input(part, instructions="Be brief."))
        err = assert_openai_error(r, 400, param="input[0].content[1].image_url", code=code)
        assert message in err["message"], err
    with settings(max_images=8):
        part = {"type": "input_image", "image_url": data_url(file_bytes(picture(12)))}
        r = await client.post("/v1/responses", json=responses_input(*[part] * 9))
        err = assert_openai_error(r, 400, param="input[0].content[9]", code="too_many_images")
        assert "too many images: 9 (limit 8)" in err["message"]
    r = await client.post("/v1/responses", json=responses_input({"type": "input_image", "file_id": "file-1"}))
    err = assert_openai_error(r, 400, param="input[0].content[1]")
    assert "file_id is not supported" in err["message"]


async def test_text_only_models_refuse_images(mesh):
    fakes, _, _, text_client = mesh
    r = await text_client.post("/v1/chat/completions", json=chat(data_url(file_bytes(picture(7)))))
    err = assert_openai_error(r, 400, param="messages[0].content[1]", code="images_not_supported")
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


async def test_completions_refuse_the_image_token_without_an_image(mesh):
    fakes, _, client, text_client = mesh
    image_token = fakes.recipe.image_token_id
    before = len(fakes.prefill_requests)
    for prompt in ([1, 2, image_token, 3], "Look: <image> what is it?"):  # an id, or its text (parsed: a raw prompt)
        r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2})
        err = assert_openai_error(r, 400, param="prompt", code="image_token_without_image")
        assert f"image placeholder token (id {image_token})" in err["message"]
    assert len(fakes.prefill_requests) == before
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "Look: what is it?", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = await text_client.post("/v1/completions", json={"model": "m", "prompt": "Look: <image>", "max_tokens": 2})
    assert r.status_code == 200, r.text  # a text-only model has no image token: just text
