"""Chat prompt -> token ids, with control tokens only from the template.

One request through ``ChatRecipe.encode_chat``::

    messages, tools
       | template_messages / template_tools   validate; OpenAI shape -> HF shape
       | Placeholders.hide                    control strings in client text -> @@<nonce>.<k>@@
       v
    apply_chat_template(tokenize=False)       transformers' own renderer: HF's text, byte for byte
       | Vocab.spans                          control strings in it: all from the template now
       v
    [text][ctrl][text][ctrl]...[text]         segments
       | Placeholders.restore (text only)     client text back, as plain characters
       | cut long text after safe newlines
       v
    content.encode_batch(text pieces)         parallel in Rust; never matches a control string
       v
    text ids and control ids, in order        the joined string is never re-tokenized

A text segment is everything between two template control tokens: template
text (``user\\n``) and client text together. Encoding them as one unit is
what HF does for benign text (it splits only at added tokens), so a benign
conversation gets exactly ``apply_chat_template(tokenize=True)``'s ids:
encoding ``"user\\n"`` and ``"\\n\\nhi"`` apart would give other BPE pieces
than ``"user\\n\\n\\nhi"``, and templates that ``trim`` content are followed
exactly because the real text is rendered. Control strings inside client
text reach the encoder only as characters (``content`` has no control
tokens), so they yield text ids; a last check refuses any control id in text.

Text segments are independent BPE units (control tokens are hard
boundaries), so they are encoded in one ``encode_batch`` (Rust threads). A
segment longer than ``chunk_chars`` is cut after a ``"\\n"`` with non-space
characters on both sides when the tokenizer provably gives the same ids
across such a cut (``Vocab.newline_cuts``), so one long message is encoded in
parallel pieces too. The service adds request-level parallelism (a thread
pool; ``tokenizers`` releases the GIL) and replicas (NATS queue group).

Sources: deepseek-ai's "recipe"; transformers issue #29279 (control strings
in user text become control tokens); vLLM's ``split_special_tokens``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from deepinfer.recipe.messages import inline_tools, template_messages, template_tools
from deepinfer.recipe.placeholders import EdgeSets, Placeholders
from deepinfer.recipe.vocab import Vocab, load_vocab

# A cut point: right after a "\n" that follows a non-space character, before a non-space character.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")


@dataclass(frozen=True)
class Segment:
    """A piece of the prompt: text to encode (``control_id`` None) or one template control token."""

    text: str = ""
    control_id: int | None = None


def image_config(model_dir: str | Path) -> tuple[int, int] | None:
    """(image token id, tokens per image) of a LLaVA-style model directory (config.json with a
    ``vision_config``), as ``models.llava`` computes them; None for a text-only model."""
    import json

    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    vision = raw.get("vision_config")
    if not vision:
        return None
    token = raw.get("image_token_id", raw.get("image_token_index", 32000))
    per_image = (vision.get("image_size", 224) // vision.get("patch_size", 32)) ** 2
    return token, per_image + (raw.get("vision_feature_select_strategy", "default") == "full")


class ChatRecipe:
    """Encode chats for one model. Thread-safe: every request's state is local.

    hf_tokenizer: a ``transformers`` fast tokenizer (its chat template renders,
    its ``backend_tokenizer`` encodes). chunk_chars: text segments longer than
    this many characters are cut into pieces of about this size for parallel
    encoding (where the tokenizer allows; 0 = never cut).
    Raises ValueError if the tokenizer has no chat template.
    """

    def __init__(self, hf_tokenizer, chunk_chars: int = 8192, image_token_id: int | None = None,
                 tokens_per_image: int = 0):
        template = hf_tokenizer.chat_template
        if not template:
            raise ValueError("the model has no chat template")
        source = template if isinstance(template, str) else " ".join(template.values())
        self.hf = hf_tokenizer
        self.developer_role = "developer" in source
        # a template that never reads ``tools`` gets them (and tool calls) written in as text
        self.renders_tools = "tools" in source
        self.vocab: Vocab = load_vocab(hf_tokenizer.backend_tokenizer.to_str())
        self.edges = EdgeSets.of(self.vocab.control)
        self.chunk_chars = chunk_chars
        # vision-language models: the template's image token, expanded to tokens_per_image placeholders
        self.image_token_id = image_token_id if tokens_per_image else None
        self.tokens_per_image = tokens_per_image
        if self.image_token_id is not None and self.image_token_id not in self.vocab.control_ids:
            raise ValueError(f"image token {image_token_id} is not a control token of the tokenizer")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs) -> "ChatRecipe":
        """Load the tokenizer (offline) of an HF model directory."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        image = image_config(model_dir)
        if image:
            kwargs.setdefault("image_token_id", image[0])
            kwargs.setdefault("tokens_per_image", image[1])
        return cls(AutoTokenizer.from_pretrained(str(model_dir)), **kwargs)

    def encode_chat_images(self, messages, tools=None, add_generation_prompt: bool = True, *,
                           parallel: bool = True, nonce: str | None = None
                           ) -> tuple[list[int], list[tuple[int, int, str]]]:
        """Token ids of a chat prompt with image parts (``template_messages``), and per image
        ``(offset, length, content hash)`` of its placeholder run, in prompt order.

        The template renders each image part as the image token (a control token: only the
        template makes one; ``<image>`` typed by a client stays text); each one becomes
        ``tokens_per_image`` placeholder ids. Raises ValueError for image parts on a text-only
        model, or when the template rendered another number of image tokens than there are images.
        """
        if self.image_token_id is None:
            return self.encode_chat(messages, tools, add_generation_prompt, parallel=parallel, nonce=nonce), []
        hashes: list[str] = []
        segs = self.segments(messages, tools, add_generation_prompt, nonce=nonce, images=hashes)
        n = sum(seg.control_id == self.image_token_id for seg in segs)
        if n != len(hashes):
            raise ValueError(f"the chat template rendered {n} image tokens for {len(hashes)} images")
        ids = self.encode_segments(segs, parallel)
        out, it = [], iter(hashes)  # image token ids come only from the template: runs of tokens_per_image
        for pos, t in enumerate(ids):
            if t == self.image_token_id and (not out or out[-1][0] + out[-1][1] <= pos):
                out.append((pos, self.tokens_per_image, next(it)))
        return ids, out

    def encode_chat(self, messages, tools=None, add_generation_prompt: bool = True, *,
                    parallel: bool = True, nonce: str | None = None) -> list[int]:
        """Token ids of the chat prompt. Raises ValueError for messages the recipe or template refuses."""
        return self.encode_segments(self.segments(messages, tools, add_generation_prompt, nonce=nonce), parallel)

    def segments(self, messages, tools=None, add_generation_prompt: bool = True, *,
                 nonce: str | None = None, images: list[str] | None = None) -> list[Segment]:
        """Render the template and cut the prompt at the template's control tokens.

        nonce: the placeholders' nonce (20 digits; default: a fresh random one).
        Raises ValueError for bad messages, a template error, or client text containing the nonce.
        """
        msgs = template_messages(messages, self.developer_role, images)
        tool_schemas = template_tools(tools)
        if not self.renders_tools and (tool_schemas or any(m.get("tool_calls") for m in msgs)):
            msgs, tool_schemas = inline_tools(msgs, tool_schemas), None
        ph = Placeholders(self.vocab, self.edges, **({"nonce": nonce} if nonce else {}))
        roles = [m["role"] for m in msgs]  # validated names: never hidden
        hidden = ph.hide([{k: v for k, v in m.items() if k != "role"} for m in msgs])
        hidden = [{"role": r, **m} for r, m in zip(roles, hidden)]
        hidden_tools = ph.hide(tool_schemas) if tool_schemas else None
        try:
            rendered = self.hf.apply_chat_template(hidden, tools=hidden_tools, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2 TemplateError (raise_exception), TypeError on odd content...
            raise ValueError(f"chat template failed: {e}") from e
        out, pos = [], 0
        for span in self.vocab.spans([rendered])[0]:
            if span.start > pos:
                out.append(Segment(ph.restore(rendered[pos : span.start])))
            out.append(Segment(control_id=span.token_id))
            pos = span.end
        if pos < len(rendered):
            out.append(Segment(ph.restore(rendered[pos:])))
        return out

    def encode_segments(self, segments: list[Segment], parallel: bool = True) -> list[int]:
        """Encode text segments (in one parallel batch, or one by one) and join them with the control ids.

        Raises ValueError if text encodes to a control id (a tokenizer whose
        model merges text into a control token; never seen, checked anyway).
        """
        pieces: list[str] = []
        counts: list[int] = []
        for seg in segments:
            if seg.control_id is None:
                cut = self.cut(seg.text)
                pieces.extend(cut)
                counts.append(len(cut))
        tok = self.vocab.content
        if parallel:
            encodings = tok.encode_batch(pieces, add_special_tokens=False)
        else:
            encodings = [tok.encode(p, add_special_tokens=False) for p in pieces]
        ids: list[int] = []
        control = self.vocab.control_ids
        it, n = iter(encodings), iter(counts)
        for seg in segments:
            if seg.control_id is not None:
                ids.extend([seg.control_id] * (self.tokens_per_image if seg.control_id == self.image_token_id else 1))
                continue
            for _ in range(next(n)):
                piece = next(it).ids
                if not control.isdisjoint(piece):
                    raise ValueError("message text encodes to a control token")
                ids.extend(piece)
        return ids

    def cut(self, text: str) -> list[str]:
        """``text`` in pieces of about ``chunk_chars`` whose ids, joined, are ``text``'s ids."""
        every = self.chunk_chars
        if not every or len(text) <= every or not self.vocab.newline_cuts:
            return [text]
        pieces, start = [], 0
        while len(text) - start > every:
            m = _SAFE_CUT.search(text, start + every)
            if m is None:
                break
            pieces.append(text[start : m.start()])
            start = m.start()
        pieces.append(text[start:])
        return pieces
