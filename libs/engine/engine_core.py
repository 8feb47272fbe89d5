"""The step loop: schedule -> execute -> update, one step at a time (vLLM v1's ``EngineCore``,
nano-vllm's ``step``).

A step takes the scheduler's sequences, runs one forward pass over all of them, samples one
token per sequence (more with speculative decoding) and returns a ``StepOutput`` per request
it advanced or ended. ``step()`` runs one step synchronously. ``step_async()`` overlaps: the
forward pass and sampling of step t run on a forward thread while this thread schedules and
prepares step t+1 and hands off step t-1's outputs (async scheduling, vLLM v1); ``step_gaps``
records the forward thread's idle time between steps either way.

``EngineCore`` builds nothing: ``LLMEngine`` and ``MockEngine`` give it a scheduler, a runner
(``prepare``/``fill``/``execute``) and a ``KVCacheManager``, then call ``_init_core``.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from deepinfer.engine.interface import StepOutput
from deepinfer.engine.model_runner import StepInputs
from deepinfer.engine.sampler import SampleResult, sample
from deepinfer.engine.sequence import RequestStatus, Sequence
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


@dataclass(eq=False)  # (compared by identity: ``_launched.remove``)
class _Step:
    """A launched step: its sequences, inputs, (tokens, context) pieces for the
    cost model, and the indices of the sequences that sample a token."""

    seqs: list[Sequence]
    inputs: StepInputs
    pieces: list[tuple[int, int]]
    sampling: list[int]
    started: float | None = None  # perf_counter when its forward pass began (None: not yet)
    ended: float | None = None  # perf_counter when it ended


class EngineCore:
    """The step loop over ``scheduler``, ``runner`` and ``kv`` (set by the subclass). Its counters
    are read by load reports from any thread."""

    spec = None  # speculative decoding (``spec_decode.SpecDecoder``; None = off)
    structured = None  # structured output (``structured.StructuredOutputManager``; None = not supported)
    step_threads = None  # intra-op threads per step (``step_threads.StepThreads``; None: left as they are)

    def _init_core(self) -> None:
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' samplers
        self.num_steps = self.peak_batch_size = self.num_finished_requests = 0
        self.num_computed_tokens_total = 0  # tokens fed through the model (not cache hits)
        self.last_step_s = self.busy_s_total = 0.0  # forward seconds: the last step's, all steps'
        self.step_gaps: deque[float] = deque(maxlen=4096)  # forward-thread idle time between steps (s)
        self.num_overlapped_steps = 0  # steps scheduled while the previous one ran
        self._forward_end: float | None = None
        self._inflight: tuple[_Step, Future] | None = None
        self._launched: deque[_Step] = deque()  # launched, not finished (for queued_prefill)
        self._failed: list[StepOutput] = []  # requests ended at scheduling, returned with the next outputs
        self._pool: ThreadPoolExecutor | None = None

    # --- requests ---------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks; False if it is not here."""
        self._forget(request_id)
        return self.scheduler.abort(request_id) is not None

    def _forget(self, request_id: str) -> None:
        """Forget a request's state besides its KV: its seeded sampler, grammar matcher, drafter state."""
        self.generators.pop(request_id, None)
        for manager in (self.structured, self.spec):
            if manager is not None:
                manager.free(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def fail_all(self) -> list[Sequence]:
        """After a step raised: drop every request (queued, running, or in a launched step, even
        one that step had already finished) and free all their KV blocks. Returns the dropped
        sequences (finish reason "error"); the engine is then empty and usable."""
        seqs = {id(s): s for s in self.scheduler.take_all()}
        if self._inflight is not None:
            step, future = self._inflight
            self._inflight = None
            wait([future])  # let the forward thread finish writing before the blocks are reused
            self._launched.append(step)
        for step in self._launched:
            seqs.update((id(s), s) for s in step.seqs)
        self._launched.clear()
        for seq in seqs.values():
            seq.num_inflight_steps = seq.num_inflight_tokens = 0
            if seq.block_table:
                self.kv.block_manager.free(seq)
            seq.status = RequestStatus.FINISHED_ERROR
            self._forget(seq.request_id)
        return list(seqs.values())

    def between_steps(self, fn, *args):
        """``fn(*args)`` where no forward pass runs: at once in synchronous mode, else on the
        forward thread after the step in flight (its result or exception). Call it from the
        thread that steps the engine (``AsyncEngine.call``), so no step starts meanwhile; used
        to write KV blocks, to read and reset counters and to change weights (``models.moe``)."""
        if self._pool is None:
            return fn(*args)
        return self._pool.submit(fn, *args).result()

    # --- the step ---------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One synchronous step: schedule, prepare, forward + sample, update."""
        if self._inflight is not None:  # coming from step_async: collect that step first
            return self._collect(None)
        t0 = time.perf_counter()
        step = self._launch(can_preempt=True)
        if step is None:
            return self._take_failed()
        try:
            result = self._execute(step)
        except BaseException:
            self._drop(step)  # so aborting its sequences frees their blocks
            raise
        outputs = self._finish(step, result)
        if self.spec is not None:  # what a step costs besides its forward pass (drafting, sampling, ...)
            self.spec.observe_overhead(time.perf_counter() - t0 - self.last_step_s)
        return outputs

    def step_async(self) -> list[StepOutput]:
        """One iteration of the overlapped loop (async scheduling, vLLM v1): schedule and prepare
        step t+1 while step t runs on the forward thread, then wait for step t, apply its tokens,
        launch step t+1 and return step t's outputs. Call until ``has_unfinished()`` is False.
        Exceptions of the forward pass are raised here, with the launched steps undone."""
        nxt = self._launch(can_preempt=self._inflight is None)
        if self._inflight is None:
            if nxt is not None:
                self._inflight = (nxt, self._forward_pool().submit(self._execute, nxt))
            return self._take_failed()
        return self._collect(nxt)

    def _collect(self, nxt: _Step | None) -> list[StepOutput]:
        step, future = self._inflight
        self._inflight = None
        try:
            result = future.result()
        except BaseException:
            for s in (step, nxt):
                if s is not None:
                    self._drop(s)
            raise
        outputs = self._finish(step, result)
        if nxt is not None:
            self.num_overlapped_steps += 1
            self._inflight = (nxt, self._forward_pool().submit(self._execute, nxt))
        return outputs

    def _forward_pool(self) -> ThreadPoolExecutor:
        self._pool = self._pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        return self._pool

    def _launch(self, can_preempt: bool) -> _Step | None:
        """Schedule the next step, build its inputs and advance its sequences."""
        seqs = []
        for seq in self.scheduler.schedule(can_preempt):
            if seq.feeds_missing_image_rows:  # ends alone, instead of failing the step
                self._end(seq, RequestStatus.FINISHED_ERROR)
                self._failed.append(StepOutput(seq.request_id, [], "error", seq.num_prompt_tokens))
                log.error("image_rows_without_embeddings", request_id=seq.request_id)
            else:
                seqs.append(seq)
        if not seqs:
            self._forward_end = None  # idle: the next gap is not an inter-step gap
            return None
        if self.spec is not None:
            self.spec.plan(seqs, self.config.max_num_batched_tokens - sum(s.num_scheduled_tokens for s in seqs))
        pieces = [(s.num_scheduled_tokens, s.num_computed_tokens) for s in seqs]
        inputs = self.runner.prepare(seqs)
        if any(s.window_restore for s in seqs):
            inputs.window_restores = self.kv.take_window_restores(seqs)
        sampling = self.scheduler.advance(seqs)
        self.num_steps += 1
        self.num_computed_tokens_total += sum(n for n, _ in pieces)
        self.peak_batch_size = max(self.peak_batch_size, len(seqs))
        step = _Step(seqs, inputs, pieces, sampling)
        self._launched.append(step)
        return step

    def _take_failed(self) -> list[StepOutput]:
        failed, self._failed = self._failed, []
        return failed

    def _execute(self, step: _Step) -> SampleResult:
        """Forward pass and sampling (on the forward thread in async mode)."""
        self.runner.fill(step.inputs)
        if self.step_threads is not None:  # (this thread's OpenMP team size)
            torch.set_num_threads(self.step_threads.threads_for(sum(n for n, _ in step.pieces)))
        t0 = step.started = time.perf_counter()
        if self._forward_end is not None:
            self.step_gaps.append(t0 - self._forward_end)
        logits = self.runner.execute(step.inputs)
        step.ended = time.perf_counter()
        self.last_step_s = step.ended - t0
        self.busy_s_total += self.last_step_s
        self.cost_model.observe(step.pieces, self.last_step_s)
        eos = self.model_config.eos_token_ids
        if self.spec is not None:
            self.spec.observe_step(step.seqs, step.pieces, self.last_step_s)
        if self.spec is not None and any(s.draft_token_ids for s in step.seqs):
            result = self.spec.verify(logits, step.seqs, step.sampling, self.generators, eos)
        else:
            seqs = [step.seqs[i] for i in step.sampling]
            result = sample(logits[step.sampling], seqs, [self.generators.get(s.request_id) for s in seqs], eos,
                            self.structured.for_batch(seqs) if self.structured is not None else None)
        result.prompt_logprobs = step.inputs.prompt_logprobs
        self._forward_end = time.perf_counter()
        return result

    def _drop(self, step: _Step) -> None:
        """Undo ``advance`` of a step that never came back (its forward pass failed)."""
        self._forget_launched(step)
        for i, seq in enumerate(step.seqs):
            seq.num_inflight_steps -= 1
            if i in step.sampling:
                seq.num_inflight_tokens -= 1

    def _forget_launched(self, step: _Step) -> None:
        if step in self._launched:
            self._launched.remove(step)

    def _end(self, seq: Sequence, status: RequestStatus) -> None:
        """End a request outside the step's own stop checks (its blocks are freed unless a
        launched step holds them)."""
        self.scheduler.abort(seq.request_id)
        self._forget(seq.request_id)
        seq.status = status

    def _finish(self, step: _Step, result: SampleResult) -> list[StepOutput]:
        """Apply a step's sampled tokens; outputs for sequences still live; free finished ones.
        (The step leaves ``_launched`` only at the end: if this raises, ``fail_all`` finds it.)"""
        sampled = dict(zip(step.sampling, result.token_ids))
        logprobs = dict(zip(step.sampling, result.logprobs))
        live = {i for i in sampled if not step.seqs[i].status.is_finished}
        for seq, first, entries in result.prompt_logprobs:
            if seq.prompt_logprobs is not None:  # (None: aborted meanwhile)
                seq.prompt_logprobs[first + 1 : first + 1 + len(entries)] = entries
        finished = {id(s) for s in self.scheduler.update(step.seqs, sampled)}
        for seq, reason in self.structured.advance(step.seqs) if self.structured is not None else ():
            self._end(seq, reason)
        self.num_finished_requests += len(finished)
        outputs = []
        for i, seq in enumerate(step.seqs):
            if seq.prefill_only and step.ended is not None:
                seq.chunk_times.append((step.started, step.ended, step.pieces[i][0]))
            if i in live:
                outputs.append(self._output(seq, sampled[i], logprobs[i], id(seq) in finished))
            if seq.status.is_finished and not seq.num_inflight_steps and seq.block_table:
                self.kv.free(seq)
                if not self.scheduler.has(seq.request_id):  # (else a new copy of it, added since its abort)
                    self._forget(seq.request_id)
        self._forget_launched(step)
        return self._take_failed() + outputs

    def _output(self, seq: Sequence, toks, lps, finished: bool) -> StepOutput:
        """The ``StepOutput`` of a live sequence's sampled token(s) (a list from a speculative
        step), with its prompt logprobs on the first token and its KV blocks where exported."""
        if not isinstance(toks, list):
            toks, lps = [toks], None if lps is None else [lps]
        out = StepOutput.of(seq, toks, None if lps is None else lps[:len(toks)])
        if seq.prompt_logprobs is not None:  # the first token: the prompt is all computed
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        if finished and seq.prefill_only:
            out.chunk_times = seq.chunk_times
        self.kv.export(seq, out, finished)
        return out
