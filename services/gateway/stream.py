"""One request's token stream from the workers: submit, watch liveness, abort.

``Phase`` is the state machine; every transition is in ``RequestStream._advance``
(chunks) or ``open`` / ``abort`` / ``_fail`` (the gateway's own decisions):

  SUBMITTING -- subscribed to ``stream(request_id)`` (before submitting, so no
                chunk is lost), PrefillRequest sent to the router's choice of
                prefill worker, else on PREFILL_SUBMIT (``dispatch.submit_prefill``).
                SubmitReply accepted -> PREFILL. No responders, refusal or
                timeout -> ``StreamError`` (HTTP 503).
  PREFILL    -- watching the prefill worker of the SubmitReply.
                First chunk (role "prefill") -> HANDOFF, or FINISHED if final.
  HANDOFF    -- first token in; prefill is handing the request to a decode
                worker. Still watching the prefill worker. First chunk with
                role "decode" -> DECODE (now watching its worker_id).
                Nothing for ``handoff_s`` -> error.
  DECODE     -- watching the decode worker. Final chunk -> FINISHED.
  FINISHED   -- a final chunk arrived, the gateway aborted (stop string,
                client gone) or the request failed.

Every ``tick_s`` (whether or not chunks flow) the watched worker is checked in
the registry: a worker that missed its heartbeats (a chunk from it counts as
one), no chunk at all for ``inactivity_s``, or a handoff that produced nothing
for ``handoff_s`` raises ``StreamError``; a client that left raises
``ClientGone`` after aborting the worker. No request can wait forever.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from deepinfer.gateway.dispatch import submit_prefill
from deepinfer.gateway.registry import WorkerRegistry
from deepinfer.gateway.router import Plan
from deepinfer.mesh import MeshClient, NoResponders, RemoteError, RequestTimeout
from deepinfer.protocol import (
    AbortRequest,
    PrefillRequest,
    ProtocolError,
    SamplingParams,
    TokenChunk,
    subjects,
    unpack,
)
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

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

    ``status``: HTTP status to answer with when nothing was sent yet.
    """

    def __init__(self, message: str, code: str = "worker_unavailable", status: int = 503):
        super().__init__(message)
        self.code = code
        self.status = status


class ClientGone(Exception):
    """The HTTP client disconnected while we waited."""


