"""Incremental detokenization that never emits a partial UTF-8 character.

Byte-level tokenizers split one character (an emoji, a CJK glyph) over several
tokens; decoding an unfinished prefix yields U+FFFD. We keep two offsets into
the generated ids (the vLLM / TGI scheme)::

    ids:  [ ... emitted ... | prefix_offset .. read_offset | read_offset .. end ]
                            '--- last emitted piece ------''--- not yet emitted -'

and decode the window ``ids[prefix_offset:end]`` against ``ids[prefix_offset:read_offset]``:
the difference is the new text. Text is emitted only up to the last token
after which the window's text does not end in U+FFFD (its characters are
complete); then ``prefix_offset`` moves to the old ``read_offset`` and
``read_offset`` to that token. Decoding a short window that starts one piece
back keeps decoders that treat the start of a decode specially (SentencePiece
drops a leading space) right mid-sequence.

* Special tokens (EOS, chat markers) are dropped from the ids before
  windowing when ``skip_special_tokens`` (what ``decode(..., skip_special_tokens=True)``
  drops), so a window never starts with one.
* ``flush`` (generation ended) emits what is complete and drops an
  incomplete tail: a generation cut mid-character by ``max_tokens`` ends
  without U+FFFD, but with the complete characters its last tokens carry.
  (A model that really generates U+FFFD as its last character loses it.)
* Invalid bytes followed by more text are emitted as U+FFFD, as a one-shot
  decode shows them; the stream never stalls on them.

So the concatenated output equals a one-shot ``decode(ids)`` less its trailing
U+FFFD (or, if longer, the decode of the longest prefix of ids whose text does
not end in U+FFFD: byte-fallback decoders turn a whole run of byte tokens into
U+FFFD when its last character is unfinished).
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"
MAX_CHAR_TOKENS = 4  # tokens one character can take at most (one per UTF-8 byte)


class Decoder(Protocol):
    """What we need from a tokenizer: ``tokenizers.Tokenizer`` and HF tokenizers both fit."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids ``decode(..., skip_special_tokens=True)`` drops: added tokens flagged special.

    Works for ``tokenizers.Tokenizer`` and ``transformers`` fast tokenizers; an
    object with neither API (a test fake) has none.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    added = getattr(backend, "get_added_tokens_decoder", None)
    if added is not None:
        return frozenset(i for i, tok in added().items() if tok.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()) or ())


class IncrementalDetokenizer:
    """Feed token ids with ``add``; get back only text made of complete characters."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skip = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self.token_ids: list[int] = []  # the ids that make text (special ones left out when skipped)
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text ("" while a character is unfinished)."""
        self.token_ids.extend(i for i in token_ids if i not in self._skip)
        return self._new_text()

    def flush(self) -> str:
        """Generation ended: return what is held back, less an unfinished character at the end."""
        text = self._new_text()
        if self.read_offset < len(self.token_ids):
            # The tail's last token may carry complete characters before the unfinished
            # one (byte-level BPE: " " + the first bytes of an emoji): keep those.
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            rest = self._decode(self.token_ids[self.prefix_offset :]).rstrip(REPLACEMENT_CHAR)
            if len(rest) > len(prefix) and rest.startswith(prefix):
                text += rest[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)  # the unfinished tail is dropped
        return text

    def _new_text(self) -> str:
        """Emit up to the last token after which the window's text is complete."""
        start, read = self.prefix_offset, self.read_offset
        if read == len(self.token_ids):
            return ""
        prefix = self._decode(self.token_ids[start:read])
        # NOTE: the first try (end = all ids) usually succeeds. When it ends mid-character,
        # back off at most MAX_CHAR_TOKENS tokens (a UTF-8 character has at most 4 bytes),
        # so the complete part of a multi-token chunk goes out now; bounded, so a run of
        # invalid bytes costs one decode per try, not one per held token.
        for end in range(len(self.token_ids), max(read, len(self.token_ids) - MAX_CHAR_TOKENS), -1):
            full = self._decode(self.token_ids[start:end])
            if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
                self.prefix_offset, self.read_offset = read, end
                return full[len(prefix) :]
        return ""

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)
