"""Stop strings with hold-back, so streamed text equals non-streamed text.

Text arrives in pieces; a stop string may straddle two pieces. We hold back
the longest tail of the text that is a prefix of some stop string (at most
``len(longest stop) - 1`` characters) and emit the rest. When a stop string
appears, everything before its first occurrence is emitted, the stop string
and anything after it are dropped (OpenAI semantics), and generation ends
with finish_reason "stop". When generation ends without a match, ``flush``
returns the held-back tail.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str] | None):
        self.stop = [s for s in (stop or []) if s]
        self.pending = ""
        self.matched: str | None = None

    def add(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string matched)."""
        if not self.stop:
            return text, False
        buf = self.pending + text
        hit, which = -1, None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (hit < 0 or i < hit):
                hit, which = i, s
        if hit >= 0:
            self.pending = ""
            self.matched = which
            return buf[:hit], True
        keep = self._partial_match_len(buf)
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that some stop string starts with."""
        longest = max(len(s) for s in self.stop) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
