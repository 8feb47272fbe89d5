"""Submitting a request's prompt to the router's choice, with fallbacks.

``submit_prompt`` sends the ``PrefillRequest`` (disaggregated serving; or, aggregated, a
``DecodeRequest`` without KV to a worker that prefills and decodes, ``role`` "decode") to
``<role>_submit(worker)`` for each of the plan's first ``max_targeted`` candidates in turn (each
given ``targeted_timeout_s``), and then, if none accepted, to the role's queue group (any worker)
with what is left of the submit timeout:

  accepted                       -> done (the router books it on the worker that accepted)
  refused / no responders /
  bad reply / internal error     -> the next candidate
  no answer in time              -> ``AbortRequest`` to that worker for that attempt only (each
                                    try is the request's next submit, ``Attempt.next_submit``:
                                    the late copy is refused or dropped there, while a later
                                    attempt the queue group hands the same worker is taken), then
                                    the next candidate
  "bad_request" error            -> raised at once (every worker would refuse it)

Without a plan (or with no candidates) it is exactly one queue-group submit. The last attempt's
``SubmitReply`` is returned (it may be a refusal) and its exceptions (``NoResponders``,
``RequestTimeout``, ``RemoteError``, ``ProtocolError``) propagate, as from ``MeshClient.request``.
``req.attempt`` is left at the last try's attempt (the accepted copy's, when one accepted).
"""

from __future__ import annotations

import time

from deepinfer.gateway.pipeline.router import Plan
from deepinfer.mesh import MeshClient, NoResponders, RemoteError, RequestTimeout
from deepinfer.protocol import AbortRequest, DecodeRequest, PrefillRequest, ProtocolError, SubmitReply, subjects
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


async def submit_prompt(mesh: MeshClient, req: PrefillRequest | DecodeRequest, plan: Plan | None, timeout_s: float,
                        role: str = "prefill") -> SubmitReply:
    deadline = time.monotonic() + timeout_s
    targeted, group = ((subjects.prefill_submit, subjects.PREFILL_SUBMIT) if role == "prefill"
                       else (subjects.decode_submit, subjects.DECODE_SUBMIT))
    router = plan.router if plan is not None else None
    if router is not None:
        cfg = router.config
        for cand in plan.candidates[: cfg.max_targeted]:
            left = deadline - time.monotonic()
            if left <= 0.5:  # keep time for the queue group
                break
            worker = cand.worker_id
            try:
                reply = await mesh.request(targeted(worker), req,
                                           min(cfg.targeted_timeout_s, left - 0.5), expect=SubmitReply)
            except RemoteError as e:
                if e.kind == "bad_request":
                    raise
                why = f"error: {e}"
            except RequestTimeout:
                # NOTE: this attempt only: the queue group below may pick the same (slow) worker
                await mesh.publish(subjects.abort(role, worker), AbortRequest(req.request_id, req.attempt))
                why = "no answer in time"
            except (NoResponders, ProtocolError) as e:
                why = type(e).__name__
            else:
                if reply.accepted:
                    router.accepted(plan, reply.worker_id)
                    return reply
                why = f"refused: {reply.error}"
            router.failed(plan, worker)
            log.info("prompt_target_fallback", request_id=req.request_id, role=role, worker=worker, reason=why)
            req.attempt = req.attempt.next_submit()
    try:
        reply = await mesh.request(group, req, max(deadline - time.monotonic(), 0.5),
                                   expect=SubmitReply)
    except BaseException:
        if router is not None:
            router.forget(plan)
        raise
    if router is not None:
        router.accepted(plan, reply.worker_id) if reply.accepted else router.forget(plan)
    return reply
