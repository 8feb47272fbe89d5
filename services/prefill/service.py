"""Prefill worker: runs prompts, emits the first token, writes KV to the storage tier, hands off.

Lifecycle of a request in this service:
  1. ``deepinfer.prefill.submit`` (queue group ``prefill``) or
     ``deepinfer.prefill.<worker_id>.submit``: a ``PrefillRequest`` arrives.
     Prefix reuse from the storage tier: the prompt's chained block hashes
     (with its ``cache_salt``) are looked up in the kvindex; the stored
     blocks beyond what this engine caches already are read (a missing or
     corrupt block ends the prefix there and is reported removed) and put into
     the engine's prefix cache. The submit is answered (``SubmitReply``) once
     the request is checked, before that load; then the request is queued in
     the engine, which computes only the uncached tokens.
  2. Engine ``waiting`` -> a prefill step computes the prompt's KV and samples
     the first token (finish reason ``handoff``, or ``stop``/``length`` when
     the first token already ends it). Hybrid sliding-window models: the
     stored blocks hold the full layers only; the engine restores the window
     layers' state from its SWA state cache or rebuilds it by bounded replay
     (or recomputes, ``swa_replay`` "exact"): ``TokenChunk.prefix_path`` and
     the ``prefill.prefix`` span's attributes say which.
  3. The first token is published on the request's stream subject at once (TTFT).
  4. The prompt's KV blocks are written to the storage tier (also when the first
     token already ended the request: then its full blocks only): full, exact blocks
     under their prefix hash (skipped when already there; announced to the kvindex
     as stored; hybrid models: their full layers only), the partial last block,
     blocks computed after a bounded replay and (hybrid models) the window layers'
     blocks of the prompt's last window under ephemeral keys, for the handoff only
     (``engine.kv_layout``). A write that fails (storage full, read-only) is
     skipped: the blocks are then handed off as a recompute (decode finds them
     missing), serving goes on.
  5. ``DecodeRequest`` to the decode worker the gateway chose
     (``PrefillRequest.decode_worker``: ``deepinfer.decode.<worker_id>.submit``),
     else, or if that one refuses or does not answer in ``TARGET_HANDOFF_TIMEOUT_S``,
     to ``deepinfer.decode.submit`` (any decode worker), again and again (each try
     a new attempt, the unanswered one aborted) while decode workers are busy or
     refuse, for up to ``HANDOFF_WAIT_S``: a busy decode worker delays a handoff,
     it does not fail it. If no decode worker takes it by then, the request ends
     with an error chunk.
An ``AbortRequest`` on ``deepinfer.prefill.<worker_id>.abort`` or the broadcast
``deepinfer.prefill.abort`` (the gateway's final aborts, and those sent when a
submit's reply was lost) drops a request still queued or running here at the
engine's next step boundary; an abort that finds nothing to stop is remembered
(``AbortLedger``): a submit it covers is refused when it arrives, and a request
aborted after its first token (the client left; the gateway resumed it on a
decode worker itself) is not handed off, nor tried again.
Draining (SIGTERM): the queue-group subscription is drained first (new work goes to
other workers), a submit on this worker's own subject is refused with "draining"
(the gateway tries another worker), queued and running requests finish and are
handed off (bounded by ``drain_timeout_s``; what is left then dies with the
process, and the gateway re-dispatches it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

import structlog
from opentelemetry import context as otel_context

from deepinfer.engine.interface import RequestError, StepOutput
from deepinfer.engine_worker.base import EngineWorker
from deepinfer.kvstore import AsyncBlockStore, KVIndexClient
from deepinfer.kvstore.embeddings import EmbeddingsReader
from deepinfer.mesh import MeshError, RequestTimeout
from deepinfer.protocol import (AbortLedger, AbortRequest, Attempt, DecodeRequest, ErrorReply, PrefillRequest, ProtocolError,
                                SubmitReply, TokenChunk, reaches, subjects)
from deepinfer.telemetry import get_logger, metrics, record_span, tracer

log = get_logger(__name__)

HANDOFF_TIMEOUT_S = 5.0  # one try through the decode queue group
TARGET_HANDOFF_TIMEOUT_S = 3.0  # the gateway's chosen decode worker, before the queue group
# a handoff's whole wait for a decode worker, below the gateway's own bound on a handoff (its
# ``handoff_s``: after that it resumes the request on a decode worker itself)
HANDOFF_WAIT_S = 12.0
HANDOFF_RETRY_S = (0.1, 1.0)  # pause before trying again after a refusal: first, doubling up to the last
HANDOFF_MAX_ATTEMPTS = 50  # tries at handing one request off (a bound besides ``HANDOFF_WAIT_S``)


@dataclass(eq=False)
class PrefillJob:
    """A request's state in this worker, from its accepted submit until its first token is out and
    handed off (or it is aborted). ``attempt`` starts as the submit's; a later submit of the same
    request that lands here while it runs (the gateway timed the first one out) replaces it, so
    the handoff and the aborts follow the gateway's newest copy."""

    req: PrefillRequest
    attempt: Attempt
    trace_context: otel_context.Context  # the submit's: the engine's spans and the handoff join its trace
    queued_at: float = 0.0  # perf_counter when the engine got it (0: its stored prefix still loading)


