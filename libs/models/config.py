"""Model configuration read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModelConfig:
    """The fields the engine needs; names follow Hugging Face's LlamaConfig.

    Family-specific fields (MoE sizes, layer types, soft-capping...) are read
    from ``raw`` (the whole config.json) by the family's model class.

    Multimodal configs (LLaVA: ``text_config`` + ``vision_config``) take these
    fields from ``text_config``; ``model_type`` stays the outer one ("llava") and
    ``raw`` is the whole config with both sub-configs completed by transformers'
    defaults (llava-1.5 checkpoints give only the non-default fields).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_parameters: dict = field(default_factory=dict)
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    dtype: str = "float32"
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` (and ``generation_config.json`` for EOS ids) from ``path``.

        Raises FileNotFoundError if config.json is missing.
        """
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        text = raw
        if "text_config" in raw:  # multimodal: complete the sub-configs with their class defaults
            from transformers import AutoConfig

            raw = AutoConfig.from_pretrained(path).to_dict()
            text = raw["text_config"]
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        gen = path / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        heads = text["num_attention_heads"]
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        if not any(isinstance(v, dict) for v in rope.values()):  # Gemma 3 keeps one dict per layer type
            rope.setdefault("rope_theta", text.get("rope_theta", 10000.0))
            rope.setdefault("rope_type", rope.get("type", "default"))
        # NOTE: Gemma configs default to tied embeddings and may omit the key; LLaVA ties when
        # either its own or its text config's flag says so (LlavaConfig.__post_init__).
        tie = text.get("tie_word_embeddings", text.get("model_type", "").startswith("gemma"))
        return cls(
            model_type=raw.get("model_type", "llama"),
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_hidden_layers=text["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=text.get("num_key_value_heads", heads),
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            max_position_embeddings=text.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(tie or (text is not raw and raw.get("tie_word_embeddings"))),
            rope_parameters=rope,
            attention_bias=text.get("attention_bias", False),
            mlp_bias=text.get("mlp_bias", False),
            eos_token_ids=eos_ids,
            bos_token_id=text.get("bos_token_id"),
            dtype=raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or "float32",
            raw=raw,
        )
