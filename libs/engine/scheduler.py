"""Step scheduler: two queues (waiting, running) and a token budget per step.

A step is either a prefill step (sequences from ``waiting``, whole prompts,
up to ``max_num_batched_tokens`` new tokens and ``max_num_seqs`` sequences)
or a decode step (every running sequence feeds its last token). When a decode
step cannot get a block for every sequence, the most recently admitted
sequence is preempted: its blocks are freed and it goes back to the front of
``waiting`` to be recomputed. The scheduler moves integers (token counts and
block ids); it never touches tensors.
"""

from __future__ import annotations

from collections import deque

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: list[int]):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; it is running already if its KV was imported."""
        (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Pick the sequences of the next step and allocate their blocks."""
        bm = self.block_manager
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_new_tokens
            # A prompt longer than the budget still runs, alone (chunking: issue #3).
            if scheduled and n > budget:
                break
            if not bm.can_allocate(seq, len(seq)):
                break
            bm.allocate(seq, len(seq))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            scheduled.append(seq)
            budget -= n
        if scheduled:
            self.running.extend(scheduled)
            return scheduled
        while self.running:
            seq = self.running.popleft()
            while not bm.can_allocate(seq, len(seq)):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    seq = None
                    break
            if seq is not None:
                bm.allocate(seq, len(seq))
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Append each sampled token; return the sequences that finished (still holding blocks)."""
        finished = []
        for seq, tok in zip(seqs, token_ids):
            seq.num_computed_tokens = len(seq)
            seq.token_ids.append(tok)
            sp = seq.sampling
            if (tok in self.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.num_output_tokens >= sp.max_tokens or len(seq) >= self.max_model_len:
                seq.finish_reason = "length"
            elif seq.prefill_only:
                seq.finish_reason = "handoff"
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its blocks; None if unknown."""
        for q in (self.waiting, self.running):
            for seq in q:
                if seq.request_id == request_id:
                    q.remove(seq)
                    self.block_manager.free(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    return seq
        return None
