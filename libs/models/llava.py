"""LLaVA (``LlavaForConditionalGeneration``, model_type ``llava``): a CLIP ViT vision tower and a
two-layer projector feeding image features, as token embeddings, to a Llama-family decoder.

Source: Liu et al. 2023, "Visual Instruction Tuning" (LLaVA, arXiv 2304.08485) and LLaVA-1.5
(Liu et al. 2023, "Improved Baselines with Visual Instruction Tuning", arXiv 2310.03744);
``transformers`` modeling_llava (LlavaModel.get_image_features, LlavaMultiModalProjector) and
modeling_clip (CLIPVisionModel), followed operation for operation::

    pixel_values [N, 3, S, S] ──patch conv (stride P) + CLS + positions──> [N, 1 + (S/P)^2, Dv]
        ──pre_layrnorm──> hidden_states[0] ──encoder layer 1..L──> hidden_states[1..L]
        ──pick hidden_states[l] for l in vision_feature_layer (concat on Dv if a list)──>
        ──"default": drop the CLS row / "full": keep it──> [N, T_img, Dv * len(layers)]
        ──linear_1 ─ act (projector_hidden_act, GELU) ─ linear_2──> [N, T_img, hidden]

The text part is our Llama family (``LlamaForCausalLM``: Llama, Vicuna, Mistral text configs), so
``load_model`` on a LLaVA directory gives a model that serves text-only prompts exactly like the
Llama family. A prompt with images carries ``T_img`` placeholder tokens (``image_token_id``) per
image, as transformers' LlavaProcessor expands ``<image>``; their rows take the image features
through ``CausalLM.forward(..., input_embeds_override=(rows, embeds))`` (HF's ``masked_scatter``
in LlavaModel.forward), in order: image i's T_img rows are the i-th run of placeholders.

Only ``encode_images`` looks at pixels; it is a pure function of them (no state, no cache), so a
vision service can run it apart and cache its output by the image's content hash.

Checkpoint names: transformers 5.x writes ``language_model.model.*``, ``language_model.lm_head.*``,
``vision_tower.*`` (no ``vision_model.`` level), ``multi_modal_projector.*``; llava-1.5-hf
checkpoints (transformers 4.x) have ``vision_tower.vision_model.*``; transformers 4.52+'s in-memory
names are ``model.language_model.*`` / ``model.vision_tower.*``. ``checkpoint_name`` maps all of them
onto ours (the CausalLM's ``model.*`` / ``lm_head.*``, plus ``vision_tower.*`` and
``multi_modal_projector.*``). The tower is built only up to the deepest feature layer (LLaVA-1.5
takes the penultimate one: its last layer and ``post_layernorm`` are never run and not loaded).

Not supported (NotImplementedError): vision towers other than CLIP (SigLIP...), text families other
than Llama/Mistral, images of another size than the tower's (``interpolate_pos_encoding``), and the
LLaVA-NeXT family (``llava_next``: any-resolution tiles, image newline).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import ACTIVATIONS
from deepinfer.models.llama import LlamaForCausalLM

# transformers' ACT2FN names used by CLIP (quick_gelu) and LLaVA's projector (gelu)
VISION_ACTIVATIONS = {**ACTIVATIONS, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}
TEXT_MODEL_TYPES = ("llama", "mistral")
VISION_MODEL_TYPES = ("clip_vision_model",)

# checkpoint prefix -> ours, first match wins (see the module docstring)
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def _activation(name: str):
    if name not in VISION_ACTIVATIONS:
        raise NotImplementedError(f"activation {name!r}")
    return VISION_ACTIVATIONS[name]


class CLIPVisionEmbeddings(nn.Module):
    """pixels [N, C, S, S] -> [N, 1 + (S/P)^2, D]: patch conv (no bias) + class token + learned positions."""

    def __init__(self, vcfg: dict):
        super().__init__()
        d, p = vcfg["hidden_size"], vcfg["patch_size"]
        self.image_size, self.patch_size = vcfg["image_size"], p
        self.class_embedding = nn.Parameter(torch.empty(d))
        self.patch_embedding = nn.Conv2d(vcfg.get("num_channels", 3), d, kernel_size=p, stride=p, bias=False)
        self.position_embedding = nn.Embedding((self.image_size // p) ** 2 + 1, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n = pixel_values.shape[0]
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [N, (S/P)^2, D]
        x = torch.cat([self.class_embedding.expand(n, 1, -1), patches], dim=1)
        return x + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Bidirectional multi-head attention over an image's tokens, [N, T, D] -> [N, T, D]."""

    def __init__(self, vcfg: dict):
        super().__init__()
        d = vcfg["hidden_size"]
        self.num_heads = vcfg["num_attention_heads"]
        self.head_dim = d // self.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape

        def heads(y):
            return y.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                           scale=self.head_dim**-0.5)
        return self.out_proj(o.transpose(1, 2).reshape(n, t, -1))


