"""What a worker remembers of aborts, so a submit that arrives after its abort is refused.

An abort can overtake the work it cancels: the gateway broadcasts a final abort the
moment a client leaves, while the request may still sit in a prefill worker's queue
or in a handoff on its way to a decode worker. Each worker keeps the newest aborts it
could not apply (the request was not there) and refuses a matching submit later.
"""

from __future__ import annotations

from collections import OrderedDict

from deepinfer.protocol.attempts import Attempt
from deepinfer.protocol.messages import AbortRequest


class AbortLedger:
    """The newest ``capacity`` aborts that found nothing to stop, by (request id, attempt).

    A final abort, or one for any attempt (None), refuses every attempt of the request; one
    naming an ``Attempt`` refuses that attempt only (a later retry of the same request may
    still land here). Memory: about 250 bytes per entry.
    """

    def __init__(self, capacity: int = 16384):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, Attempt | None], None] = OrderedDict()

    def record(self, msg: AbortRequest) -> None:
        key = (msg.request_id, None if msg.final else msg.attempt)
        self._entries[key] = None
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def refuses(self, request_id: str, attempt: Attempt) -> bool:
        """Whether a submit of ``request_id`` with ``attempt`` was aborted before it arrived."""
        return (request_id, None) in self._entries or (request_id, attempt) in self._entries

    def __len__(self) -> int:
        return len(self._entries)
