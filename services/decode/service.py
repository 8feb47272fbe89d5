"""Decode worker: loads a request's KV from the storage tier and decodes it in a continuous batch.

Lifecycle of a request in this service:
  1. ``deepinfer.decode.submit`` (queue group ``decode``) or
     ``deepinfer.decode.<worker_id>.submit``: a ``DecodeRequest`` arrives from
     prefill with the storage-tier keys of the prompt's KV blocks.
  2. The blocks are read from the storage tier on an I/O thread (the
     ephemeral partial block is deleted once read). If any block is missing or
     corrupt the request is recomputed here from its tokens instead (a miss,
     never an error).
  3. The engine copies the blocks into its paged KV cache at the next step
     boundary; the request joins ``running`` and an empty ``TokenChunk``
     announces this worker on the stream (so the gateway watches it).
  4. Every step appends one token per running request; each step's tokens are
     published on the request's stream subject, the last chunk with its
     finish reason; the request's blocks are freed.
An ``AbortRequest`` on ``deepinfer.decode.<worker_id>.abort`` (client gone,
stop string matched) removes the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio

import torch

from deepinfer.engine.llm_engine import RequestError, StepOutput
from deepinfer.engine.worker import EngineWorker
from deepinfer.kvstore.store import EPHEMERAL
from deepinfer.protocol import AbortRequest, DecodeRequest, SubmitReply, TokenChunk, subjects
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

class DecodeService(EngineWorker):
    role = "decode"

    async def setup(self) -> None:
        self.start_engine()
        for subject, queue in ((subjects.DECODE_SUBMIT, subjects.DECODE_GROUP),
                               (subjects.decode_submit(self.worker_id), "")):
            await self.mesh.subscribe(subject, self.on_submit, queue=queue, span_name="decode.submit")
        await self.mesh.subscribe(subjects.abort(self.role, self.worker_id), self.on_abort, span_name="decode.abort")

    # --- handlers -------------------------------------------------------------
    async def on_submit(self, req: DecodeRequest) -> SubmitReply:
        if self.draining:
            return SubmitReply(accepted=False, worker_id=self.worker_id, error="draining")
        if req.block_size != self.engine.config.block_size:
            return SubmitReply(accepted=False, worker_id=self.worker_id,
                               error=f"block size {req.block_size} != {self.engine.config.block_size}")
        kv = await asyncio.get_running_loop().run_in_executor(self.io, self.load_blocks, req)
        self.requests[req.request_id] = req
        try:
            await self.async_engine.add_request(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                output_token_ids=req.output_token_ids, kv_blocks=kv,
                num_kv_tokens=req.num_kv_tokens if kv is not None else 0, cache_salt=req.cache_salt,
            )
        except RequestError as e:
            self.requests.pop(req.request_id, None)
            return SubmitReply(accepted=False, worker_id=self.worker_id, error=str(e))
        await self.mesh.publish(req.stream_subject, TokenChunk(
            request_id=req.request_id, token_ids=[], role=self.role, worker_id=self.worker_id))
        return SubmitReply(accepted=True, worker_id=self.worker_id)

    async def on_abort(self, msg: AbortRequest) -> None:
        if self.requests.pop(msg.request_id, None) is not None:
            self.async_engine.abort(msg.request_id)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None:  # aborted meanwhile
                continue
            if out.finish_reason is not None:
                del self.requests[out.request_id]
            chunk = TokenChunk(request_id=out.request_id, token_ids=out.new_token_ids, role=self.role,
                               worker_id=self.worker_id, finish_reason=out.finish_reason,
                               num_prompt_tokens=out.num_prompt_tokens, logprobs=out.wire_logprobs())
            if out.finish_reason == "error":
                chunk.error = "decode engine failed"
            asyncio.ensure_future(self.mesh.publish(req.stream_subject, chunk))

    # --- helpers ---------------------------------------------------------------
    def load_blocks(self, req: DecodeRequest) -> torch.Tensor | None:
        """Read the request's blocks; None (recompute) if any is missing or corrupt."""
        blocks = []
        for key in req.kv_block_keys:
            is_eph = key.startswith("eph-")
            block = self.store.get(key, EPHEMERAL if is_eph else req.traffic_class)
            if is_eph:
                self.store.delete(key, EPHEMERAL)
            if block is None:
                log.warning("kv_block_miss", request_id=req.request_id, key=key)
            blocks.append(block)
        if not blocks or any(b is None for b in blocks):
            return None
        return torch.stack(blocks)



def main(argv: list[str] | None = None) -> None:
    DecodeService.main(argv, "Decode worker")