class CLIPMLP(nn.Module):
    def __init__(self, vcfg: dict):
        super().__init__()
        self.fc1 = nn.Linear(vcfg["hidden_size"], vcfg["intermediate_size"])
        self.fc2 = nn.Linear(vcfg["intermediate_size"], vcfg["hidden_size"])
        self.act = _activation(vcfg.get("hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, vcfg: dict):
        super().__init__()
        d, eps = vcfg["hidden_size"], vcfg.get("layer_norm_eps", 1e-5)
        self.self_attn = CLIPAttention(vcfg)
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.mlp = CLIPMLP(vcfg)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, vcfg: dict, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(vcfg) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """CLIP ViT (Radford et al. 2021) as LLaVA uses it: hidden states, no pooling, no post-norm.

    Holds the first ``num_layers`` encoder layers only (the deepest feature layer LLaVA reads).
    """

    def __init__(self, vcfg: dict, num_layers: int):
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(vcfg)
        self.pre_layrnorm = nn.LayerNorm(vcfg["hidden_size"], eps=vcfg.get("layer_norm_eps", 1e-5))
        self.encoder = CLIPEncoder(vcfg, num_layers)

    def forward(self, pixel_values: torch.Tensor, feature_layers: Sequence[int]) -> list[torch.Tensor]:
        """pixels [N, C, S, S] -> ``[hidden_states[l] for l in feature_layers]``, each [N, 1 + (S/P)^2, D];
        ``l`` (>= 0) as in HF's ``hidden_states``: 0 after ``pre_layrnorm``, l after encoder layer l."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        hidden = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            hidden.append(x)
        return [hidden[i] for i in feature_layers]


class LlavaMultiModalProjector(nn.Module):
    """``linear_2(act(linear_1(features)))``: vision width (times the number of feature layers) -> text width."""

    def __init__(self, in_dim: int, hidden: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, hidden, bias=bias)
        self.act = _activation(act)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """A Llama-family CausalLM (the engine's contract unchanged: ``forward``, ``attention_layers``,
    ``config``...) plus ``vision_tower`` and ``multi_modal_projector`` for ``encode_images``.

    ``config`` is the whole model's ``ModelConfig`` (model_type "llava", text fields from
    ``text_config``, ``raw`` the completed config.json); ``text_config`` the language model's
    (``raw`` = text_config), ``vision_config`` the vision tower's dict.
    """

    def __init__(self, cfg: ModelConfig):
        raw = cfg.raw
        text, vision = raw["text_config"], raw["vision_config"]
        if text.get("model_type", "llama") not in TEXT_MODEL_TYPES:
            raise NotImplementedError(f"LLaVA with a {text.get('model_type')!r} language model")
        if vision.get("model_type") not in VISION_MODEL_TYPES:
            raise NotImplementedError(f"LLaVA with a {vision.get('model_type')!r} vision tower")
        text_cfg = dataclasses.replace(cfg, model_type=text.get("model_type", "llama"), raw=text)
        super().__init__(text_cfg)
        self.config, self.text_config, self.vision_config = cfg, text_cfg, vision
        self.vision_feature_layers = feature_layers(raw.get("vision_feature_layer", -2), vision["num_hidden_layers"])
        self.vision_feature_select_strategy = raw.get("vision_feature_select_strategy", "default")
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.vision_feature_select_strategy!r}")
        self.vision_tower = CLIPVisionTower(vision, max(self.vision_feature_layers))
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision["hidden_size"] * len(self.vision_feature_layers), cfg.hidden_size,
            raw.get("projector_hidden_act", "gelu"), raw.get("multimodal_projector_bias", True))

    @staticmethod
    def checkpoint_name(key: str) -> str:
        """A checkpoint tensor's name (any layout in the module docstring) -> ours."""
        for old, new in _PREFIXES:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        if key.startswith("vision_tower.vision_model."):
            key = "vision_tower." + key[len("vision_tower.vision_model."):]
        return key

    # --- what the mesh needs to know ------------------------------------------------
    @property
    def image_token_id(self) -> int:
        """The placeholder token id (``image_token_id`` / ``image_token_index``; 32000 in llava-1.5)."""
        raw = self.config.raw
        return raw["image_token_id"] if raw.get("image_token_id") is not None else raw.get("image_token_index", 32000)

    @property
    def image_size(self) -> int:
        """Side S of the square pixel input ``encode_images`` takes (the processor resizes and crops to it)."""
        return self.vision_config["image_size"]

    @property
    def tokens_per_image(self) -> int:
        """T_img: placeholders (and feature rows) per image, ``(S/P)^2``, plus 1 (CLS) for "full"."""
        return (self.image_size // self.vision_config["patch_size"]) ** 2 + (
            self.vision_feature_select_strategy == "full")

    # --- vision -----------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] (float, normalized by the checkpoint's image processor: see
        ``preprocess``) -> image embeddings [N, T_img, hidden] in the model's dtype and device.

        Vision tower, feature selection (``vision_feature_layer``, ``vision_feature_select_strategy``),
        projector: HF's ``get_image_features`` (its ``pooler_output``, stacked). Images are
        independent: each one's rows depend only on its own pixels.
        """
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[2:]) != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values must be [N, 3, {self.image_size}, {self.image_size}], "
                             f"not {list(pixel_values.shape)}")
        w = self.vision_tower.embeddings.patch_embedding.weight
        hidden = self.vision_tower(pixel_values.to(w.device, w.dtype), self.vision_feature_layers)
        if self.vision_feature_select_strategy == "default":
            hidden = [h[:, 1:] for h in hidden]
        return self.multi_modal_projector(torch.cat(hidden, dim=-1))

    def image_embeds_override(self, input_ids: torch.Tensor,
                              image_embeds: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``input_embeds_override`` of a packed step whose placeholders all get features:
        input_ids [T] int64 holding ``K = sum of T_img`` placeholder rows (``image_token_id``);
        image_embeds [N, T_img, hidden] (or a list of [T_img, hidden]) in prompt order
        -> (rows [K] int64, embeds [K, hidden]). Raises ValueError when the counts differ.

        A chunked prefill that cuts an image apart must instead pass only its chunk's rows
        with the matching slice of that image's embeddings.
        """
        rows = (input_ids == self.image_token_id).nonzero().flatten()
        if not torch.is_tensor(image_embeds):
            image_embeds = torch.cat(list(image_embeds)) if len(image_embeds) else torch.empty(0, self.config.hidden_size)
        embeds = image_embeds.reshape(-1, self.config.hidden_size)
        if rows.numel() != embeds.shape[0]:
            raise ValueError(f"{rows.numel()} image placeholder tokens but {embeds.shape[0]} image feature rows")
        return rows, embeds


