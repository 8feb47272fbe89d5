"""Gateway settings and what it needs to know about the served model.

``GatewayConfig`` holds every knob with its default; ``load_model`` reads the
HF-format model directory: ``config.json`` for the maximum model length and the
vocabulary size (to validate ``logit_bias``) and ``tokenizer.json`` for
detokenization (falling back to ``transformers``'
AutoTokenizer, offline, when there is no ``tokenizer.json``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.gateway.pipeline.admission import AdmissionConfig
from deepinfer.gateway.stream.detokenizer import Decoder
from deepinfer.gateway.pipeline.router import RouterConfig
from deepinfer.gateway.stream.request_stream import StreamTimeouts

# config.json keys that carry the context length, by model family, in order of preference.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


@dataclass
class GatewayConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    model: str | None = None  # model directory; None = the embedded default model
    served_model_name: str | None = None  # default: the model directory's basename
    max_model_len: int | None = None  # default: from config.json
    host: str = "127.0.0.1"
    port: int = 8000
    worker_id: str = "gateway"
    log_level: str = "INFO"
    tokenizer_timeout_s: float = 10.0
    timeouts: StreamTimeouts = field(default_factory=StreamTimeouts)
    min_dead_after_s: float = 3.0  # registry: a worker is dead after max(3 intervals, this)
    # storage-tier retention classes a request may name (X-Traffic-Class header or traffic_class field)
    traffic_classes: tuple[str, ...] = ("chat", "agent")
    max_body_bytes: int = 32 << 20  # larger request bodies get 413
    # Redis for stored responses (/v1/responses ``store`` / ``previous_response_id``); None = no storage
    redis_url: str | None = None
    # "disagg": prefill workers compute prompts and hand off to decode workers; "agg" (aggregated):
    # each request goes to one worker (the decode service) that prefills and decodes it
    mode: str = "disagg"
    routing: RouterConfig = field(default_factory=RouterConfig)  # prefill / decode routing (pipeline/router.py)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # 429 limits (pipeline/admission.py)
    # images (vision-language models, api/images.py): the largest image accepted (data: URL after base64,
    # or fetched; within NATS's default 1 MiB max_payload), how long fetching a remote image_url may
    # take in all, how many images one request may carry, how long the vision service may take for them
    max_image_bytes: int = 768 << 10
    image_fetch_timeout_s: float = 10.0
    max_images: int = 8
    vision_timeout_s: float = 60.0
    # remote image URLs (api/image_fetch.py): fetched at all; from private / loopback / link-local
    # addresses too; only from these hosts (empty: any)
    allow_remote_images: bool = True
    allow_private_image_urls: bool = False
    allowed_media_domains: tuple[str, ...] = ()


@dataclass
class ModelInfo:
    path: Path
    served_name: str
    max_model_len: int
    tokenizer: Decoder
    vocab_size: int | None = None  # None: token ids are not checked against it
    takes_images: bool = False  # a vision-language model (config.json has a vision_config)
    image_token_id: int | None = None  # its image placeholder token (only images may put it in a prompt)


def load_model(config: GatewayConfig) -> ModelInfo:
    from deepinfer.models.convert import resolve_model
    from deepinfer.recipe.chat import image_config

    path = resolve_model(config.model)
    hf_config = json.loads((path / "config.json").read_text())
    image = image_config(path)  # (image token id, tokens per image) of a vision-language model
    return ModelInfo(
        path=path,
        served_name=config.served_model_name or path.name,
        max_model_len=config.max_model_len or _max_model_len(hf_config),
        tokenizer=load_tokenizer(path),
        vocab_size=_vocab_size(hf_config),
        takes_images=image is not None,
        image_token_id=image[0] if image else None,
    )


def _max_model_len(hf_config: dict) -> int:
    for cfg in (hf_config, hf_config.get("text_config") or {}):
        for key in _MAX_LEN_KEYS:
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    raise ValueError("config.json has no max_position_embeddings; pass --max-model-len")


def _vocab_size(hf_config: dict) -> int | None:
    for cfg in (hf_config, hf_config.get("text_config") or {}):
        if isinstance(cfg.get("vocab_size"), int) and cfg["vocab_size"] > 0:
            return cfg["vocab_size"]
    return None


def load_tokenizer(path: Path) -> Decoder:
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / "tokenizer.json"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