@dataclass
class StreamTimeouts:
    submit_s: float = 10.0
    inactivity_s: float = 60.0
    handoff_s: float = 15.0
    tick_s: float = 0.25


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
    ):
        self.mesh = mesh
        self.traffic_class = traffic_class
        self.cache_salt = cache_salt
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
        self._chasing = False

    # --- the gateway's decisions ---------------------------------------------
    async def open(self, prompt_token_ids: list[int], sampling: SamplingParams, plan: Plan | None = None) -> None:
        """Subscribe to the stream, then submit the prefill (to ``plan``'s workers first, then
        the queue group; ``plan.decode_worker`` goes along for the handoff). Raises StreamError."""
        subject = subjects.stream(self.request_id)
        self._sub = await self.mesh.nc.subscribe(subject, cb=self._on_msg)
        req = PrefillRequest(self.request_id, prompt_token_ids, sampling, subject, self.traffic_class, self.cache_salt,
                             decode_worker=plan.decode_worker if plan is not None else None)
        try:
            reply = await submit_prefill(self.mesh, req, plan, self.timeouts.submit_s)
        except NoResponders:
            await self._fail()
            raise StreamError("no prefill worker is running")
        except RequestTimeout:
            await self._fail()
            # NOTE: the submit may still sit in some worker's queue; make whoever has it drop it.
            await self.mesh.publish(subjects.PREFILL_ABORT_ANY, AbortRequest(self.request_id))
            raise StreamError(f"no prefill worker answered within {self.timeouts.submit_s:.0f}s", code="timeout")
        except RemoteError as e:
            await self._fail()
            if e.kind == "bad_request":
                raise StreamError(str(e), code="bad_request", status=400)
            raise StreamError(f"prefill submit failed: {e}", code="internal_error", status=500)
        except ProtocolError as e:
            await self._fail()
            raise StreamError(f"bad reply from prefill: {e}", code="internal_error", status=500)
        if not reply.accepted:
            await self._fail()
            raise StreamError(f"prefill worker {reply.worker_id} refused the request: {reply.error}")
        now = self.clock()
        self._last_chunk_at = now
        self._watch("prefill", reply.worker_id, now)
        self.phase = Phase.PREFILL

    async def next_chunk(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> TokenChunk:
        """Wait for the next chunk of this request. Raises StreamError or ClientGone."""
        while True:
            # NOTE: checked on a clock, not only when idle: a client that leaves
            # while tokens flow must still be noticed (and its worker aborted).
            now = self.clock()
            if now >= self._next_check_at:
                self._next_check_at = now + self.timeouts.tick_s
                await self._check(is_disconnected)
            if not self._queue.empty():
                chunk = self._queue.get_nowait()
            else:
                try:
                    chunk = await asyncio.wait_for(self._queue.get(), max(self._next_check_at - now, 0.001))
                except asyncio.TimeoutError:
                    continue
            self._advance(chunk)
            return chunk

    async def abort(self) -> None:
        """Tell the current worker to drop the request (stop string matched, client gone).

        Mid-handoff the decode worker is not known yet: keep listening (in the
        background) for up to ``handoff_s`` and abort it too when it shows up.
        """
        if self._chasing:
            return  # the background chase owns the subscription and closes it
        if self.phase is Phase.FINISHED or not self.worker_id:
            await self.close()
            return
        handing_off = self.phase in (Phase.PREFILL, Phase.HANDOFF)
        self.phase = Phase.FINISHED
        await self._publish_abort(self.worker_role, self.worker_id)
        if handing_off:
            self._chasing = True
            spawn(self._abort_late_decode(self.worker_id))
        else:
            await self.close()

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

    def _advance(self, chunk: TokenChunk) -> None:
        now = self.clock()
        self._last_chunk_at = now
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
            await self._fail()
            raise StreamError(f"{self.worker_role} worker {self.worker_id} stopped responding (missed heartbeats)")
        if self.phase is Phase.HANDOFF and now - self._handoff_since > self.timeouts.handoff_s:
            await self._fail(abort=True)
            raise StreamError(
                f"handoff from prefill worker {self.worker_id} to a decode worker produced nothing "
                f"within {self.timeouts.handoff_s:.0f}s"
            )
        if now - self._last_chunk_at > self.timeouts.inactivity_s:
            await self._fail(abort=True)
            raise StreamError(f"no output for {self.timeouts.inactivity_s:.0f}s", code="timeout")
        if is_disconnected is not None and await is_disconnected():
            await self.abort()
            raise ClientGone()

    async def _fail(self, abort: bool = False) -> None:
        # NOTE: a live-but-stuck worker still holds KV for this request; tell it to let go.
        if abort and self.worker_id and self.phase is not Phase.FINISHED:
            await self._publish_abort(self.worker_role, self.worker_id)
        self.phase = Phase.FINISHED
        await self.close()

    async def _publish_abort(self, role: str, worker_id: str) -> None:
        try:
            await self.mesh.publish(subjects.abort(role, worker_id), AbortRequest(self.request_id))
            log.info("abort_sent", request_id=self.request_id, role=role, to=worker_id)
        except Exception as e:  # NATS down: the worker finishes on its own (max_tokens)
            log.warning("abort_failed", request_id=self.request_id, to=worker_id, error=str(e))

    async def _abort_late_decode(self, prefill_worker: str) -> None:
        deadline = self.clock() + self.timeouts.handoff_s
        try:
            while (left := deadline - self.clock()) > 0:
                try:
                    chunk = await asyncio.wait_for(self._queue.get(), left)
                except asyncio.TimeoutError:
                    return
                if chunk.role == "decode" and chunk.worker_id != prefill_worker:
                    if chunk.finish_reason is None:
                        await self._publish_abort("decode", chunk.worker_id)
                    return
        finally:
            await self.close()
