"""A tiny random LLaVA checkpoint for tests and mesh development (seconds on a CPU, ~26 MB).

``make_tiny_llava(out_dir)`` writes a Hugging Face-format directory that transformers' own
``LlavaForConditionalGeneration`` / ``AutoProcessor`` / ``AutoImageProcessor`` and our
``load_model`` all read:

* vision: CLIP ViT, 32 x 32 pixels, 8 x 8 patches (16 patches + CLS), width 32, 2 layers,
  ``vision_feature_layer`` -2 and strategy "default" (llava-1.5's choices): 16 tokens per image;
* projector: linear(32 -> 64) - GELU - linear(64 -> 64), with biases;
* text: Llama, width 64, 2 layers, 4 query / 2 KV heads, untied head;
* vocabulary: the embedded default model's tokenizer (SmolLM2-135M-Instruct, 49152 tokens,
  ``convert.ensure_default_model``; converted on first use) plus one added special token
  ``<image>`` (id 49152 = ``image_token_index``), so real text tokenizes;
  ``vocab_size`` 49153. EOS ``<|im_end|>`` as in SmolLM2;
* a ChatML chat template (SmolLM2's format) that also renders list contents, an image part
  (``{"type": "image"}`` / ``"image_url"``) as ``<image>``, on the tokenizer and the processor;
* ``processor_config.json`` (LlavaProcessor: expands each ``<image>`` into 16 placeholders) and
  ``preprocessor_config.json`` (CLIPImageProcessor: shortest edge 32, centre crop 32 x 32, CLIP
  mean/std).

Weights: every matrix ~ N(0, 0.1^2), every 1-D tensor (norm weights, biases, CLS) its default
plus N(0, 0.2^2) noise, so a norm or bias loaded wrongly changes the outputs; seeded.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<image>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def make_tiny_llava(out_dir: str | Path, seed: int = 0, *, tokenizer_dir: str | Path | None = None,
                    image_size: int = 32, patch_size: int = 8, vision_feature_layer: int | list[int] = -2,
                    vision_feature_select_strategy: str = "default", tie_word_embeddings: bool = False) -> Path:
    """Write a tiny random LLaVA (see the module docstring) to ``out_dir``; return it as a Path.

    ``tokenizer_dir`` defaults to the embedded default model's directory. The keyword options
    vary the vision side (feature layers, "full" keeps CLS: ``(S/P)^2 + 1`` tokens per image)
    and tie the head to the embeddings.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    if tokenizer_dir is None:
        from deepinfer.models.convert import ensure_default_model

        tokenizer_dir = ensure_default_model(progress=False)
    out = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = CLIPVisionConfig(image_size=image_size, patch_size=patch_size, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       tie_word_embeddings=tie_word_embeddings)
    num_tokens = (image_size // patch_size) ** 2 + (vision_feature_select_strategy == "full")
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         image_seq_length=num_tokens, vision_feature_layer=vision_feature_layer,
                         vision_feature_select_strategy=vision_feature_select_strategy,
                         tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.2)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=patch_size,
                               vision_feature_select_strategy=vision_feature_select_strategy,
                               num_additional_image_tokens=1, image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)  # tokenizer files + processor_config.json
    image_processor.save_pretrained(out)  # preprocessor_config.json, for loaders that read only that
    return out
