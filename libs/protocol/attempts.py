"""Which copy of a request a message belongs to: the one fencing token of the mesh.

A request can run in more than one place at once for a while: a submit whose reply was late
lands anyway while the gateway tries the next worker; prefill retries a handoff through the
decode queue group after its targeted try timed out; the gateway resumes a request on a new
decode worker while the old one has not heard its abort yet. Every submit, handoff, token
chunk and abort therefore names the copy it belongs to, an ``Attempt``, and every service
compares them with the same order:

- ``submit``: the gateway's submit number for the request, 0, 1, 2, ... Every submit the
  gateway makes (each try of the first dispatch, each failover) takes the next number, so a
  later decision of the gateway always orders after an earlier one.
- ``handoff``: prefill's handoff number within that submit, 0 (the decode worker the gateway
  chose), then 1, 2, ... for each retry. A gateway failover submits straight to a worker with
  handoff 0.

``Attempt`` orders as the tuple ``(submit, handoff)``: the newer copy is the larger. An abort
or chunk without an attempt (``None``) means "any copy" (abort) or "not said" (a chunk that no
copy question applies to, e.g. prefill's first token).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, order=True)
class Attempt:
    """A copy of a request: ``(submit, handoff)``, both counted from 0, ordered as a tuple."""

    submit: int = 0
    handoff: int = 0

    def next_submit(self) -> "Attempt":
        """The gateway's next submit of the request (a retry or a failover): handoff starts over."""
        return Attempt(self.submit + 1, 0)

    def next_handoff(self) -> "Attempt":
        """Prefill's next try at handing this submit off to decode."""
        return Attempt(self.submit, self.handoff + 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Attempt | None":
        """The wire map back into an ``Attempt``; None stays None (any copy / not said)."""
        return None if d is None else cls(int(d.get("submit", 0)), int(d.get("handoff", 0)))


def reaches(abort_attempt: Attempt | None, attempt: Attempt) -> bool:
    """Whether an abort naming ``abort_attempt`` (None: any copy) stops the copy ``attempt``."""
    return abort_attempt is None or abort_attempt == attempt
