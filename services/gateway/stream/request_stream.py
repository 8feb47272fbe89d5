"""One request's token stream from the workers: submit, watch liveness, abort.

``Phase`` is the state machine; every transition is in ``RequestStream._advance``
(chunks) or ``open`` / ``abort`` / ``_fail`` (the gateway's own decisions):

  SUBMITTING -- subscribed to ``stream(request_id)`` (before submitting, so no
                chunk is lost), PrefillRequest sent to the router's choice of
                prefill worker, else on PREFILL_SUBMIT (``pipeline.dispatch.submit_prompt``).
                SubmitReply accepted -> PREFILL. No responders, refusal or
                timeout -> ``StreamError`` (HTTP 503; a timeout while workers of
                the role report alive is overload: HTTP 429 ``worker_busy``
                with Retry-After).
                Aggregated serving (``mode`` "agg"): a DecodeRequest without KV (the
                prompt's full-block keys, for the stored prefix) goes to the router's
                choice of worker, which prefills and decodes it -> DECODE.
  PREFILL    -- watching the prefill worker of the SubmitReply.
                First chunk (role "prefill") -> HANDOFF, or FINISHED if final.
  HANDOFF    -- first token in; prefill is handing the request to a decode
                worker. Still watching the prefill worker. First chunk with
                role "decode" -> DECODE (now watching its worker_id).
                Nothing for ``handoff_s`` -> failover (below).
  DECODE     -- watching the decode worker. Final chunk -> FINISHED.
  FINISHED   -- a final chunk arrived, the gateway aborted (stop string,
                client gone) or the request failed.

Every ``tick_s`` (whether or not chunks flow; ``queued_tick_s`` before the first
token) the watched worker is checked in the registry and the client's connection
looked at. A worker that missed its heartbeats (a chunk from it counts as
one), a handoff that produced nothing for ``handoff_s``, or a prefill worker
that reports it could not hand off, triggers a failover (``_failover``):

  * the worker is *abandoned*: sent an ``AbortRequest`` (in case it was only
    slow) and every later chunk from it is dropped, so it can never stream
    duplicates; one that still streams was not reached by that abort and is
    aborted again (at most once a second);
  * PREFILL (no token yet): a fresh ``PrefillRequest`` (same request id and
    stream subject) goes to another live prefill worker (``Router.place``: the
    choice a first submit gets, less the workers the request left);
  * HANDOFF / DECODE (tokens out): a ``DecodeRequest`` goes to another live
    decode worker, chosen the same way: the prompt, every token received so far
    (``output_token_ids``: what the client was given) and the keys of the
    prompt's full KV blocks in the storage tier (``block_hashes`` with the
    worker's fingerprint and block size from its ``LoadReport``); decode loads
    what is there and recomputes the rest. That worker is *pinned*: decode
    chunks from any other worker (a handoff that raced the resume) are dropped
    and that worker aborted. A seeded sampler replays its draws for the given
    tokens (``LLMEngine.add_request``), so greedy and seeded outputs continue
    exactly. A prompt with images carries their content hashes (in the block
    keys) and embeddings fingerprint: decode reads the images' embeddings from
    the storage tier to recompute any image rows the stored blocks miss.

Each submit, the first ones and each failover's, is the request's next ``Attempt``
(``protocol.attempts``); decode chunks name the copy that sent them, so where two copies
stream (a handoff retry, a resume that raced a handoff) the stream takes one, the newest
where it continues the client's tokens, and aborts the other (``_one_copy``).

At most ``max_failovers`` submits per request (a refused or unanswered one
counts); then, or when no worker of the role is left, ``StreamError`` (HTTP
503 before the first byte, an SSE error event after). No chunk at all for
``inactivity_s`` raises ``StreamError`` (a live but stuck worker); a client
that left raises ``ClientGone`` after aborting the worker. No request can wait
forever.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from deepinfer.gateway.pipeline.dispatch import submit_prompt
from deepinfer.gateway.pipeline.registry import WorkerRegistry
from deepinfer.gateway.pipeline.router import Plan, PromptShape, Router
from deepinfer.kvstore.hashing import block_hashes
from deepinfer.mesh import MeshClient, MeshError, MessageTooLarge, NoResponders, RemoteError, RequestTimeout
from deepinfer.protocol import (
    AbortRequest,
    Attempt,
    DecodeRequest,
    PrefillRequest,
    ProtocolError,
    SamplingParams,
    SubmitReply,
    TokenChunk,
    subjects,
    unpack,
)
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

REABORT_S = 1.0  # least seconds between aborts sent again to one abandoned worker that still streams

# Fire-and-forget tasks (aborts after a client left) must be referenced until done.
_background: set[asyncio.Task] = set()


def spawn(coro) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


class Phase(enum.Enum):
    SUBMITTING = "submitting"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    DECODE = "decode"
    FINISHED = "finished"


class StreamError(Exception):
    """The request cannot complete: no worker took it, its worker died, or it timed out.

    ``status``: HTTP status to answer with when nothing was sent yet; ``retry_after_s``: the
    ``Retry-After`` of a 429 (seconds).
    """

    def __init__(self, message: str, code: str = "worker_unavailable", status: int = 503,
                 retry_after_s: float = 1.0):
        super().__init__(message)
        self.code = code
        self.status = status
        self.retry_after_s = retry_after_s


class ClientGone(Exception):
    """The HTTP client disconnected while we waited."""


@dataclass
class StreamTimeouts:
    submit_s: float = 10.0
    inactivity_s: float = 60.0
    handoff_s: float = 15.0
    tick_s: float = 0.25
    queued_tick_s: float = 1.0  # the check's period while no token has come yet (PREFILL: queued or prefilling)
    max_failovers: int = 2  # submits to another worker after a worker failed, per request
    resync_s: float = 3.0  # after the mesh connection came back: silence this long resumes the request


class RequestStream:
    def __init__(
        self,
        mesh: MeshClient,
        registry: WorkerRegistry,
        request_id: str,
        timeouts: StreamTimeouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        traffic_class: str = "chat",
        cache_salt: str | None = None,
        images: list[list] | None = None,
        embeddings_fingerprint: str = "",
        mode: str = "disagg",
        router: Router | None = None,
    ):
        self.mesh = mesh
        self.router = router or Router(registry)  # failover's placement (the gateway's router: its bookings)
        self.mode = mode  # "disagg": prefill then decode workers; "agg": one worker does both
        self.traffic_class = traffic_class
        self.cache_salt = cache_salt
        self.images = list(images or [])  # the prompt's [offset, length, content hash] per image
        self.embeddings_fingerprint = embeddings_fingerprint
        self.registry = registry
        self.request_id = request_id
        self.timeouts = timeouts or StreamTimeouts()
        self.clock = clock
        self.phase = Phase.SUBMITTING
        self.worker_role = ""
        self.worker_id = ""
        self._watch_since = 0.0
        self._last_chunk_at = 0.0
        self._handoff_since = 0.0
        self._next_check_at = 0.0
        self._queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._sub = None
        # failover (set by ``open``): what a re-dispatch or a resume is built from
        self.prompt_token_ids: list[int] = []
        self.sampling: SamplingParams | None = None
        self.output_token_ids: list[int] = []  # tokens received so far (what the client was given)
        self.failovers = 0  # submits made after a failure
        self.attempt = Attempt()  # the request's latest submit (``protocol.attempts``): failovers take the next
        self._abandoned: set[str] = set()  # workers the request was moved away from: chunks dropped
        self._reaborted: dict[str, float] = {}  # abandoned worker -> when it was last aborted again
        self._pinned_decode = ""  # decode worker the gateway resumed on: other decode chunks dropped
        self._pinned_attempt: Attempt | None = None  # ... and the attempt it resumed with (older copies dropped)
        self._decode_copy: tuple[str, Attempt] | None = None  # (worker, attempt) whose decode chunks are taken
        self._reconnects = getattr(mesh, "reconnects", 0)  # the mesh connection's losses seen
        self._reconnected_at = 0.0  # when the stream saw the connection come back (0: not since its last check)

    # --- the gateway's decisions ---------------------------------------------
    async def open(self, prompt_token_ids: list[int], sampling: SamplingParams, plan: Plan | None = None) -> None:
        """Subscribe to the stream, then submit the prefill (to ``plan``'s workers first, then
        the queue group; ``plan.decode_worker`` goes along for the handoff). Raises StreamError."""
        self.prompt_token_ids, self.sampling = list(prompt_token_ids), sampling  # for a failover
        subject = subjects.stream(self.request_id)
        self._sub = await self.mesh.nc.subscribe(subject, cb=self._on_msg)
        role = "decode" if self.mode == "agg" else "prefill"
        if role == "decode":
            req = self._decode_request(plan.decode_worker if plan is not None else None, Attempt())
            req.num_kv_tokens = 0  # the keys name a prefix to look up (in the worker's cache first), not a handoff
        else:
            req = PrefillRequest(self.request_id, prompt_token_ids, sampling, subject, self.traffic_class,
                                 self.cache_salt, decode_worker=plan.decode_worker if plan is not None else None,
                                 images=self.images, embeddings_fingerprint=self.embeddings_fingerprint)
        try:
            reply = await submit_prompt(self.mesh, req, plan, self.timeouts.submit_s, role)
            self.attempt = req.attempt
        except MessageTooLarge as e:  # e.g. a huge structured-output schema: no worker could take it
            await self._fail()
            raise StreamError(f"the request is too large for the mesh: {e}", code="request_too_large", status=413)
        except NoResponders:
            await self._fail()
            raise StreamError(f"no {role} worker is running")
        except RequestTimeout:
            await self._fail()
            # NOTE: the submit may still sit in some worker's queue; make whoever has it drop it.
            if role == "prefill":
                await self.mesh.publish(subjects.PREFILL_ABORT_ANY, AbortRequest(self.request_id))
            else:  # (that attempt: a decode worker refuses it if it arrives later)
                await self.mesh.publish(subjects.DECODE_ABORT_ANY, AbortRequest(self.request_id, req.attempt))
            if any(not w.report.draining for w in self.registry.alive(role)):
                # live (reporting) but too busy to answer: overload, refused before any output, so the
                # client retries later rather than counting an accepted request lost
                raise StreamError(f"every {role} worker is too busy to take the request (no answer within "
                                  f"{self.timeouts.submit_s:.0f}s); retry later", code="worker_busy", status=429,
                                  retry_after_s=self.timeouts.submit_s)
            raise StreamError(f"no {role} worker answered within {self.timeouts.submit_s:.0f}s", code="timeout")
        except RemoteError as e:
            await self._fail()
            if e.kind == "bad_request":
                raise StreamError(str(e), code="bad_request", status=400)
            raise StreamError(f"{role} submit failed: {e}", code="internal_error", status=500)
        except ProtocolError as e:
            await self._fail()
            raise StreamError(f"bad reply from {role}: {e}", code="internal_error", status=500)
        if not reply.accepted:
            await self._fail()
            raise StreamError(f"{role} worker {reply.worker_id} refused the request: {reply.error}")
        now = self.clock()
        self._last_chunk_at = now
        self._watch(role, reply.worker_id, now)
        self.phase = Phase.DECODE if role == "decode" else Phase.PREFILL

    async def next_chunk(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> TokenChunk:
        """Wait for the next chunk of this request. Raises StreamError or ClientGone."""
        while True:
            # NOTE: checked on a clock, not only when idle: a client that leaves
            # while tokens flow must still be noticed (and its worker aborted).
            now = self.clock()
            if now >= self._next_check_at:
                # NOTE: a gateway under overload holds hundreds of streams queued at prefill; each
                # check costs a wake and a look at the client's connection, so they check less often
                waiting = self.phase is Phase.PREFILL and not self.output_token_ids
                self._next_check_at = now + (self.timeouts.queued_tick_s if waiting else self.timeouts.tick_s)
                await self._check(is_disconnected)
            if not self._queue.empty():
                chunk = self._queue.get_nowait()
            else:
                # NOTE: asyncio.timeout, not wait_for, which wraps the get in a task: a gateway holding
                # ~1,000 queued streams wakes each every tick, and wait_for cost ~2x the CPU per wake
                try:
                    async with asyncio.timeout(max(self._next_check_at - now, 0.001)):
                        chunk = await self._queue.get()
                except TimeoutError:
                    continue
            if not await self._accept(chunk):
                continue
            self._advance(chunk)
            return chunk

    async def abort(self) -> None:
        """End the request for good (stop string matched, client gone): a final ``AbortRequest``
        to every prefill and every decode worker, so it stops wherever it is (queued, running,
        in a submit whose reply is still on its way, in a handoff between two workers) and a
        submit of it that arrives later is refused. A no-op once the request has finished."""
        if self.phase is Phase.FINISHED:
            await self.close()
            return
        self.phase = Phase.FINISHED
        await self.close()
        await self._publish_final_abort()

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception:  # connection closed or draining: nothing to clean up
                pass

    # --- incoming chunks --------------------------------------------------
    async def _on_msg(self, raw) -> None:
        try:
            chunk = unpack(raw.data, expect=TokenChunk)
        except ProtocolError as e:
            log.warning("bad_token_chunk", request_id=self.request_id, error=str(e))
            return
        if chunk.request_id == self.request_id:
            self._queue.put_nowait(chunk)

    async def _accept(self, chunk: TokenChunk) -> bool:
        """Whether ``chunk`` belongs to the stream (failover, copies and gaps: see the module docstring)."""
        if chunk.worker_id in self._abandoned:
            if chunk.finish_reason is None:  # still running our request there: the abort was lost
                await self._abort_again(chunk)
            return False
        if self._pinned_decode and chunk.role == "decode" and chunk.worker_id != self._pinned_decode:
            self._abandoned.add(chunk.worker_id)  # a second copy: the handoff raced our resume
            if chunk.finish_reason is None:
                await self._publish_abort("decode", chunk.worker_id)
            return False
        if chunk.role == "decode" and chunk.attempt is not None and not await self._one_copy(chunk):
            return False
        if chunk.offset >= 0 and self.phase is not Phase.FINISHED:
            have = len(self.output_token_ids)
            if chunk.offset < have:  # tokens the client has already: a copy behind this one
                log.info("chunk_behind", request_id=self.request_id, worker=chunk.worker_id, offset=chunk.offset,
                         have=have)
                return False
            if chunk.offset > have:  # chunks lost in transit (a NATS restart): never stream past a gap
                await self._gap(chunk, have)
                return False
        if (chunk.finish_reason == "error" and chunk.role == "prefill" and self.phase is Phase.HANDOFF
                and chunk.worker_id == self.worker_id):
            # the first token is out but prefill could not hand off: resume on decode ourselves
            await self._failover(f"prefill worker {chunk.worker_id} could not hand off: {chunk.error}")
            return False
        return True

    async def _one_copy(self, chunk: TokenChunk) -> bool:
        """Whether a decode chunk comes from the copy of the request the stream takes tokens from:
        the one the gateway resumed (pinned), else the first that streamed. Prefill's later handoff
        attempt (its queue-group retry after a targeted handoff timed out and was aborted) replaces
        it where it continues exactly (its offset is the tokens the client has); where it does not
        (behind the client, or past it), that copy is aborted and the request resumed from the
        client's tokens, since the older copy may be gone (aborted by prefill) and waiting for it
        would stall until the inactivity timeout. A copy of an earlier attempt is aborted. Tokens
        from two copies are never mixed. Raises StreamError when no worker takes the resume."""
        copy = (chunk.worker_id, chunk.attempt)
        if self._pinned_decode:  # (another worker's chunks were dropped above)
            return self._pinned_attempt is None or chunk.attempt == self._pinned_attempt
        if self._decode_copy is None or copy == self._decode_copy:
            return True
        have = len(self.output_token_ids)
        if chunk.attempt > self._decode_copy[1] and chunk.offset == have:
            log.info("decode_copy_replaced", request_id=self.request_id, old=self._decode_copy, new=copy)
            return True
        if chunk.attempt > self._decode_copy[1] and chunk.offset >= 0 and self.phase is not Phase.FINISHED:
            if chunk.finish_reason is None:
                await self._publish_abort("decode", chunk.worker_id, chunk.attempt)
            await self._failover(f"decode attempt {chunk.attempt} on {chunk.worker_id} starts at token "
                                 f"{chunk.offset}, the client has {have}", keep=True)
            return False
        if chunk.attempt < self._decode_copy[1] and chunk.finish_reason is None:
            await self._publish_abort("decode", chunk.worker_id, chunk.attempt)
        return False

    async def _gap(self, chunk: TokenChunk, have: int) -> None:
        """``chunk`` starts past the tokens received: some were lost in transit. Resume from what
        the client was given (on any live decode worker, the same one too: its copy is aborted and
        its later chunks dropped by attempt). With nothing given yet (the first token was lost) the
        resume starts from the prompt alone: the decode worker computes what the storage tier does
        not hold and samples the first token again (a seeded sampler draws the same). Raises
        StreamError when no worker takes it."""
        reason = (f"{chunk.offset - have} tokens from {chunk.role} worker {chunk.worker_id} were lost in transit "
                  "(the mesh connection was interrupted)")
        if chunk.role == "decode" and (chunk.worker_id, chunk.attempt) != (self.worker_id, self._watched_attempt()):
            await self._publish_abort("decode", chunk.worker_id, chunk.attempt)
        if self.phase is Phase.PREFILL:  # prefill's first token is out (a later token came): decode resumes
            self.phase = Phase.HANDOFF
        await self._failover(reason, keep=True)

    def _watched_attempt(self) -> Attempt | None:
        copy = self._decode_copy
        return copy[1] if self.worker_role == "decode" and copy and copy[0] == self.worker_id else None

    def _advance(self, chunk: TokenChunk) -> None:
        now = self.clock()
        self._last_chunk_at = now
        self._next_check_at = min(self._next_check_at, now + self.timeouts.tick_s)  # out of the queued ticks
        self.output_token_ids += chunk.token_ids
        if chunk.role == "decode" and chunk.attempt is not None:
            self._decode_copy = (chunk.worker_id, chunk.attempt)
        if chunk.role == "decode":
            if self.worker_role != "decode" or chunk.worker_id != self.worker_id:
                self._watch("decode", chunk.worker_id, now)
            self.phase = Phase.DECODE
        elif self.phase is Phase.PREFILL:
            if chunk.worker_id and chunk.worker_id != self.worker_id:
                self._watch(chunk.role or "prefill", chunk.worker_id, now)
            self.phase = Phase.HANDOFF
            self._handoff_since = now
        if chunk.finish_reason is not None:
            self.phase = Phase.FINISHED

    # --- helpers -------------------------------------------------------------
    def _watch(self, role: str, worker_id: str, now: float) -> None:
        self.worker_role, self.worker_id, self._watch_since = role, worker_id, now

    async def _check(self, is_disconnected) -> None:
        now = self.clock()
        # A chunk from the watched worker is as good as a heartbeat (its reports may lag behind a busy step).
        if not self.registry.is_alive(self.worker_id, since=max(self._watch_since, self._last_chunk_at)):
            await self._failover(f"{self.worker_role} worker {self.worker_id} stopped responding (missed heartbeats)")
        elif self.phase is Phase.HANDOFF and now - self._handoff_since > self.timeouts.handoff_s:
            await self._failover(f"handoff from prefill worker {self.worker_id} to a decode worker produced "
                                 f"nothing within {self.timeouts.handoff_s:.0f}s")
        elif (reconnects := getattr(self.mesh, "reconnects", 0)) != self._reconnects:
            self._reconnects, self._reconnected_at = reconnects, now  # chunks may have been lost meanwhile
        elif (self._reconnected_at and self.phase in (Phase.HANDOFF, Phase.DECODE)
              and (self.output_token_ids or self.mode != "agg")  # (agg, no token yet: still prefilling)
              and self._last_chunk_at < self._reconnected_at and now - self._reconnected_at > self.timeouts.resync_s):
            self._reconnected_at = 0.0  # silent since: its last chunks (its final one) were lost
            await self._failover(f"no output from {self.worker_role} worker {self.worker_id} for "
                                 f"{self.timeouts.resync_s:g}s after the mesh connection came back", keep=True)
        now = self.clock()
        if now - self._last_chunk_at > self.timeouts.inactivity_s:
            await self._fail(abort=True)
            raise StreamError(f"no output for {self.timeouts.inactivity_s:.0f}s", code="timeout")
        if is_disconnected is not None and await is_disconnected():
            await self.abort()
            raise ClientGone()

    # --- failover ---------------------------------------------------------------
    async def _failover(self, reason: str, keep: bool = False) -> None:
        """Move the request off its worker (``reason``: why) to another one; raises StreamError
        when no worker takes it within ``max_failovers`` submits. ``keep``: the worker is alive
        (chunks were lost on the way): only its copy is aborted, and it may take the request again."""
        failed_role, failed = self.worker_role, self.worker_id
        if not keep:
            self._abandoned.add(failed)
        # if it was only slow: drop it, free its KV (``keep``: that copy only)
        await self._publish_abort(failed_role, failed, self._watched_attempt() if keep else None)
        to_decode = self.phase in (Phase.HANDOFF, Phase.DECODE)  # a token is out: continue decoding it
        what = "resuming on another decode worker" if to_decode else "re-dispatching to another prefill worker"
        log.warning("worker_failed", request_id=self.request_id, role=failed_role, worker=failed, reason=reason,
                    tokens=len(self.output_token_ids), action=what)
        started, why = self.clock(), "no worker left to try"
        while self.failovers < self.timeouts.max_failovers:
            self.failovers += 1
            self.attempt = self.attempt.next_submit()
            role = "decode" if to_decode else "prefill"
            target = self._pick(role)
            try:
                reply = await (self._resume_decode(target) if to_decode else self._redispatch_prefill(target))
            except NoResponders:
                why = f"no {role} worker is running"
                if target is None:
                    break
                self._abandoned.add(target)  # gone: its subscription is
                continue
            except RequestTimeout:
                why = f"{target or 'the ' + role + ' queue group'} did not answer in {self.timeouts.submit_s:.0f}s"
                if target:
                    self._abandoned.add(target)
                    await self._publish_abort(role, target)
                continue
            except (MeshError, ProtocolError) as e:
                why = f"{role} submit failed: {e}"
                if target:
                    self._abandoned.add(target)
                continue
            if not reply.accepted or reply.worker_id in self._abandoned:
                why = f"{role} worker {reply.worker_id} refused: {reply.error or 'a worker this request left'}"
                if reply.accepted:
                    await self._publish_abort(role, reply.worker_id)
                self._abandoned.add(reply.worker_id)
                if target is None:
                    break
                continue
            now = self.clock()
            self._watch(role, reply.worker_id, now)
            self._last_chunk_at = now
            if to_decode:
                self._pinned_decode, self._pinned_attempt = reply.worker_id, self.attempt
                self._decode_copy = (reply.worker_id, self._pinned_attempt)
                self.phase = Phase.DECODE
            else:
                self.phase = Phase.PREFILL
            log.info("failover_done", request_id=self.request_id, role=role, worker=reply.worker_id,
                     took_s=round(now - started, 3), failovers=self.failovers)
            return
        await self._fail()
        raise StreamError(f"{reason}; {what} failed ({self.failovers} of {self.timeouts.max_failovers} "
                          f"tries used): {why}")

    def _pick(self, role: str) -> str | None:
        """Where the request goes now (``Router.place``: the same choice as for a first submit),
        leaving out the workers it left; None: none qualifies, the queue group is tried."""
        shape = PromptShape(len(self.prompt_token_ids) + len(self.output_token_ids),
                            max_tokens=max(1, self.sampling.max_tokens - len(self.output_token_ids)))
        return self.router.place(shape, role, self._abandoned, self.request_id)

    async def _redispatch_prefill(self, target: str | None) -> SubmitReply:
        req = PrefillRequest(self.request_id, self.prompt_token_ids, self.sampling, subjects.stream(self.request_id),
                             self.traffic_class, self.cache_salt, attempt=self.attempt,
                             images=self.images, embeddings_fingerprint=self.embeddings_fingerprint)
        subject = subjects.prefill_submit(target) if target else subjects.PREFILL_SUBMIT
        return await self.mesh.request(subject, req, timeout=self.timeouts.submit_s, expect=SubmitReply)

    async def _resume_decode(self, target: str | None) -> SubmitReply:
        """Submit the request to a decode worker: prompt, tokens so far, the prompt's stored blocks."""
        req = self._decode_request(target, self.attempt)
        subject = subjects.decode_submit(target) if target else subjects.DECODE_SUBMIT
        return await self.mesh.request(subject, req, timeout=self.timeouts.submit_s, expect=SubmitReply)

    def _decode_request(self, target: str | None, attempt: Attempt) -> DecodeRequest:
        """A ``DecodeRequest`` that (re)computes the request on a decode worker from its prompt, the
        tokens the client has and the keys of the prompt's full blocks in the storage tier (hashed
        as ``target``, else any live decode worker, reports; none known: no keys)."""
        info = next((i.report for i in self.registry.alive() if i.report.worker_id == target), None)
        if info is None or not info.fingerprint:  # no target (queue group): any worker's parameters
            info = next((i.report for i in self.registry.alive("decode") if i.report.fingerprint), info)
        fingerprint, bs = (info.fingerprint, info.block_size) if info is not None else ("", 0)
        keys = (block_hashes(self.prompt_token_ids, bs, fingerprint, (self.cache_salt or "").encode(),
                             [tuple(i) for i in self.images])
                if fingerprint and bs > 0 else [])
        return DecodeRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids), sampling=self.sampling,
            stream_subject=subjects.stream(self.request_id), kv_block_keys=keys, num_kv_tokens=len(keys) * bs,
            block_size=bs, traffic_class=self.traffic_class, cache_salt=self.cache_salt, images=self.images,
            embeddings_fingerprint=self.embeddings_fingerprint, attempt=attempt,
        )

    async def _fail(self, abort: bool = False) -> None:
        # NOTE: a live-but-stuck worker still holds KV for this request; tell it to let go.
        if abort and self.worker_id and self.phase is not Phase.FINISHED:
            await self._publish_abort(self.worker_role, self.worker_id)
        self.phase = Phase.FINISHED
        await self.close()

    async def _publish_abort(self, role: str, worker_id: str, attempt: Attempt | None = None) -> None:
        try:
            await self.mesh.publish(subjects.abort(role, worker_id), AbortRequest(self.request_id, attempt))
            log.info("abort_sent", request_id=self.request_id, role=role, to=worker_id)
        except Exception as e:  # NATS down: the worker finishes on its own (max_tokens)
            log.warning("abort_failed", request_id=self.request_id, to=worker_id, error=str(e))

    async def _abort_again(self, chunk: TokenChunk) -> None:
        """An abandoned worker still streams ``chunk.attempt``: abort that attempt there again (at
        most once every ``REABORT_S`` per worker), so a copy that missed its abort (a dropped
        message, a partitioned link) stops instead of running to ``max_tokens``."""
        now = time.monotonic()
        if now - self._reaborted.get(chunk.worker_id, -REABORT_S) >= REABORT_S:
            self._reaborted[chunk.worker_id] = now
            await self._publish_abort(chunk.role, chunk.worker_id, chunk.attempt)

    async def _publish_final_abort(self) -> None:
        msg = AbortRequest(self.request_id, final=True)
        try:
            for subject in (subjects.PREFILL_ABORT_ANY, subjects.DECODE_ABORT_ANY):
                await self.mesh.publish(subject, msg)
            log.info("abort_sent", request_id=self.request_id, to="every worker")
        except Exception as e:  # NATS down: the workers finish on their own (max_tokens)
            log.warning("abort_failed", request_id=self.request_id, error=str(e))
