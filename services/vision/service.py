"""Vision service: image decoding and the vision tower, embeddings cached by content hash.

Lifecycle of a request in this service:
  1. ``deepinfer.vision.encode`` (queue group ``vision``: any replica answers): a
     ``VisionEncodeRequest`` with a request's images (file bytes) arrives from the gateway.
  2. Each image is checked and decoded (``decode_image``: size in bytes, format, pixel count,
     truncation; PIL), converted to RGB and hashed (``image_hash``: SHA-256 of the RGB pixels
     and the size). Any bad image refuses the whole request with ``ErrorReply(kind="bad_request")``
     naming it (the gateway's 400).
  3. Images whose embeddings are already in the storage tier
     (``<kv root>/<embeddings fingerprint>/embeddings/<hash[:2]>/<hash>.kvb``, the block file
     format of ``deepinfer.kvstore``, written atomically) and read back whole (checksum and shape
     verified, as prefill will read them: a damaged file is deleted and counts as a miss) are
     done. The others are preprocessed
     by the checkpoint's image processor and encoded in one forward pass of the vision tower and
     projector (``model.encode_images``, in a worker thread), and their embeddings
     [tokens_per_image, hidden] written to the tier. Two requests with the same image at once
     share one forward (in-flight table).
  4. The reply is a ``VisionEncodeReply``: per image its hash, whether it was cached, the tokens
     per image and the embeddings fingerprint; prefill reads the embeddings by hash.

Why hash the decoded pixels, not the file bytes: the embeddings are a function of the RGB pixels
only, so the same picture sent as PNG and as WebP (or with other metadata) shares one cache entry
and one KV prefix; decoding is needed anyway to validate the image. The hash covers
``b"deepinfer-image-v1" ‖ width ‖ height (LE u32) ‖ RGB bytes``.

Load report: ``vision_forwards`` (tower forward passes), ``vision_images`` (images encoded) and
``vision_cache_hits`` (images found in the tier) since start, ``finished_requests``. The same
counters, cache misses and the storage tier's traffic are on ``/metrics`` (``--metrics-port``):
``deepinfer_vision_forwards_total``, ``deepinfer_vision_cache_hits_total``,
``deepinfer_vision_cache_misses_total``, ... (``telemetry.metrics.vision_families``).

Scaling: run more replicas; they share the queue group and the storage tier.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor

from deepinfer.kvstore.embeddings import EMBEDDINGS_CLASS
from deepinfer.kvstore.hashing import embeddings_fingerprint
from deepinfer.kvstore.store import BlockStore
from deepinfer.mesh import Service, run_service
from deepinfer.mesh.args import service_parser
from deepinfer.models.convert import resolve_model
from deepinfer.protocol import ErrorReply, LoadReport, VisionEncodeReply, VisionEncodeRequest, subjects
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_IMAGE_BYTES = 768 << 10  # below NATS's default max_payload (1 MiB) with room for the envelope
MAX_PIXELS = 4096 * 4096
MAX_IMAGES = 8  # per request


class BadImage(ValueError):
    """An image the API refuses (a 400): the message says which and why."""


def decode_image(data: bytes, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_PIXELS):
    """File bytes -> a fully loaded RGB ``PIL.Image``. Raises BadImage: too large, not an image,
    an unsupported format, too many pixels (checked from the header, before decoding), truncated."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise BadImage("empty image")
    if len(data) > max_bytes:
        raise BadImage(f"image too large: {len(data)} bytes (limit {max_bytes})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise BadImage("not an image (unrecognised data)") from None
    except Exception as e:  # a damaged header
        raise BadImage(f"not a valid image: {e}") from None
    if img.format not in FORMATS:
        raise BadImage(f"unsupported image format {img.format} (supported: {', '.join(FORMATS)})")
    w, h = img.size
    if w * h > max_pixels:
        raise BadImage(f"image has too many pixels: {w}x{h} (limit {max_pixels})")
    if w < 1 or h < 1:
        raise BadImage(f"image has no pixels ({w}x{h})")
    try:
        img.load()  # PIL raises OSError on truncated data (ImageFile.LOAD_TRUNCATED_IMAGES is off)
    except Exception as e:
        raise BadImage(f"truncated or corrupt {img.format} image: {e}") from None
    return img.convert("RGB")


def image_hash(rgb) -> str:
    """Content hash of an RGB ``PIL.Image``: hex SHA-256 of a version tag, its size and its pixels."""
    h = hashlib.sha256(b"deepinfer-image-v1")
    h.update(struct.pack("<II", *rgb.size))
    h.update(rgb.tobytes())
    return h.hexdigest()


class VisionService(Service):
    role = "vision"

    def __init__(self, nats_url: str, model_dir: str, kv_root: str, worker_id: str | None = None,
                 dtype: str = "float32", device: str = "cpu", max_image_bytes: int = MAX_IMAGE_BYTES,
                 max_pixels: int = MAX_PIXELS, max_images: int = MAX_IMAGES):
        super().__init__(nats_url, worker_id)
        from deepinfer.models.loader import load_model

        self.model_dir = model_dir
        self.model, _ = load_model(model_dir, dtype, device)
        if not hasattr(self.model, "encode_images"):
            raise ValueError(f"{model_dir}: a text-only model ({type(self.model).__name__}); "
                             "a vision worker needs a vision-language model")
        self.model.eval()
        self.tokens_per_image = self.model.tokens_per_image
        self.fingerprint = embeddings_fingerprint(model_dir, dtype)
        self.store = BlockStore(kv_root, self.fingerprint)
        self.max_image_bytes, self.max_pixels, self.max_images = max_image_bytes, max_pixels, max_images
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="vision")  # one forward at a time
        self.io = ThreadPoolExecutor(2, thread_name_prefix="vision-io")
        self.inflight: dict[str, asyncio.Future] = {}
        self.forwards = self.images_encoded = self.cache_hits = self.cache_misses = self.requests = 0
        self.damaged = 0  # stored embeddings found damaged (and encoded again)

    async def setup(self) -> None:
        sub = await self.mesh.subscribe(subjects.VISION_ENCODE, self.on_encode, queue=subjects.VISION_GROUP,
                                        span_name="vision.encode")
        self.intake.append(sub)

    def load_report(self) -> LoadReport:
        return LoadReport(role=self.role, worker_id=self.worker_id, active_requests=len(self.inflight),
                          steps=self.forwards, finished_requests=self.requests, vision_forwards=self.forwards,
                          vision_images=self.images_encoded, vision_cache_hits=self.cache_hits)

    async def metric_families(self) -> list:
        """The vision counters (forwards, images encoded, tier hits and misses) and the storage
        tier's traffic, read at scrape time (``--metrics-port``)."""
        from deepinfer.telemetry import metrics

        return [*await super().metric_families(), *metrics.vision_families(self),
                *metrics.store_families(self.store.stats.snapshot())]

    async def on_encode(self, req: VisionEncodeRequest):
        if self.draining:
            return ErrorReply(error="draining", kind="internal")
        loop = asyncio.get_running_loop()
        if len(req.images) > self.max_images:
            return ErrorReply(error=f"too many images: {len(req.images)} (limit {self.max_images})",
                              kind="bad_request")
        try:
            decoded = await loop.run_in_executor(self.io, self.decode_all, list(req.images))
        except BadImage as e:
            return ErrorReply(error=str(e), kind="bad_request")
        hashes = [h for h, _ in decoded]
        cached = await loop.run_in_executor(self.io, lambda: [self.stored(h) for h in hashes])
        waits, mine = [], {}
        for (h, rgb), hit in zip(decoded, cached):
            if hit:
                continue
            if h in self.inflight:
                waits.append(self.inflight[h])
            elif h not in mine:
                mine[h] = rgb
        if mine:
            fut = loop.create_future()
            for h in mine:
                self.inflight[h] = fut
            try:
                await loop.run_in_executor(self.pool, self.encode_and_store, mine)
                fut.set_result(None)
            except Exception as e:
                fut.set_exception(e)
                fut.exception()  # retrieved: waiters re-raise it, no "never retrieved" warning
                log.exception("vision_encode_failed", request_id=req.request_id)
                return ErrorReply(error=f"vision encoder failed: {e}", kind="internal")
            finally:
                for h in mine:
                    self.inflight.pop(h, None)
        try:
            for w in waits:
                await w
        except Exception as e:
            return ErrorReply(error=f"vision encoder failed: {e}", kind="internal")
        self.cache_hits += sum(cached)
        self.cache_misses += len(cached) - sum(cached)
        self.requests += 1
        log.info("images_encoded", request_id=req.request_id, images=len(hashes), cache_hits=sum(cached),
                 encoded=len(mine))
        return VisionEncodeReply(request_id=req.request_id, image_hashes=hashes,
                                 tokens_per_image=self.tokens_per_image, embeddings_fingerprint=self.fingerprint,
                                 cached=list(cached))

    def stored(self, h: str) -> bool:
        """Whether the tier holds image ``h``'s embeddings whole: read and verified as prefill will
        read them (the block file's checksum, then the shape). A damaged or misshapen file is a
        miss, so the image is encoded and written again (the write replaces the file)."""
        path = self.store.path(h, EMBEDDINGS_CLASS)
        if not path.exists():
            return False
        e = self.store.get(h, EMBEDDINGS_CLASS)
        if e is not None and e.dim() == 2 and e.shape[0] == self.tokens_per_image:
            return True
        self.damaged += 1
        log.warning("embeddings_damaged", image_hash=h, action="re-encoding")
        return False

    def decode_all(self, images: list[bytes]) -> list[tuple[str, object]]:
        """Each image decoded and hashed. Raises BadImage naming the image ("image <i>: ") when
        the request has several."""
        out = []
        for i, data in enumerate(images):
            try:
                rgb = decode_image(data, self.max_image_bytes, self.max_pixels)
            except BadImage as e:
                raise BadImage(f"image {i}: {e}" if len(images) > 1 else str(e)) from None
            out.append((image_hash(rgb), rgb))
        return out

    def encode_and_store(self, images: dict[str, object]) -> None:
        """One vision forward over ``images`` (hash -> RGB image); each one's embeddings to the tier."""
        import torch

        from deepinfer.models.llava import preprocess

        pixels = preprocess(list(images.values()), self.model_dir)
        with torch.inference_mode():
            embeds = self.model.encode_images(pixels)
        self.forwards += 1
        self.images_encoded += len(images)
        for h, e in zip(images, embeds):
            self.store.put(h, e, EMBEDDINGS_CLASS, num_tokens=e.shape[0])
        log.info("vision_forward", images=len(images), forwards=self.forwards)

    async def teardown(self) -> None:
        self.pool.shutdown(wait=False)
        self.io.shutdown(wait=False)


