"""Step scheduler: one budget per step shared by decode tokens and prefill chunks.

Two queues, ``waiting`` and ``running`` (vLLM v1's unified scheduler):

1. Running sequences first, in admission order. A decoding sequence feeds
   its one new token; a sequence still prefilling gets the next chunk.
   Sequences that came with imported KV into a full batch (handoffs) and
   waited for a slot join them first, while fewer than ``max_num_seqs`` run.
2. Then waiting sequences (new or preempted), while fewer than
   ``max_num_seqs`` run: the longest cached prefix is taken from the block
   manager (those tokens are not recomputed; on hybrid sliding-window models a
   bounded replay may feed the prefix's last W tokens again, see
   ``hybrid_blocks``) and the first chunk is cut. A waiting sequence whose next
   uncached prompt block is being computed by a running sequence (the same
   prefix, arrived moments apart) stays waiting until that block is computed,
   then hits it: a prefix shared by simultaneous requests is computed once
   (in-flight prefix sharing).

Budgets per step: ``max_num_batched_tokens`` new tokens (memory), and, for
prefill chunks, ``step_time_budget_s`` of predicted compute from the
``StepCostModel`` (``cost_model``): each chunk is the largest that still fits
the time left, so a chunk at a long context is shorter than one at context 0.
The time for new tokens is the budget less the fixed step cost, floored at
that fixed cost (``_chunk_time``); a step's first chunk feeds at least as many
tokens as take the fixed cost at its context, weights and context read
(``_floor_chunk``), so long contexts are not cut into chunks that spend most
of each step on fixed cost. A step whose only sequence is a prefill with
nothing else running or waiting gets ``lone_budget_factor`` (4) times the
budget: nobody's latency depends on it.
Decode tokens are always scheduled (decodes are never starved by prefills);
if the step has no prefill work yet, a chunk of at least ``min_chunk`` tokens
is taken so prefills always progress. While requests wait, a running prefill
takes at most half of what is left, so one long prompt cannot starve the
queue (a short prompt behind it still gets its first token soon).

When a sequence cannot get the blocks it needs, the most recently admitted
running sequence is preempted: its blocks are freed and it returns to the
front of ``waiting`` to be recomputed (its full blocks usually stay in the
prefix cache, so the recompute is mostly hits). The scheduler moves integers
(token counts and block ids); it never touches tensors.

Async scheduling (vLLM v1): ``advance`` moves the scheduled sequences forward
as soon as their step is launched, counting each token that step will sample
as in flight, so step t+1 can be scheduled while step t runs; ``update``
fills the sampled tokens in when step t is back. A sequence whose in-flight
token will certainly end it (max_tokens, max length, a prefill-only handoff)
is not scheduled again. While a step is in flight nothing is preempted
(``schedule(can_preempt=False)`` stops at the first sequence that cannot get
blocks and sets ``blocked``); the engine then waits for the step and
schedules again with preemption allowed.
"""

from __future__ import annotations

from collections import deque

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.sequence import RequestStatus, Sequence

