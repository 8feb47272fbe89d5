"""Incremental detokenization that never emits a partial UTF-8 character.

Byte-level tokenizers split one character (an emoji, a CJK glyph) over several
tokens; decoding an unfinished prefix yields U+FFFD. We keep two offsets into
the generated ids (the vLLM / TGI scheme)::

    ids:  [ ... emitted ... | prefix_offset .. read_offset | read_offset .. end ]
                            '--- already emitted ---------''--- new tokens ---'

and decode the window ``ids[prefix_offset:]`` against ``ids[prefix_offset:read_offset]``:
the difference is the new text. It is emitted only when it does not end in
U+FFFD (the character is complete), then both offsets move forward. Decoding a
short window that starts one chunk back keeps tokenizers that drop a leading
space at the start of a decode (SentencePiece) correct mid-sequence.
Special tokens (EOS, chat markers) are skipped in the output text.
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What we need from a tokenizer: ``tokenizers.Tokenizer`` and HF tokenizers both fit."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids with ``add``; get back only text made of complete characters."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text ("" while a character is unfinished)."""
        self.token_ids.extend(token_ids)
        return self._new_text(final=False)

    def flush(self) -> str:
        """Generation ended: return whatever is held back, unfinished bytes as U+FFFD."""
        return self._new_text(final=True)

    def _new_text(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith(REPLACEMENT_CHAR)):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full[len(prefix) :]
        return ""

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)