def read_embeddings(store: BlockStore, image_hash_hex: str):
    """An image's embeddings [tokens_per_image, hidden] from the tier (``store`` opened on the
    embeddings fingerprint), or None when missing or damaged (the block store's checks)."""
    return store.get(image_hash_hex, EMBEDDINGS_CLASS)


def main(argv: list[str] | None = None) -> None:
    import os

    p = service_parser("vision", "Image decoding and the vision encoder; embeddings cached by content hash")
    default_root = os.environ.get("DEEPINFER_KV_ROOT", os.path.expanduser("~/.cache/deepinfer/kvstore"))
    p.add_argument("--kv-root", default=default_root,
                   help="the storage tier's root, shared with prefill (env DEEPINFER_KV_ROOT)")
    p.add_argument("--dtype", default=os.environ.get("DEEPINFER_DTYPE", "float32"), help="vision tower dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-image-bytes", type=int,
                   default=os.environ.get("DEEPINFER_MAX_IMAGE_BYTES") or MAX_IMAGE_BYTES,
                   help="largest image file accepted (env DEEPINFER_MAX_IMAGE_BYTES, as the gateway's; "
                        "NATS's max_payload bounds a whole request)")
    p.add_argument("--max-pixels", type=int, default=MAX_PIXELS, help="largest width x height accepted")
    args = p.parse_args(argv)
    service = VisionService(args.nats, str(resolve_model(args.model)), args.kv_root, args.worker_id,
                            args.dtype, args.device, args.max_image_bytes, args.max_pixels)
    run_service(service, args.log_level, metrics_port=args.metrics_port)
