"""Stop strings with hold-back, so streamed text equals non-streamed text.

Text arrives in pieces; a stop string may straddle two pieces. Each ``add``
searches only the held-back tail plus the new piece (at most
``len(longest stop) - 1`` old characters: a match starting earlier would have
been found before). The earliest *completing* match wins (ties: the one that
starts first), also when one piece completes several: that is the match a
character-by-character stream would see first, so the cut never depends on
how text was chunked. Everything before the match is emitted, the stop
string and anything after it are dropped (OpenAI semantics) and generation
ends with finish_reason "stop". Without a match, the longest tail of the text
that some stop string starts with is held back (never more than
``len(longest stop) - 1`` characters, often none) and the rest is emitted, so
no part of a stop string ever reaches the stream. ``flush`` (generation ended
without a match) returns the held-back tail.

After a match the matcher is finished: later ``add`` calls return ("", True).
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str] | None):
        self.stop = [s for s in (stop or []) if s]
        self.pending = ""  # held back: a possible start of a stop string
        self.matched: str | None = None  # the stop string that ended generation
        self._longest = max((len(s) for s in self.stop), default=0)

    def add(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string has matched)."""
        if self.matched is not None:
            return "", True
        if not self.stop:
            return text, False
        buf = self.pending + text
        best = None  # (end, start, stop) of the earliest completing match
        for s in self.stop:
            i = buf.find(s)  # a stop's first occurrence is also its earliest completing one
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self.pending = ""
            self.matched = best[2]
            return buf[: best[1]], True
        keep = self._partial_match_len(buf)
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Generation ended without a match: the held-back text."""
        out, self.pending = self.pending, ""
        return out

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that some stop string starts with."""
        for k in range(min(self._longest - 1, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