def feature_layers(layer: int | Sequence[int], num_hidden_layers: int) -> list[int]:
    """``vision_feature_layer`` (an index into HF's ``hidden_states`` tuple of L + 1, negative from the end;
    or a list of them) -> non-negative indices. Raises ValueError when out of range."""
    layers = [layer] if isinstance(layer, int) else list(layer)
    out = [i + num_hidden_layers + 1 if i < 0 else i for i in layers]
    if not layers or any(not 0 <= i <= num_hidden_layers for i in out):
        raise ValueError(f"vision_feature_layer {layer!r} outside the tower's {num_hidden_layers} + 1 hidden states")
    return out


# --- preprocessing -------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def image_processor(model_dir: str):
    """The checkpoint's image processor (``AutoImageProcessor``: CLIPImageProcessor for llava-1.5), cached."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir)


def preprocess(images: Sequence, model_dir: str | Path) -> torch.Tensor:
    """PIL images (any size, any mode) -> pixel_values [N, 3, S, S] float32, exactly as transformers'
    processor makes them from ``model_dir``'s image processor config (CLIP: RGB, resize the shortest
    edge to S (bicubic), centre crop S x S, rescale to [0, 1], normalize by CLIP's mean and std)."""
    out = image_processor(str(Path(model_dir).resolve()))(images=list(images), return_tensors="pt")
    return out["pixel_values"].float()
