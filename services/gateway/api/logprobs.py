"""``TokenChunk.logprobs`` (and ``prompt_logprobs``) -> OpenAI's ``choices[].logprobs.content`` entries.

One entry per generated token::

    {"token": str, "logprob": float, "bytes": [int, ...],
     "top_logprobs": [{"token": str, "logprob": float, "bytes": [int, ...]}, ...]}

``bytes`` are the token's own UTF-8 bytes, so a client can rebuild text that
a token splits mid-character (``token`` then holds U+FFFD, as vLLM does).
They come from the vocabulary entry itself: byte-level BPE pieces (GPT-2,
Llama 3, SmolLM) map back through the byte-to-unicode table, SentencePiece
pieces turn ``▁`` into a space and ``<0xNN>`` into that byte, added tokens are
their content. A tokenizer that is none of these (no ``tokenizers`` backend)
falls back to decoding the single token.

A logprob of ``-inf`` (a token masked by min_tokens) becomes -9999.0, which
JSON can carry (vLLM does the same).
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache

from deepinfer.gateway.stream.detokenizer import Decoder

MIN_LOGPROB = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """token id -> (text, bytes) for one tokenizer, cached."""

    def __init__(self, tokenizer: Decoder):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # HF fast tokenizers wrap one
        self._backend = backend if hasattr(backend, "id_to_token") else None
        self._added: dict[int, str] = {}
        self._byte_level = False
        if self._backend is not None:
            self._added = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}
            self._byte_level = "ByteLevel" in _decoder_types(self._backend)
        self.lookup = lru_cache(maxsize=1 << 16)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        raw = self._bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._backend.id_to_token(token_id) if self._backend is not None else None
        if piece is None:
            return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        if self._byte_level:
            table = _unicode_to_byte()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode()
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()


def content(token_bytes: TokenBytes, token_ids: list[int], wire: list[list] | None) -> list[dict]:
    """The ``logprobs.content`` entries of one chunk (``wire``: ``TokenChunk.logprobs``, aligned with ids)."""
    if not wire:
        return []
    return [
        {**_entry(token_bytes, tok, lp), "top_logprobs": [_entry(token_bytes, t, v) for t, v in top]}
        for tok, (lp, top) in zip(token_ids, wire)
    ]


def prompt_content(token_bytes: TokenBytes, prompt_ids: list[int], wire: list) -> list[dict]:
    """``content`` entries of the prompt's tokens (``wire``: ``TokenChunk.prompt_logprobs``, aligned
    with ``prompt_ids``); the first token's ``logprob`` and ``top_logprobs`` are None (nothing
    predicts it), as OpenAI and vLLM return them."""
    out = []
    for tok, item in zip(prompt_ids, wire):
        if item is None:
            text, raw = token_bytes.lookup(int(tok))
            out.append({"token": text, "logprob": None, "bytes": list(raw), "top_logprobs": None})
        else:
            lp, top = item
            out.append({**_entry(token_bytes, tok, lp), "top_logprobs": [_entry(token_bytes, t, v) for t, v in top]})
    return out


def _entry(token_bytes: TokenBytes, token_id: int, logprob: float) -> dict:
    text, raw = token_bytes.lookup(int(token_id))
    value = logprob if math.isfinite(logprob) else MIN_LOGPROB
    return {"token": text, "logprob": max(value, MIN_LOGPROB), "bytes": list(raw)}


def _decoder_types(backend) -> set[str]:
    """Type names of the tokenizer's decoder and, for a Sequence, of its parts."""
    if backend.decoder is None:
        return set()
    spec = json.loads(backend.decoder.__getstate__())
    parts = spec.get("decoders") or []
    return {spec.get("type")} | {p.get("type") for p in parts}


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves, the rest are shifted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, shifted = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + shifted)] = b
            shifted += 1
    return out
