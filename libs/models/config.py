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
        eos = raw.get("eos_token_id")
        gen = path / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if not any(isinstance(v, dict) for v in rope.values()):  # Gemma 3 keeps one dict per layer type
            rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
            rope.setdefault("rope_type", rope.get("type", "default"))
        return cls(
            model_type=raw.get("model_type", "llama"),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            # NOTE: Gemma configs default to tied embeddings and may omit the key.
            tie_word_embeddings=raw.get("tie_word_embeddings", raw.get("model_type", "").startswith("gemma")),
            rope_parameters=rope,
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
            raw=raw,
        )
