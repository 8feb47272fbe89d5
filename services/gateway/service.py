"""Entry point: ``python -m deepinfer.gateway`` / ``deepinfer serve gateway``.

Parses the command line (environment variables give the defaults), builds the
app and runs uvicorn on the current asyncio loop; the NATS client connects in
the app's lifespan on that same loop. uvicorn handles SIGINT / SIGTERM: it
stops accepting, finishes in-flight requests (up to 10 s), then the lifespan
drains NATS.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import uuid

import uvicorn

from deepinfer.gateway.pipeline.admission import DEFAULT_MAX_QUEUED_PREFILL_S, AdmissionConfig
from deepinfer.gateway.app import create_app
from deepinfer.gateway.config import GatewayConfig
from deepinfer.gateway.pipeline.router import PREFILL_POLICIES, RouterConfig
from deepinfer.gateway.stream.request_stream import StreamTimeouts
from deepinfer.mesh.args import env_bool, log_level
from deepinfer.telemetry import configure_logging, configure_tracing, shutdown_tracing


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="deepinfer serve gateway", description="DeepInfer OpenAI-compatible gateway")
    env = os.environ.get
    p.add_argument("--nats", default=env("DEEPINFER_NATS_URL", "nats://127.0.0.1:4222"), help="NATS URL")
    p.add_argument("--redis", default=env("DEEPINFER_REDIS_URL"), help="Redis URL for stored responses (/v1/responses)")
    p.add_argument("--model", default=env("DEEPINFER_MODEL"), help="HF model directory (default: embedded model)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: directory name)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: config.json)")
    p.add_argument("--host", default=env("DEEPINFER_GATEWAY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("DEEPINFER_GATEWAY_PORT", "8000")))
    p.add_argument("--worker-id", default=env("DEEPINFER_WORKER_ID") or f"gateway-{uuid.uuid4().hex[:8]}",
                   help="this gateway's id (env DEEPINFER_WORKER_ID; default: gateway-<random>, unique when "
                        "several gateways share the workers)")
    p.add_argument("--log-level", default=env("DEEPINFER_LOG_LEVEL", "INFO"), type=log_level,
                   help="DEBUG, INFO, WARNING or ERROR (env DEEPINFER_LOG_LEVEL; default INFO)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds without output before a request fails")
    p.add_argument("--handoff-timeout", type=float, default=15.0, help="seconds prefill->decode may take")
    p.add_argument("--mode", choices=["disagg", "agg"], default=env("DEEPINFER_MODE", "disagg"),
                   help="disagg: prefill workers compute prompts and hand off to decode workers; agg: each "
                        "request goes to one decode worker, which prefills and decodes it (env DEEPINFER_MODE; "
                        "default disagg)")
    p.add_argument("--prefill-router", choices=PREFILL_POLICIES, default=env("DEEPINFER_PREFILL_ROUTER", "predicted"),
                   help="prefill routing: predicted (smallest predicted finish time, default), round_robin, "
                        "least_loaded, dynamo (Dynamo's KV-router cost) (env DEEPINFER_PREFILL_ROUTER)")
    p.add_argument("--kv-load-bytes-per-s", type=float, default=2e9,
                   help="storage-tier read rate the router prices stored prefix blocks at (default 2e9)")
    p.add_argument("--dynamo-overlap-weight", type=float, default=1.0, help="w of --prefill-router dynamo (default 1)")
    p.add_argument("--ttft-slo-s", type=float, default=None,
                   help="answer 429 + Retry-After when the predicted time to first token exceeds this (default off)")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="answer 429 beyond this many generation streams in flight (default off)")
    p.add_argument("--max-queued-prefill-s", type=float, default=DEFAULT_MAX_QUEUED_PREFILL_S,
                   help="per prefill worker: predicted seconds of queued prompt compute beyond which it takes "
                        f"no more; none left -> 429 (default {DEFAULT_MAX_QUEUED_PREFILL_S:g}, under the request "
                        "timeout, so an admitted request is not failed for waiting; 0 = off)")
    p.add_argument("--max-decode-waiting", type=int, default=64,
                   help="per decode worker: requests queued beyond one full 64-request batch at which it takes "
                        "no more; with its free KV, what decode admission checks: no decode worker left -> 429 "
                        "(default 64)")
    add_image_args(p)
    a = p.parse_args(argv)
    return GatewayConfig(
        nats_url=a.nats,
        redis_url=a.redis or None,
        model=a.model,
        served_model_name=a.served_model_name,
        max_model_len=a.max_model_len,
        host=a.host,
        port=a.port,
        worker_id=a.worker_id,
        log_level=a.log_level,
        timeouts=StreamTimeouts(inactivity_s=a.request_timeout, handoff_s=a.handoff_timeout),
        mode=a.mode,
        routing=RouterConfig(prefill_policy=a.prefill_router, kv_load_bytes_per_s=a.kv_load_bytes_per_s,
                             dynamo_overlap_weight=a.dynamo_overlap_weight, decode_max_waiting=a.max_decode_waiting,
                             prefill_role="decode" if a.mode == "agg" else "prefill"),
        admission=AdmissionConfig(ttft_slo_s=a.ttft_slo_s, max_inflight=a.max_inflight,
                                  max_queued_prefill_s=a.max_queued_prefill_s or None),
        max_image_bytes=a.max_image_bytes,
        image_fetch_timeout_s=a.image_fetch_timeout_s,
        max_images=a.max_images,
        vision_timeout_s=a.vision_timeout_s,
        allow_remote_images=a.allow_remote_images,
        allow_private_image_urls=a.allow_private_image_urls,
        allowed_media_domains=domains(a.allowed_media_domains),
    )


def add_image_args(p: argparse.ArgumentParser) -> None:
    """The image settings (vision-language models; ``api.images``, ``api.image_fetch``). NOTE: argparse
    applies ``type`` to a string default, so a bad environment value is a usage error, not a crash."""
    env, d = os.environ.get, GatewayConfig()
    try:
        allow_remote = env_bool("DEEPINFER_ALLOW_REMOTE_IMAGES", d.allow_remote_images)
        allow_private = env_bool("DEEPINFER_ALLOW_PRIVATE_IMAGE_URLS", d.allow_private_image_urls)
    except ValueError as e:
        p.error(str(e))
    p.add_argument("--max-image-bytes", type=int, default=env("DEEPINFER_MAX_IMAGE_BYTES") or d.max_image_bytes,
                   help=f"largest image accepted, decoded or fetched (env DEEPINFER_MAX_IMAGE_BYTES; default "
                        f"{d.max_image_bytes}: within NATS's default 1 MiB max_payload)")
    p.add_argument("--image-fetch-timeout-s", type=float,
                   default=env("DEEPINFER_IMAGE_FETCH_TIMEOUT_S") or d.image_fetch_timeout_s,
                   help="seconds fetching a remote image_url may take in all: DNS, connects, redirects, body "
                        f"(env DEEPINFER_IMAGE_FETCH_TIMEOUT_S; default {d.image_fetch_timeout_s:g})")
    p.add_argument("--max-images", type=int, default=env("DEEPINFER_MAX_IMAGES") or d.max_images,
                   help=f"images one request may carry (env DEEPINFER_MAX_IMAGES; default {d.max_images})")
    p.add_argument("--vision-timeout-s", type=float,
                   default=env("DEEPINFER_VISION_TIMEOUT_S") or d.vision_timeout_s,
                   help="seconds the vision service may take to encode an image "
                        f"(env DEEPINFER_VISION_TIMEOUT_S; default {d.vision_timeout_s:g})")
    p.add_argument("--allow-remote-images", action=argparse.BooleanOptionalAction, default=allow_remote,
                   help="fetch http(s) image URLs; off: only data: URLs (env DEEPINFER_ALLOW_REMOTE_IMAGES; "
                        "default on)")
    p.add_argument("--allow-private-image-urls", action=argparse.BooleanOptionalAction, default=allow_private,
                   help="let image URLs reach private, loopback and link-local addresses (env "
                        "DEEPINFER_ALLOW_PRIVATE_IMAGE_URLS; default off: every address a host resolves to "
                        "must be public)")
    p.add_argument("--allowed-media-domains", default=env("DEEPINFER_ALLOWED_MEDIA_DOMAINS", ""),
                   help="comma-separated hosts image URLs may name, exactly (env DEEPINFER_ALLOWED_MEDIA_DOMAINS; "
                        "default empty: any host)")


def domains(text: str) -> tuple[str, ...]:
    """``--allowed-media-domains``: lower-cased host names, without a trailing dot."""
    return tuple(d.strip().lower().rstrip(".") for d in text.split(",") if d.strip())


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging("gateway", config.worker_id, config.log_level)
    configure_tracing("gateway", config.worker_id)
    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level.lower(),
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=10,
            # NOTE: longer than the clients' idle-connection expiry (httpx, so the openai and
            # anthropic clients: 5 s, uvicorn's default too): with equal timeouts a client
            # reuses a connection the server is closing that instant and its POST fails
            timeout_keep_alive=75,
        )
    )
    # NOTE: uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown,
    # which would kill us with the signal's status; a no-op handler underneath
    # makes a requested stop exit 0, like every other service.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(server.serve())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutdown_tracing()  # flush spans still batched
    return 0 if server.started else 1  # not started: the lifespan failed (e.g. NATS unreachable)