class PrefillService(EngineWorker):
    role = "prefill"
    prefill_only = True
    drain_timeout_s = HANDOFF_WAIT_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aborted = AbortLedger()  # aborts that found nothing to stop (yet)
        self._tasks: set[asyncio.Task] = set()  # first-token publish, KV store, handoff

    async def setup(self) -> None:
        self.start_engine()
        self.index = KVIndexClient(self.mesh, self.worker_id, self.engine.fingerprint)
        self.kv = self.engine.kv_connector(self.async_engine, self.store, self.io, self.index,
                                           AsyncBlockStore(self.store, io_threads=2))
        self.embeddings = EmbeddingsReader(self.store.root)  # image embeddings (vision-language models)
        # the queue group is this worker's intake: drained first on SIGTERM, so new work goes elsewhere
        self.intake.append(await self.mesh.subscribe(subjects.PREFILL_SUBMIT, self.on_submit,
                                                     queue=subjects.PREFILL_GROUP, span_name="prefill.submit"))
        await self.mesh.subscribe(subjects.prefill_submit(self.worker_id), self.on_submit, span_name="prefill.submit")
        await self.mesh.subscribe(subjects.abort(self.role, self.worker_id), self.on_abort, span_name="prefill.abort")
        await self.mesh.subscribe(subjects.PREFILL_ABORT_ANY, self.on_abort, span_name="prefill.abort")

    # --- handlers -------------------------------------------------------------
    async def on_submit(self, req: PrefillRequest) -> SubmitReply | ErrorReply:
        """Answer at once (the gateway times submits out): checks, then the prefix load and
        the engine queueing go on in ``load_and_queue``. A request this engine refuses (``RequestError``)
        is an ``ErrorReply`` of kind "bad_request" (the client's 400); a refused submit that
        another worker may take (draining, aborted, a duplicate) is ``accepted=False``."""
        if self.draining:
            return SubmitReply(accepted=False, worker_id=self.worker_id, error="draining")
        if self.aborted.refuses(req.request_id, req.attempt):
            return SubmitReply(accepted=False, worker_id=self.worker_id, error="aborted")
        running = self.requests.get(req.request_id)
        if running is not None:
            if req.attempt > running.attempt:
                # the gateway gave up waiting for our answer to an earlier attempt and sent it again,
                # which reached us: the work here goes on as this attempt (the abort the gateway sent
                # for the earlier one no longer matches it). Updated in place: ``load_and_queue`` may still be
                # loading the prefix and checks that the job it holds is the one registered.
                running.attempt = req.attempt
                return SubmitReply(accepted=True, worker_id=self.worker_id)
            # a second copy would stream its first token twice
            return SubmitReply(accepted=False, worker_id=self.worker_id, error="request already running here")
        try:
            self.engine.check_request(req.prompt_token_ids, sampling=req.sampling)
        except RequestError as e:  # the request itself (e.g. a feature this engine lacks): the client's 400
            return ErrorReply(error=str(e), kind="bad_request")
        # NOTE: registered before the engine has it: its output can reach ``on_outputs`` before
        # ``load_and_queue`` resumes (the engine steps at once), and would be dropped as aborted.
        job = PrefillJob(req, req.attempt, otel_context.get_current())
        self.requests[req.request_id] = job
        self.spawn(self.load_and_queue(job))
        return SubmitReply(accepted=True, worker_id=self.worker_id)

    async def load_and_queue(self, job: PrefillJob) -> None:
        """Load the request's stored prefix, then queue it in the engine (unless aborted meanwhile)."""
        req = job.req
        with tracer().start_as_current_span("prefill.load") as span:
            try:
                span.set_attribute("deepinfer.kv.loaded_blocks", await self.kv.load_stored_prefix(req))
            except Exception as e:  # the cache is an optimisation: never fail a request for it
                log.warning("kv_prefix_load_failed", request_id=req.request_id, error=str(e))
        if self.requests.get(req.request_id) is not job:  # aborted while its prefix loaded
            return
        job.queued_at = time.perf_counter()
        try:
            embeds = await self.load_image_embeddings(req) if req.images else None
            await self.async_engine.add_request(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                cache_salt=req.cache_salt, **({"images": req.images, "image_embeds": embeds} if req.images else {}),
            )
        except Exception as e:  # checked in on_submit: an engine failure
            self.requests.pop(req.request_id, None)
            log.warning("prefill_admit_failed", request_id=req.request_id, error=str(e))
            await self.mesh.publish(req.stream_subject, TokenChunk(
                request_id=req.request_id, token_ids=[], role=self.role, worker_id=self.worker_id,
                finish_reason="error", error=f"prefill failed: {e}"))

    def was_aborted(self, job: PrefillJob) -> bool:
        return self.aborted.refuses(job.req.request_id, job.attempt)

    async def on_abort(self, msg: AbortRequest) -> None:
        running = self.requests.get(msg.request_id)
        if running is not None and (msg.final or reaches(msg.attempt, running.attempt)):
            del self.requests[msg.request_id]
            self.async_engine.abort(msg.request_id)
            self.num_aborted += 1
            if not msg.final:
                return
        # not here (yet), past its first token (storing its blocks, handing off), or over for good:
        # refuse its submit if it arrives late, and do not hand it off
        self.aborted.record(msg)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:  # (each the request's only one: its first token)
            job = self.requests.pop(out.request_id, None)
            if job is None:  # aborted meanwhile
                continue
            metrics.count_prefix(job.req.traffic_class, out.num_prompt_tokens, out.num_cached_tokens)
            self.record_spans(job, out)
            self.spawn(self.finish_in(job, out))

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- helpers ---------------------------------------------------------------
    async def load_image_embeddings(self, req: PrefillRequest) -> list:
        """Each image's embeddings from the storage tier, where the vision service wrote them
        (``EmbeddingsReader``). Raises RuntimeError when one is missing, damaged or does not fit
        its placeholder run (the request then fails with that error)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.io, self.embeddings.read, req.embeddings_fingerprint, req.images)

    @staticmethod
    def record_spans(job: PrefillJob, out: StepOutput) -> None:
        """The engine's part of the request's trace, timed on the engine thread: ``prefill.queue``
        (in the engine until its first chunk ran), one ``prefill.forward`` per prompt chunk, and
        ``prefill.prefix`` (how its cached prefix was reused)."""
        req, ctx, queued = job.req, job.trace_context, job.queued_at
        chunks = out.chunk_times
        if queued and chunks:
            record_span("prefill.queue", queued, max(queued, chunks[0][0]), ctx)
        for i, (start, end, tokens) in enumerate(chunks):
            record_span("prefill.forward", start, end, ctx, {"deepinfer.chunk.index": i,
                                                             "deepinfer.chunk.tokens": tokens})
        with tracer().start_as_current_span("prefill.prefix", context=ctx) as span:
            span.set_attributes({
                "deepinfer.request_id": req.request_id,
                "deepinfer.prefix.path": out.prefix_path,
                "deepinfer.prefix.cached_tokens": out.num_cached_tokens,
                "deepinfer.prefix.replayed_tokens": out.num_replayed_tokens,
                "deepinfer.prompt_tokens": out.num_prompt_tokens,
                "deepinfer.prefill.chunks": len(chunks),
            })

    async def finish_in(self, job: PrefillJob, out: StepOutput) -> None:
        """``finish`` inside the request's trace context, its log lines naming the request."""
        token = otel_context.attach(job.trace_context)
        try:
            with structlog.contextvars.bound_contextvars(request_id=job.req.request_id):
                await self.finish(job, out)
        finally:
            otel_context.detach(token)

    async def finish(self, job: PrefillJob, out: StepOutput) -> None:
        req = job.req
        chunk = TokenChunk(request_id=req.request_id, token_ids=out.new_token_ids, role=self.role,
                           worker_id=self.worker_id, num_prompt_tokens=out.num_prompt_tokens,
                           num_cached_tokens=out.num_cached_tokens, logprobs=out.wire_logprobs(),
                           prompt_logprobs=out.wire_prompt_logprobs(),
                           prefix_path=out.prefix_path, num_replayed_tokens=out.num_replayed_tokens, offset=0)
        if out.finish_reason != "handoff":
            chunk.finish_reason = out.finish_reason
            if out.finish_reason == "error":
                chunk.error = "prefill engine failed"
            await self.mesh.publish(req.stream_subject, chunk)
            if out.kv_blocks is not None:  # ended at its first token: its prompt is still worth reusing
                try:
                    with tracer().start_as_current_span("prefill.store"):
                        await self.kv.save_prompt(req, out)
                except Exception as e:  # the tier is an optimisation
                    log.warning("kv_store_failed", request_id=req.request_id, error=str(e))
            return
        await self.mesh.publish(req.stream_subject, chunk)
        log.info("prefill_done", prompt_tokens=out.num_prompt_tokens, cached_tokens=out.num_cached_tokens,
                 chunks=len(out.chunk_times))
        try:
            with tracer().start_as_current_span("prefill.store") as span:
                keys, window_keys = await self.kv.save_prompt(req, out)
                span.set_attribute("deepinfer.kv.blocks", len(keys))
            if self.was_aborted(job):  # the gateway gave up on us and resumed it on decode itself
                log.info("handoff_skipped_aborted", request_id=req.request_id)
                return
            handoff = DecodeRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=out.new_token_ids, sampling=req.sampling, stream_subject=req.stream_subject,
                kv_block_keys=keys, num_kv_tokens=out.num_kv_tokens, block_size=self.engine.config.block_size,
                traffic_class=req.traffic_class, cache_salt=req.cache_salt, window_block_keys=window_keys,
                num_exact_blocks=out.num_exact_blocks if out.num_exact_blocks < len(keys) else -1,
                images=req.images, embeddings_fingerprint=req.embeddings_fingerprint, attempt=job.attempt,
            )
            with tracer().start_as_current_span("prefill.handoff") as span:
                reply = await self.hand_off(job, handoff)
                span.set_attribute("deepinfer.decode_worker", reply.worker_id if reply else "")
            if reply is None:  # aborted while it waited for a decode worker
                log.info("handoff_stopped_aborted", request_id=req.request_id)
                return
        except Exception as e:
            log.warning("handoff_failed", request_id=req.request_id, error=str(e))
            await self.mesh.publish(req.stream_subject, TokenChunk(
                request_id=req.request_id, token_ids=[], role=self.role, worker_id=self.worker_id,
                finish_reason="error", error=f"handoff to decode failed: {e}"))

    async def hand_off(self, job: PrefillJob, handoff: DecodeRequest) -> SubmitReply | None:
        """Submit to ``req.decode_worker`` if set, else (and after it refuses or does not answer)
        to the decode queue group, each try the next handoff of the submit's ``Attempt``
        (``Attempt.next_handoff``), until a decode worker accepts it.

        A try without an answer in time is aborted (that attempt only: the next one may land on
        the same worker). Returns the accepting reply, or None once the request was aborted
        (the client left). Raises MeshError when no decode worker took it in ``HANDOFF_WAIT_S``.
        """
        req = job.req
        deadline = time.monotonic() + HANDOFF_WAIT_S
        target, attempt, why = req.decode_worker, handoff.attempt, ""
        backoff = HANDOFF_RETRY_S[0]
        while True:
            subject = subjects.decode_submit(target) if target else subjects.DECODE_SUBMIT
            timeout = TARGET_HANDOFF_TIMEOUT_S if target else HANDOFF_TIMEOUT_S
            timeout = max(0.1, min(timeout, deadline - time.monotonic()))
            pause = backoff
            try:
                reply = await self.mesh.request(subject, dataclasses.replace(handoff, attempt=attempt), timeout,
                                                expect=SubmitReply)
                if reply.accepted:
                    return reply
                why = f"decode worker {reply.worker_id} refused: {reply.error}"
            except RequestTimeout:
                await self.mesh.publish(subjects.abort("decode", target) if target else subjects.DECODE_ABORT_ANY,
                                        AbortRequest(req.request_id, attempt))
                why, pause = f"no answer on {subject} within {timeout:.1f}s", 0.0
            except (MeshError, ProtocolError) as e:
                why = f"{type(e).__name__}: {e}"
            if self.was_aborted(job):
                return None
            if time.monotonic() + pause >= deadline or attempt.handoff + 1 >= HANDOFF_MAX_ATTEMPTS:
                raise MeshError(f"no decode worker took the request within {HANDOFF_WAIT_S:.0f}s ({why})")
            log.info("handoff_retry", request_id=req.request_id, attempt=attempt, reason=why)
            target, attempt = None, attempt.next_handoff()
            await asyncio.sleep(pause)
            backoff = min(2 * backoff, HANDOFF_RETRY_S[1])

    def busy(self) -> bool:
        return bool(self.requests or self._tasks)


def main(argv: list[str] | None = None) -> None:
    PrefillService.main(argv, "Prefill worker")
