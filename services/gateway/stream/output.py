"""Token chunks -> text deltas: incremental detokenization, then stop strings.

One ``OutputProcessor`` per request; the same object builds the streamed
deltas and the non-streamed text, so the two are equal by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.gateway.stream.detokenizer import Decoder, IncrementalDetokenizer
from deepinfer.gateway.stream.stop import StopStringMatcher
from deepinfer.protocol import TokenChunk


@dataclass
class Delta:
    """What one chunk adds: text to emit, the chunk's token ids, and the finish reason if it ended."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class OutputProcessor:
    tokenizer: Decoder
    stop: list[str] | None = None
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None

    def __post_init__(self):
        self._detok = IncrementalDetokenizer(self.tokenizer)
        self._stop = StopStringMatcher(self.stop)

    @property
    def stopped_by_string(self) -> bool:
        """A stop string ended generation here, so the worker is still running and must be aborted."""
        return self._stop.matched is not None

    def process(self, chunk: TokenChunk) -> Delta:
        """Take one successful chunk (finish_reason None, "stop" or "length")."""
        self.token_ids.extend(chunk.token_ids)
        self.num_prompt_tokens = max(self.num_prompt_tokens, chunk.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        final = chunk.finish_reason is not None
        text = self._detok.add(chunk.token_ids)
        if final:
            text += self._detok.flush()
        text, stopped = self._stop.add(text)
        if stopped:
            self.finish_reason = "stop"
        elif final:
            text += self._stop.flush()
            self.finish_reason = chunk.finish_reason
        return Delta(text, list(chunk.token_ids), self.finish_reason)
