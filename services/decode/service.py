"""Decode worker: loads a request's KV from the storage tier and decodes it in a continuous batch.

Lifecycle of a request in this service:
  1. ``deepinfer.decode.submit`` (queue group ``decode``) or
     ``deepinfer.decode.<worker_id>.submit``: a ``DecodeRequest`` arrives, from
     prefill (a handoff) or from the gateway (a resume after a decode worker
     died: the prompt, the tokens already streamed and the prompt's full-block
     keys), with the storage-tier keys of its KV blocks. A request id already
     running here is refused (a second copy would stream duplicates).
  2. The blocks are read from the storage tier on an I/O thread, in order, up
     to the first missing or corrupt one (ephemeral blocks are deleted once
     read). Hybrid sliding-window models: the keys name each block's full
     layers' part; the window layers' parts of the prompt's last window come
     as ephemeral blocks of their own (``window_block_keys``) and are joined
     back (``engine.kv_layout``). When they cover every token but the last, they
     are imported as is (blocks past ``num_exact_blocks``, computed after a
     bounded replay on prefill, stay out of the prefix cache). Otherwise the
     request is recomputed here from its tokens, but only what is missing: the
     leading full blocks read (keyed by their prefix hash, images' content hashes
     included) go into the engine's prefix cache first, so the recompute hits them
     (a miss, never an error; hybrid models then restore or replay the window
     state). A prompt with images recomputed so also gets its images' embeddings
     from the storage tier (``embeddings_fingerprint``, where the vision service
     wrote them), for image rows the blocks do not cover; without them the submit
     is refused.
  3. The engine copies imported blocks into its paged KV cache at the next step
     boundary; the request joins ``running`` and an empty ``TokenChunk``
     announces this worker on the stream (so the gateway watches it).
  4. Every step appends one token per running request; each step's tokens are
     published on the request's stream subject, the last chunk with its
     finish reason; the request's blocks are freed. A request that waits in the
     engine's queue (every batch slot or the KV taken) gets its announce again
     every ``KEEPALIVE_BEATS`` heartbeats while the engine steps, so the gateway
     knows it is queued here, not lost, and does not time it out; a stuck engine
     sends none.
An ``AbortRequest`` on ``deepinfer.decode.<worker_id>.abort`` or the broadcast
``deepinfer.decode.abort`` removes the request and frees its KV blocks at the
engine's next step boundary: a final one (client gone, stop string matched)
whatever its attempt, otherwise the attempt it names (the gateway moved the
request elsewhere, prefill gave up waiting for this worker's answer to a
handoff). An abort that finds nothing to stop is remembered (``AbortLedger``) and
a later submit it covers refused: a handoff still on its way when the client
left, or one attempt that prefill has already handed to the queue group (a
second copy would stream on the same subject until its last token). Submits are
handled concurrently, so one whose blocks load slowly holds up no other.
Draining (SIGTERM): the queue-group subscription is drained first, so new work
goes to other workers; a submit on this worker's own subject is refused with
"draining" (the sender tries another worker); running requests finish.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import StatusCode

from deepinfer.engine.interface import RequestError, StepOutput
from deepinfer.engine_worker.base import EngineWorker
from deepinfer.kvstore import KVIndexClient
from deepinfer.kvstore.embeddings import EmbeddingsReader
from deepinfer.protocol import AbortLedger, AbortRequest, DecodeRequest, SubmitReply, TokenChunk, reaches, subjects
from deepinfer.telemetry import get_logger, tracer

log = get_logger(__name__)

KEEPALIVE_BEATS = 5  # heartbeats a request may go without a chunk before it is announced again


def is_handoff(req: DecodeRequest) -> bool:
    """Whether ``req`` names the KV of every token but the last (a prefill worker's handoff), not a
    prefix for this worker to look up before computing the rest (a resume, aggregated serving)."""
    return req.num_kv_tokens == len(req.prompt_token_ids) + len(req.output_token_ids) - 1


@dataclass(eq=False)
class DecodeJob:
    """A request's state in this worker, from its accepted submit until its last token (or abort)."""

    req: DecodeRequest
    span: trace.Span | None = None  # ``decode.generate``: from the engine taking it to its end
    streamed: int = -1  # output tokens streamed so far (the next ``TokenChunk.offset``); -1: not in the engine yet
    last_chunk_at: float = 0.0  # when its last chunk or announce went out (monotonic s)


class DecodeService(EngineWorker):
    role = "decode"

    async def setup(self) -> None:
        self.aborted = AbortLedger()  # aborts that came before their submit
        self.start_engine()
        self._keepalive = asyncio.create_task(self.keep_alive())
        self.index = KVIndexClient(self.mesh, self.worker_id, self.engine.fingerprint)
        self.kv = self.engine.kv_connector(self.async_engine, self.store, self.io, self.index)
        self._tasks: set[asyncio.Task] = set()  # prompt blocks being written to the storage tier
        self.embeddings = EmbeddingsReader(self.store.root)  # a resumed prompt's images
        self.intake.append(await self.mesh.subscribe(subjects.DECODE_SUBMIT, self.on_submit, queue=subjects.DECODE_GROUP,
                                                     span_name="decode.submit", concurrent=True))
        await self.mesh.subscribe(subjects.decode_submit(self.worker_id), self.on_submit, span_name="decode.submit",
                                  concurrent=True)
        await self.mesh.subscribe(subjects.abort(self.role, self.worker_id), self.on_abort, span_name="decode.abort")
        await self.mesh.subscribe(subjects.DECODE_ABORT_ANY, self.on_abort, span_name="decode.abort")

    # --- handlers -------------------------------------------------------------
    async def on_submit(self, req: DecodeRequest) -> SubmitReply:
        if self.draining:
            return SubmitReply(accepted=False, worker_id=self.worker_id, error="draining")
        if req.request_id in self.requests:
            return SubmitReply(accepted=False, worker_id=self.worker_id, error="request already running here")
        if self.aborted.refuses(req.request_id, req.attempt):
            return SubmitReply(accepted=False, worker_id=self.worker_id, error="aborted")
        if req.kv_block_keys and req.block_size != self.engine.config.block_size:
            return SubmitReply(accepted=False, worker_id=self.worker_id,
                               error=f"block size {req.block_size} != {self.engine.config.block_size}")
        job = DecodeJob(req)
        self.requests[req.request_id] = job
        bs = self.engine.config.block_size
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        handoff = is_handoff(req)  # KV of every token but the last (else: a prefix to look up)
        # a prefix: what this engine caches already is not read again
        skip = 0 if handoff else self.engine.cached_prefix_blocks(req.kv_block_keys[: (num_tokens - 1) // bs])
        with tracer().start_as_current_span("decode.load") as span:
            kv, complete = await self.kv.read_request_kv(req, skip)
            span.set_attributes({"deepinfer.kv.blocks": len(req.kv_block_keys),
                                 "deepinfer.kv.cached_blocks": skip,
                                 "deepinfer.kv.loaded_blocks": 0 if kv is None else len(kv),
                                 "deepinfer.kv.complete": complete})
        whole = complete and handoff and len(kv) * bs >= req.num_kv_tokens
        embeds = None  # a recompute of a prompt with images may reach image rows: their embeddings
        if req.images and not whole:
            embeds = await asyncio.get_running_loop().run_in_executor(self.io, self.read_embeddings, req)
        if self.requests.get(req.request_id) is not job:  # aborted while its blocks were read
            return SubmitReply(accepted=False, worker_id=self.worker_id, error="aborted")
        # the request's time in the engine, until its last token (``on_outputs``) or an abort
        job.span = tracer().start_span("decode.generate", attributes={
            "deepinfer.request_id": req.request_id, "deepinfer.kv.imported": whole})
        try:
            if isinstance(embeds, str):
                raise RequestError(f"cannot recompute the prompt's images: {embeds}")
            if not whole and kv is not None:
                await self.kv.load_prefix(req, kv, num_tokens, skip)
                if self.requests.get(req.request_id) is not job:  # aborted while the prefix went in
                    self.end_span(job, error="aborted")
                    return SubmitReply(accepted=False, worker_id=self.worker_id, error="aborted")
            job.streamed, job.last_chunk_at = len(req.output_token_ids), time.monotonic()  # before its first output
            await self.async_engine.add_request(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                output_token_ids=req.output_token_ids, kv_blocks=kv if whole else None,
                num_kv_tokens=req.num_kv_tokens if whole else 0, cache_salt=req.cache_salt,
                num_exact_tokens=req.num_exact_blocks * bs if whole and req.num_exact_blocks >= 0 else None,
                # a prompt computed here (aggregated serving, a resume) goes to the storage tier too
                export_prompt=not whole,
                **({"images": req.images, "image_embeds": embeds} if req.images else {}),
            )
        except RequestError as e:
            self.requests.pop(req.request_id, None)
            self.end_span(job, error=str(e))
            return SubmitReply(accepted=False, worker_id=self.worker_id, error=str(e))
        except BaseException as e:  # the mesh answers an ErrorReply; nothing of the request stays here
            self.requests.pop(req.request_id, None)
            self.end_span(job, error=f"{type(e).__name__}: {e}")
            raise
        log.info("decode_started", prompt_tokens=len(req.prompt_token_ids), imported_kv=whole,
                 image_embeddings=embeds is not None)
        await self.announce(req, len(req.output_token_ids))
        return SubmitReply(accepted=True, worker_id=self.worker_id)

    async def announce(self, req: DecodeRequest, offset: int) -> None:
        """An empty chunk at ``offset`` (output tokens streamed before it): the request is here
        (the gateway watches this worker). At submit, the offset it came with: the engine's first
        tokens may be out already, and an announce past them would look like lost chunks."""
        await self.mesh.publish(req.stream_subject, TokenChunk(
            request_id=req.request_id, token_ids=[], role=self.role, worker_id=self.worker_id,
            offset=offset, attempt=req.attempt))

    async def keep_alive(self) -> None:
        """Every heartbeat, while the engine has stepped since the last one, announce again the
        requests with no chunk for ``KEEPALIVE_BEATS`` heartbeats (queued behind a full batch)."""
        period, steps = KEEPALIVE_BEATS * self.heartbeat_s, self.engine.num_steps
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self.engine.num_steps == steps:
                continue  # not stepping (idle, or stuck: then the gateway's timeout is right)
            steps, now = self.engine.num_steps, time.monotonic()
            for job in list(self.requests.values()):
                # (silent for a period: no chunk of it is still on its way, so its offset is the stream's)
                if job.streamed >= 0 and now - job.last_chunk_at >= period:
                    job.last_chunk_at = now
                    try:
                        await self.announce(job.req, job.streamed)
                    except Exception as e:  # NATS down: the next round tries again
                        log.warning("keepalive_failed", request_id=job.req.request_id, error=str(e))
                        break

    async def on_abort(self, msg: AbortRequest) -> None:
        running = self.requests.get(msg.request_id)
        if running is not None and (msg.final or reaches(msg.attempt, running.req.attempt)):
            del self.requests[msg.request_id]
            self.async_engine.abort(msg.request_id)
            self.end_span(running, error="aborted")
            self.num_aborted += 1
            if not msg.final:
                return
        # not here (yet), or over for good: refuse a submit that comes later. (An abort of any
        # attempt that is not final is the gateway moving the request away: a later resume may
        # come back here.)
        if msg.final or msg.attempt is not None:
            self.aborted.record(msg)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            job = self.requests.get(out.request_id)
            if job is None:  # aborted meanwhile
                continue
            req, offset = job.req, job.streamed
            if out.finish_reason is not None:
                del self.requests[out.request_id]
                self.end_span(job, out)
            elif offset >= 0:
                job.streamed, job.last_chunk_at = offset + len(out.new_token_ids), time.monotonic()
            chunk = TokenChunk(request_id=out.request_id, token_ids=out.new_token_ids, role=self.role,
                               worker_id=self.worker_id, finish_reason=out.finish_reason,
                               num_prompt_tokens=out.num_prompt_tokens, logprobs=out.wire_logprobs(),
                               prompt_logprobs=out.wire_prompt_logprobs(),  # a prompt computed here (agg)
                               offset=offset, attempt=req.attempt,
                               # the prompt's cache hits where this worker gives the first token (aggregated
                               # serving); after a handoff or a resume the first token's worker reported them
                               num_cached_tokens=0 if req.output_token_ids else out.num_cached_tokens)
            if out.finish_reason == "error":
                chunk.error = "decode engine failed"
            asyncio.ensure_future(self.mesh.publish(req.stream_subject, chunk))
            if out.kv_blocks is not None:  # the prompt, computed here: for reuse by any worker
                task = asyncio.ensure_future(self.kv.save_computed(req, out))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def busy(self) -> bool:
        return bool(self.requests or self._tasks)

    async def teardown(self) -> None:
        keepalive = getattr(self, "_keepalive", None)  # (none if set-up failed before it)
        if keepalive is not None:
            keepalive.cancel()
        await super().teardown()

    # --- helpers ---------------------------------------------------------------
    @staticmethod
    def end_span(job: DecodeJob, out: StepOutput | None = None, error: str = "") -> None:
        """End the request's ``decode.generate`` span: its finish reason and speculative
        decoding counts from its last output, or the error that ended it."""
        span, job.span = job.span, None
        if span is None:
            return
        request_id = job.req.request_id
        if out is not None:
            span.set_attributes({"gen_ai.response.finish_reasons": [out.finish_reason],
                                 "deepinfer.spec.draft_tokens": out.num_draft_tokens,
                                 "deepinfer.spec.accepted_tokens": out.num_accepted_tokens})
            with trace.use_span(span):  # the log line carries the request's trace id
                log.info("decode_finished", request_id=request_id, finish_reason=out.finish_reason,
                         draft_tokens=out.num_draft_tokens, accepted_tokens=out.num_accepted_tokens)
            if out.finish_reason == "error":
                error = "decode engine failed"
        if error:
            span.set_status(StatusCode.ERROR, error)
        span.end()

    def read_embeddings(self, req: DecodeRequest) -> list | str:
        """The prompt's images' embeddings from the storage tier (``EmbeddingsReader``), or why not."""
        try:
            return self.embeddings.read(req.embeddings_fingerprint, req.images)
        except RuntimeError as e:
            log.warning("image_embeddings_unavailable", request_id=req.request_id, error=str(e))
            return str(e)


def main(argv: list[str] | None = None) -> None:
    DecodeService.main(argv, "Decode worker")
