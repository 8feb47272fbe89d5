"""Prefill worker: runs prompts, emits the first token, writes KV to the storage tier, hands off.

Lifecycle of a request in this service:
  1. ``deepinfer.prefill.submit`` (queue group ``prefill``) or
     ``deepinfer.prefill.<worker_id>.submit``: a ``PrefillRequest`` arrives;
     it is validated and queued in the engine (reply ``SubmitReply``).
  2. Engine ``waiting`` -> a prefill step computes the prompt's KV and samples
     the first token (finish reason ``handoff``, or ``stop``/``length`` when
     the first token already ends it).
  3. The first token is published on the request's stream subject at once (TTFT).
  4. The prompt's KV blocks are written to the storage tier: full blocks under
     their prefix hash (skipped when already there), the partial last block
     under an ephemeral key.
  5. ``DecodeRequest`` to ``deepinfer.decode.submit`` (any decode worker);
     if no decode worker takes it, the request ends with an error chunk.
An ``AbortRequest`` on ``deepinfer.prefill.<worker_id>.abort`` (or the broadcast
``deepinfer.prefill.abort``, sent when a submit's reply was lost) drops a request
still queued or running here; an id aborted before its submit arrives is refused.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from deepinfer.engine.llm_engine import RequestError, StepOutput
from deepinfer.engine.worker import EngineWorker
from deepinfer.kvstore import block_hashes, ephemeral_key
from deepinfer.kvstore.store import EPHEMERAL
from deepinfer.mesh import MeshError
from deepinfer.protocol import AbortRequest, DecodeRequest, PrefillRequest, SubmitReply, TokenChunk, subjects
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

HANDOFF_TIMEOUT_S = 10.0
ABORTED_MEMORY = 4096  # request ids remembered as aborted


class PrefillService(EngineWorker):
    role = "prefill"
    prefill_only = True
    drain_timeout_s = HANDOFF_TIMEOUT_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aborted: OrderedDict[str, None] = OrderedDict()  # ids aborted before they arrived
        self._tasks: set[asyncio.Task] = set()  # first-token publish, KV store, handoff

    async def setup(self) -> None:
        self.start_engine()
        for subject, queue in ((subjects.PREFILL_SUBMIT, subjects.PREFILL_GROUP),
                               (subjects.prefill_submit(self.worker_id), "")):
            await self.mesh.subscribe(subject, self.on_submit, queue=queue, span_name="prefill.submit")
        await self.mesh.subscribe(subjects.abort(self.role, self.worker_id), self.on_abort, span_name="prefill.abort")
        await self.mesh.subscribe(subjects.PREFILL_ABORT_ANY, self.on_abort, span_name="prefill.abort")

    # --- handlers -------------------------------------------------------------
    async def on_submit(self, req: PrefillRequest) -> SubmitReply:
        if self.draining:
            return SubmitReply(accepted=False, worker_id=self.worker_id, error="draining")
        if req.request_id in self.aborted:
            return SubmitReply(accepted=False, worker_id=self.worker_id, error="aborted")
        try:
            await self.async_engine.add_request(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling
            )
        except RequestError as e:
            return SubmitReply(accepted=False, worker_id=self.worker_id, error=str(e))
        self.requests[req.request_id] = req
        return SubmitReply(accepted=True, worker_id=self.worker_id)

    async def on_abort(self, msg: AbortRequest) -> None:
        if self.requests.pop(msg.request_id, None) is not None:
            self.async_engine.abort(msg.request_id)
        else:  # not here (yet): refuse it if its submit arrives late
            self.aborted[msg.request_id] = None
            while len(self.aborted) > ABORTED_MEMORY:
                self.aborted.popitem(last=False)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            req = self.requests.pop(out.request_id, None)
            if req is None:  # aborted meanwhile
                continue
            task = asyncio.create_task(self.finish(req, out))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # --- helpers ---------------------------------------------------------------
    async def finish(self, req: PrefillRequest, out: StepOutput) -> None:
        chunk = TokenChunk(request_id=req.request_id, token_ids=out.new_token_ids, role=self.role,
                           worker_id=self.worker_id, num_prompt_tokens=out.num_prompt_tokens,
                           num_cached_tokens=out.num_cached_tokens, logprobs=out.wire_logprobs())
        if out.finish_reason != "handoff":
            chunk.finish_reason = out.finish_reason
            await self.mesh.publish(req.stream_subject, chunk)
            return
        await self.mesh.publish(req.stream_subject, chunk)
        try:
            keys = await asyncio.get_running_loop().run_in_executor(self.io, self.store_blocks, req, out)
            handoff = DecodeRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=out.new_token_ids, sampling=req.sampling, stream_subject=req.stream_subject,
                kv_block_keys=keys, num_kv_tokens=out.num_kv_tokens, block_size=self.engine.config.block_size,
                traffic_class=req.traffic_class,
            )
            reply = await self.mesh.request(subjects.DECODE_SUBMIT, handoff, HANDOFF_TIMEOUT_S, expect=SubmitReply)
            if not reply.accepted:
                raise MeshError(f"decode refused: {reply.error}")
        except Exception as e:
            log.warning("handoff_failed", request_id=req.request_id, error=str(e))
            await self.mesh.publish(req.stream_subject, TokenChunk(
                request_id=req.request_id, token_ids=[], role=self.role, worker_id=self.worker_id,
                finish_reason="error", error=f"handoff to decode failed: {e}"))

    def store_blocks(self, req: PrefillRequest, out: StepOutput) -> list[str]:
        """Write the prompt's KV blocks; return their keys in order (runs on the I/O pool)."""
        bs = self.engine.config.block_size
        full = block_hashes(req.prompt_token_ids[: out.num_kv_tokens], bs, self.engine.fingerprint)
        keys = []
        for i in range(out.kv_blocks.shape[0]):
            if i < len(full):
                key = full[i]
                if not self.store.contains(key, req.traffic_class):
                    self.store.put(key, out.kv_blocks[i], req.traffic_class)
            else:
                key = ephemeral_key(req.request_id, i)
                self.store.put(key, out.kv_blocks[i], EPHEMERAL)
            keys.append(key)
        return keys

    def busy(self) -> bool:
        return bool(self.requests or self._tasks)


def main(argv: list[str] | None = None) -> None:
    PrefillService.main(argv, "Prefill worker")
