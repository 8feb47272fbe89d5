"""Admission: answer 429 with ``Retry-After`` instead of queueing into a timeout.

When the best predicted TTFT exceeds the SLO, the request is refused up front (429 with
Retry-After) rather than accepted and failed later. Three explicit limits, each off unless
configured (gateway flags in brackets):

  max_inflight          [--max-inflight N]         generation streams this gateway has open
                        (admitted and not finished; a request with n choices counts n); one
                        more is refused. Retry-After: 1 s.
  max_queued_prefill_s  [--max-queued-prefill-s S] (the gateway's default: 30 s, under its request
                        timeout) per prefill worker: a worker whose predicted
                        queued compute plus this request's would exceed S seconds is not used
                        (one with an empty queue always is, so any single request can run);
                        when no worker is left: 429, Retry-After = the least excess, seconds.
                        The prediction counts the router's measured bias (below): a host
                        slower than the workers' fitted cost models (an overloaded CPU)
                        drains its queues slower than predicted, and only the measurement
                        shows it.
  ttft_slo_s            [--ttft-slo-s S]           the best predicted TTFT (``router``: the smallest
                        predicted finish time over the prefill workers) above S: 429. Workers
                        predicted past S are skipped (the policy's order stays among the
                        rest), and so are workers that
                        would not drain their queue with this request before the earliest
                        deadline of the requests this gateway admitted there (``Router.slack``):
                        the engine's scheduler runs a new prompt's first chunk ahead of the
                        running prefills, so a later request delays earlier ones, and only the
                        drain time bounds every request's TTFT whatever the order. None left:
                        429, Retry-After = the least overshoot of a worker's bound (SLO or
                        earliest deadline), at least 1 s: a queue drains about one second of
                        compute per second. A prediction plus the router's measured bias
                        (``Router.ttft_bias_s``: how much later than predicted first tokens
                        have been arriving) plus the time the request already spent at the
                        gateway (``Plan.waited_s``: parsing, tokenizing, images; TTFT runs
                        from its receipt) is what is held to the SLO, so time the model leaves
                        out (the gateway, the network, a CPU slower than fitted) is not
                        admitted against it.

Decode admission, always on: when live decode workers report and, as their reports stand, none
has free KV for the request's prompt and reserve and a queue within
``RouterConfig.decode_max_waiting`` [--max-decode-waiting N]: 429 ``decode_full``, Retry-After
1 s (decode frees KV as generations end, continuously). A request is refused up front rather
than accepted and left to wait for a decode worker in its handoff.

The error is an ``OpenAIError`` with status 429 and the header, so every API answers it in its
own shape: OpenAI ``{"error": {"type": "rate_limit_exceeded", "code": <reason>, ...}}``,
Anthropic ``{"type": "error", "error": {"type": "rate_limit_error", ...}}``. Reasons (``code``):
``max_inflight``, ``prefill_queue_full``, ``ttft_slo``, ``decode_full``, and ``worker_busy``
(``RequestStream.open``: workers of the role report alive, yet none answered the submit in
time). Without worker reports (no candidates) only ``max_inflight`` applies: the queue group
takes the request as before.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

from deepinfer.gateway.api.errors import OpenAIError
from deepinfer.gateway.pipeline.router import Plan
from deepinfer.gateway.stream.request_stream import Phase, RequestStream


DEFAULT_MAX_QUEUED_PREFILL_S = 30.0


@dataclass
class AdmissionConfig:
    """Limits (None = off): ttft_slo_s and max_queued_prefill_s in seconds, max_inflight in streams."""

    ttft_slo_s: float | None = None
    max_inflight: int | None = None
    max_queued_prefill_s: float | None = None

    @property
    def needs_prediction(self) -> bool:
        return self.ttft_slo_s is not None or self.max_queued_prefill_s is not None


def rate_limited(message: str, reason: str, retry_after_s: float) -> OpenAIError:
    """429 with ``Retry-After`` (whole seconds, at least 1)."""
    seconds = max(1, math.ceil(retry_after_s))
    return OpenAIError(429, message, "rate_limit_exceeded", None, reason, headers={"Retry-After": str(seconds)})


class Admission:
    def __init__(self, config: AdmissionConfig | None = None):
        self.config = config or AdmissionConfig()
        self._streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()
        self.rejected: dict[str, int] = {}  # reason -> count

    def inflight(self) -> int:
        """Open generation streams (admitted, not finished)."""
        return sum(1 for s in list(self._streams) if s.phase is not Phase.FINISHED)

    def waiting(self) -> int:
        """Open streams with no first token yet (submitting, or queued / running in prefill)."""
        return sum(1 for s in list(self._streams) if s.phase in (Phase.SUBMITTING, Phase.PREFILL))

    def enter(self, streams: list[RequestStream]) -> None:
        """Count ``streams`` in flight, or raise 429 when that would pass ``max_inflight``."""
        limit = self.config.max_inflight
        if limit is not None and self.inflight() + len(streams) > limit:
            raise self._reject(f"the gateway has {limit} requests in flight; retry later", "max_inflight", 1.0)
        self._streams.update(streams)

    def leave(self, streams: list[RequestStream]) -> None:
        """``streams`` were refused after ``enter``: they no longer count."""
        for s in streams:
            self._streams.discard(s)

    def check(self, plan: Plan) -> None:
        """Drop candidates over the queue limit, then hold the best one to the TTFT SLO; raises 429."""
        cfg = self.config
        if not plan.candidates:
            return
        router = plan.router
        bias = router.ttft_bias_s() if router is not None else 0.0
        limit = cfg.max_queued_prefill_s
        if limit is not None:
            ok = [c for c in plan.candidates if c.queue_s <= 0 or c.queue_s + c.compute_s + bias <= limit]
            if not ok:
                excess = min(c.queue_s + c.compute_s + bias - limit for c in plan.candidates)
                raise self._reject(f"every prefill worker has more than {limit:g}s of prompts queued; retry later",
                                   "prefill_queue_full", excess)
            plan.candidates = ok
        slo = cfg.ttft_slo_s
        if slo is None:
            return
        # NOTE: a worker where this request would push an earlier one past its deadline is skipped
        bound = {c.worker_id: min(slo, router.slack(c.worker_id)) if router is not None else slo
                 for c in plan.candidates}
        late = bias + plan.waited_s  # the model's measured error, and this request's time before routing
        ok = [c for c in plan.candidates if c.finish_s + late <= bound[c.worker_id]]
        if not ok:
            best = min(c.finish_s for c in plan.candidates) + late
            why = (f"predicted time to first token {best:.2f}s exceeds the {slo:g}s SLO" if best > slo else
                   f"no prefill worker can serve this request within the {slo:g}s TTFT SLO without delaying "
                   "earlier requests past it")
            wait = min(c.finish_s + late - bound[c.worker_id] for c in plan.candidates)
            raise self._reject(f"{why}; retry later", "ttft_slo", wait)
        plan.candidates = ok

    def check_decode(self, plan: Plan) -> None:
        """429 when decode workers report and, as they stand, none has room for the request."""
        router = plan.router
        if router is not None and router.config.prefill_role == "prefill" and router.decode_full(plan.shape):
            raise self._reject("every decode worker is full (KV cache or queue); retry later", "decode_full", 1.0)

    def count_rejected(self, reason: str) -> None:
        """One more request refused with 429 for ``reason`` (the metric's label)."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _reject(self, message: str, reason: str, retry_after_s: float) -> OpenAIError:
        self.count_rejected(reason)
        return rate_limited(message, reason, retry_after_s)