LONE_BUDGET_FACTOR = 4  # a step with one sequence and nothing else to run: budget x this (``_chunk_time``)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: list[int], cost_model: StepCostModel | None = None,
                 step_time_budget_s: float | None = None, min_chunk: int = 16,
                 lone_budget_factor: float = LONE_BUDGET_FACTOR):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.cost_model = cost_model or StepCostModel()
        self.step_time_budget_s = step_time_budget_s
        self.min_chunk = min_chunk
        self.lone_budget_factor = lone_budget_factor
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_deferred = 0  # admissions put off to share a running prefill's blocks (counted per step)
        self.blocked = False  # the last schedule() stopped because it may not preempt

    def add(self, seq: Sequence) -> None:
        """Queue a sequence. One whose KV was imported (status RUNNING, its blocks held) runs at
        once while fewer than ``max_num_seqs`` do, else waits for a slot in ``waiting``, keeping
        its blocks (``schedule`` moves it to ``running`` when one frees, ahead of new prompts)."""
        imported = seq.status == RequestStatus.RUNNING
        (self.running if imported and len(self.running) < self.max_num_seqs else self.waiting).append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has(self, request_id: str) -> bool:
        """Whether a sequence of ``request_id`` is waiting or running."""
        return any(s.request_id == request_id for q in (self.waiting, self.running) for s in q)

    def take_all(self) -> list[Sequence]:
        """Every waiting and running sequence, removed from the queues (the engine failed a step)."""
        seqs = [*self.waiting, *self.running]
        self.waiting.clear()
        self.running.clear()
        return seqs

    # --- schedule ---------------------------------------------------------------
    def _chunk(self, seq: Sequence, tokens_left: int, time_left: float | None, has_prefill: bool,
               share: int) -> int:
        """New tokens to feed for ``seq`` this step (0 = none fit).

        NOTE: while requests wait (``share`` 2), a prefill already running takes at most half
        of the time (and tokens) left, so a long prompt cannot starve new ones.
        """
        n = min(seq.num_new_tokens, max(1, tokens_left // share))
        if seq.num_new_tokens == 1 or time_left is None:
            return n
        fit = self.cost_model.max_chunk(seq.num_computed_tokens, time_left / share)
        if not has_prefill:
            fit = max(fit, self._floor_chunk(seq.num_computed_tokens))
        return min(n, fit)

    def _floor_chunk(self, c: int) -> int:
        """The least a step's first prefill chunk feeds after ``c`` context tokens, whatever the
        budget: ``min_chunk``, and as many tokens as take the step's fixed cost at that context
        (``StepCostModel.efficient_chunk``), so a step spends at least half its time on tokens.

        NOTE: at long contexts the fixed cost (weights plus the context read, ``a + e c``) alone
        exceeds the budget. Measured (fp32, 2-core AMD EPYC, an 8,191-token prompt alone): ``a`` 0.11 s,
        ``e c`` 0.15 s at 8k; cutting chunks by the budget alone gave 441 steps of ~18 tokens and
        114 s, against 33 s in 17 steps without a budget."""
        return max(self.min_chunk, self.cost_model.efficient_chunk(c))

    def _chunk_time(self, lone: bool = False) -> float | None:
        """Seconds of predicted compute the step's new tokens may take (None = no limit).

        ``lone``: the step's only sequence, with nothing else running or waiting to run: no
        decode's inter-token latency and no queued prompt's TTFT depends on this step's length,
        so the budget is ``lone_budget_factor`` times larger (a request arriving meanwhile waits
        that much longer at most; fewer, longer chunks spend less time on per-step costs).

        The budget less the fixed step cost ``a``, but never less than ``a``:
        when ``a`` nearly fills the budget (a slow or shared CPU, or a fit
        under contention), ``budget - a`` would cut every chunk to
        ``min_chunk`` and spend most of each step on fixed cost. Measured on
        the real mesh (docs/benchmarks.md): ``a`` fitted at 0.198 s against a
        0.25 s budget gave 887 prefill steps of ~15 tokens for 13,464 prompt
        tokens. With the floor, a step spends at least half its time on tokens
        (steps then take up to ``2a``, over the budget, by design). The floor
        also keeps chunk sizes varied, so the online fit can tell ``a`` from
        ``b`` again (steps that all feed ``min_chunk`` tokens cannot).
        """
        budget = self.step_time_budget_s
        if budget is None:
            return None
        budget *= self.lone_budget_factor if lone else 1
        a = self.cost_model.a
        return max(budget - a, a)

    def _ends_after_inflight(self, seq: Sequence) -> bool:
        """Whether the token being sampled for ``seq`` certainly finishes it."""
        if not seq.num_inflight_tokens:
            return False
        num_output = len(seq) - seq.num_prompt_tokens
        return seq.prefill_only or num_output >= seq.sampling.max_tokens or len(seq) >= self.max_model_len

    def schedule(self, can_preempt: bool = True) -> list[Sequence]:
        """Pick the next step's sequences; sets ``seq.num_scheduled_tokens`` and allocates blocks."""
        self.blocked = False
        bm = self.block_manager
        tokens_left = self.max_num_batched_tokens
        has_prefill = False
        scheduled: list[Sequence] = []

        # handoffs that waited for a slot (their KV in place) join the running ones, ahead of new prompts
        if len(self.running) < self.max_num_seqs:
            for seq in [q for q in self.waiting if q.status == RequestStatus.RUNNING]:
                if len(self.running) >= self.max_num_seqs:
                    break
                self.waiting.remove(seq)
                self.running.append(seq)
        inflight = self._inflight_blocks()
        # requests waiting only for blocks a running prefill computes do not take its budget share
        competing = sum(not self._waits_for(seq, inflight) for seq in self.waiting)
        share = 2 if competing else 1
        time_left = self._chunk_time(lone=len(self.running) + competing == 1)
        pending = deque(self.running)
        self.running.clear()
        while pending and tokens_left > 0:
            seq = pending.popleft()
            n = 0 if self._ends_after_inflight(seq) else self._chunk(seq, tokens_left, time_left, has_prefill, share)
            if n == 0:
                self.running.append(seq)
                continue
            bm.slide(seq)  # sliding-window layers drop blocks no query can see any more
            if not can_preempt and not bm.can_allocate(seq, seq.num_computed_tokens + n):
                self.blocked = True
                pending.appendleft(seq)
                break
            while not bm.can_allocate(seq, seq.num_computed_tokens + n):
                victim = pending.pop() if pending else seq
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status != RequestStatus.RUNNING:
                continue
            bm.allocate(seq, seq.num_computed_tokens + n)
            self._take(seq, n, scheduled)
            tokens_left -= n
            has_prefill |= n > 1
            if time_left is not None:
                time_left -= self.cost_model.piece_cost(n, seq.num_computed_tokens)
        self.running.extend(pending)

        deferred: list[Sequence] = []  # waiting for in-flight blocks: they keep their place in the queue
        while self.waiting and tokens_left > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._waits_for(seq, inflight):
                deferred.append(self.waiting.popleft())
                self.num_deferred += 1
                continue
            hits = bm.find_cached_prefix(seq)
            cached = bm.prefix_start(seq, hits)  # hybrid models: a bounded replay starts before the hit's end
            n = min(len(seq) - cached, tokens_left)
            if len(seq) - cached > 1 and time_left is not None:
                fit = self.cost_model.max_chunk(cached, time_left)
                n = min(n, fit if has_prefill else max(fit, self._floor_chunk(cached)))
            if n <= 0 or not bm.can_allocate(seq, cached + n, hits):
                break
            self.waiting.popleft()
            bm.allocate(seq, cached + n, hits)
            bm.record_query(seq)
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            self._take(seq, n, scheduled)
            tokens_left -= n
            has_prefill |= n > 1
            if time_left is not None:
                time_left -= self.cost_model.piece_cost(n, cached)
            if bm.enable_prefix_caching:  # its prompt's blocks are in flight for those behind it now
                inflight.update(bm.hashes(seq)[cached // bm.block_size : seq.num_prompt_tokens // bm.block_size])
        self.waiting.extendleft(reversed(deferred))
        return scheduled

    def _inflight_blocks(self) -> set[str]:
        """Prefix hashes of the prompt blocks running sequences have yet to compute (this step's
        chunks included: their blocks are hits from the next step on)."""
        bm, out = self.block_manager, set()
        if not bm.enable_prefix_caching:
            return out
        for seq in self.running:
            start, end = seq.num_computed_tokens // bm.block_size, seq.num_prompt_tokens // bm.block_size
            if start < end:
                out.update(bm.hashes(seq)[start:end])
        return out

    def _waits_for(self, seq: Sequence, inflight: set[str]) -> bool:
        """In-flight prefix sharing: whether the first block of ``seq``'s prompt that is not in the
        prefix cache is one a running sequence is computing now. Admitting ``seq`` would compute
        it a second time; left waiting, ``seq`` hits it (and what follows) once it is computed.
        (The running sequence makes progress every step, so the wait ends; one that is
        preempted leaves ``running`` and stops holding others back.)"""
        if not inflight or seq.prompt_logprobs is not None:  # (it would not hit them: it computes its prompt)
            return False
        bm = self.block_manager
        for h in bm.hashes(seq)[: (len(seq) - 1) // bm.block_size]:
            if h not in bm.cached:
                return h in inflight
        return False

    def _take(self, seq: Sequence, n: int, scheduled: list[Sequence]) -> None:
        seq.num_scheduled_tokens = n
        scheduled.append(seq)
        if seq not in self.running:
            self.running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = RequestStatus.WAITING
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # --- update -------------------------------------------------------------------
    def advance(self, seqs: list[Sequence]) -> list[int]:
        """Launch bookkeeping: advance every scheduled sequence by its fed tokens.

        Returns the indices (in ``seqs``) of the sequences whose fed tokens reach
        their end: the step samples one token for each, counted as in flight.
        """
        sampling = []
        for i, seq in enumerate(seqs):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            seq.num_inflight_steps += 1
            if seq.num_computed_tokens >= len(seq):  # (beyond it: draft tokens, engine.spec_decode)
                seq.num_inflight_tokens += 1
                sampling.append(i)
            self.block_manager.cache_computed_blocks(seq)
        return sampling

    def update(self, seqs: list[Sequence], token_ids: dict[int, int | list[int]]) -> list[Sequence]:
        """A launched step is back: append the sampled token of each sequence
        ``advance`` said samples (``token_ids`` maps index in ``seqs`` -> token)
        and apply the stop rules. Sequences already finished (aborted, or
        stopped by an earlier step) are skipped. Returns the sequences that
        finished now (still holding blocks).

        Speculative steps: the entry is a list (accepted drafts, then one more
        token); KV of the rejected drafts is rolled back (``num_computed_tokens``)
        and tokens after one that finishes the sequence are dropped (the list in
        ``token_ids`` is cut to those appended)."""
        finished = []
        for i, seq in enumerate(seqs):
            seq.num_inflight_steps -= 1
            if i not in token_ids:  # a prefill chunk that did not reach the end of the prompt
                continue
            seq.num_inflight_tokens -= 1
            toks = token_ids[i] if isinstance(token_ids[i], list) else [token_ids[i]]
            if seq.draft_token_ids:  # positions after the last accepted draft hold rejected KV
                seq.num_computed_tokens -= len(seq.draft_token_ids) - (len(toks) - 1)
                seq.draft_token_ids = []
            if seq.status.is_finished:
                continue
            sp, ended = seq.sampling, None
            for n, tok in enumerate(toks, 1):
                seq.token_ids.append(tok)
                if (tok in self.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
                    ended = RequestStatus.FINISHED_STOPPED
                elif seq.num_output_tokens >= sp.max_tokens or len(seq.token_ids) >= self.max_model_len:
                    ended = RequestStatus.FINISHED_LENGTH_CAPPED
                elif seq.prefill_only:
                    ended = RequestStatus.FINISHED_HANDOFF
                if ended is not None:
                    if isinstance(token_ids[i], list):
                        del token_ids[i][n:]
                    break
            self.block_manager.cache_computed_blocks(seq)
            if ended is not None:
                seq.status = ended
                if seq in self.running:
                    self.running.remove(seq)
                finished.append(seq)
        return finished

    def postprocess(self, seqs: list[Sequence], token_ids: dict[int, int]) -> list[Sequence]:
        """``advance`` then ``update`` (a synchronous step)."""
        self.advance(seqs)
        return self.update(seqs, token_ids)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its blocks (once no launched
        step still writes them); None if unknown."""
        for q in (self.waiting, self.running):
            for seq in q:
                if seq.request_id == request_id:
                    q.remove(seq)
                    if not seq.num_inflight_steps:  # else freed when its step is back
                        self.block_manager.free(seq)
                    seq.status = RequestStatus.FINISHED_ABORTED
                    return seq
        return None
