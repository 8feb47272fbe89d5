"""KV blocks for hybrid models: full-attention layers keep every block,
sliding-window layers keep only the window's (vLLM v1's hybrid KV cache
manager, simplified to two groups), and a cached prefix is reused exactly or
by bounded replay (docs/architecture.md, "SWA bounded replay").

The engine splits the KV cache into two pools when a model has both kinds of
layers (Gemma 3: 5 of every 6 layers see the last 512 tokens only):

* the **full** pool (``BlockManager``): one block per 16 tokens of context,
  ``seq.block_table``, prefix caching as usual;
* the **window** pool (``WindowBlockManager``): ``seq.window_block_table`` has
  one entry per logical block too, but a block whose tokens no query can see
  any more (all positions ``<= c - W`` once ``c`` tokens are computed) is
  released and its entry set to -1. A sequence holds at most
  ``ceil(W / block_size) + 1`` window blocks plus the current chunk's.

Window blocks are hashed like full ones (same chain) and a released block
keeps its hash in the LRU free queue. Reusing a cached prefix of ``k`` full
blocks (H = k·block_size tokens) needs the window layers' KV of its last W
tokens too. ``HybridBlockManager.find_cached_prefix`` plans how
(``PrefixPlan``, recorded as ``seq.prefix_path``), preferring in order:

1. ``hit``: the window pool still holds those blocks (vLLM's
   ``SlidingWindowManager.find_longest_cache_hit``): exact;
2. ``swa_cache``: the host-memory SWA state cache (``engine.swa_cache``) holds
   them: fresh window blocks are filled from it at launch; exact;
3. ``bounded_replay`` (mode ``bounded``, the default): feed tokens
   [H - W, H) again, the window layers attending only to keys at positions
   >= H - W while the full layers keep their cached KV (their new K/V for
   those positions is discarded), then the suffix. W token-forwards instead of
   H; a deliberate approximation (an exact rebuild would need more than W
   tokens, each window layer depending on earlier positions of the layers
   below). Taken only when it computes fewer prefix tokens than the longest
   prefix with an exact window state (1 or 2);
4. ``exact_recompute`` (mode ``exact``, or replay would not save anything):
   shorten the hit to the longest prefix with an exact window state (often
   none) and recompute the rest for every layer.

Mode: ``SamplingParams.swa_replay`` per request, else the engine's
``swa_replay``. NOTE: a preempted or resumed sequence (tokens generated
already) always recomputes exactly, so its continuation never depends on load
or failures. KV computed after a replay is approximate: it never enters the
prefix cache, the storage tier or the SWA state cache (``seq.num_exact_tokens``),
so caches only ever hold what a cold run computes.

Bounded replay of a 2-block prefix hit plus a suffix (W = 1 block)::

    logical block         0     1     2 (suffix)
    full pool             [h0]  [h1]  [new]       h0, h1: cached, kept as is
    window pool           -     [r1]  [new]       r1: replayed (keys >= H - W only)
    tokens fed                  |-----|-----|
                                H-W   H
Secondary sources: vLLM PR #56227 (encoder-side SWA bounded replay), SGLang
PR #31713 (SWA recompute).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.swa_cache import SWAStateCache

NULL_BLOCK = -1
SWA_MODES = ("bounded", "exact")


@dataclass
class PrefixPlan:
    """How a new sequence reuses its cached prefix: made by ``find_cached_prefix``,
    applied by ``allocate`` in the same scheduling pass.

    num_hit_blocks: full-pool hits taken (k). start: first token to compute
    (k·block_size, or the replay start). path: ``Sequence.prefix_path``.
    window_first: first logical window block the sequence holds. window_hits:
    window-pool block ids of blocks window_first..k-1. restore: prefix hashes of
    those blocks, to fill from the SWA state cache instead. replay: (start, end)
    of a bounded replay.
    """

    num_hit_blocks: int
    start: int
    path: str
    window_first: int = 0
    window_hits: list[int] = field(default_factory=list)
    restore: list[str] = field(default_factory=list)
    replay: tuple[int, int] | None = None


class WindowBlockManager(BlockManager):
    """Block pool of the sliding-window layers; ``window``: W tokens (the largest
    window of the group's layers)."""

    def __init__(self, num_blocks: int, block_size: int, window: int, fingerprint: str = "",
                 enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, fingerprint, enable_prefix_caching)
        self.window = window

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """First logical block a query at position ``num_computed_tokens`` (or later) can see."""
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def window_hits(self, seq: Sequence, num_hit_blocks: int) -> list[int] | None:
        """Cached window blocks covering the last W tokens of a ``num_hit_blocks``-block
        prefix, or None when one of them is gone."""
        hashes = self.hashes(seq)
        hits = []
        for i in range(self.first_needed_block(num_hit_blocks * self.block_size), num_hit_blocks):
            block_id = self.cached.get(hashes[i])
            if block_id is None:
                return None
            hits.append(block_id)
        return hits

    def _plan(self, seq: Sequence, num_tokens: int, plan: PrefixPlan | None) -> tuple[int, list[int], int]:
        """(first kept logical block, window-pool hits, fresh blocks needed) to hold ``num_tokens``."""
        total = -(-num_tokens // self.block_size)
        if plan is not None:  # a new sequence (empty table)
            return plan.window_first, plan.window_hits, max(0, total - plan.window_first - len(plan.window_hits))
        first = self.first_needed_block(seq.num_computed_tokens)
        return first, [], max(0, total - max(len(seq.window_block_table), first))

    def can_allocate(self, seq: Sequence, num_tokens: int, plan: PrefixPlan | None = None) -> bool:
        _, window_hits, need = self._plan(seq, num_tokens, plan)
        reusable = sum(1 for b in window_hits if self.blocks[b].ref_count == 0)
        return need <= len(self.free_queue) - reusable

    def allocate(self, seq: Sequence, num_tokens: int, plan: PrefixPlan | None = None) -> None:
        """Grow ``seq.window_block_table`` to ``num_tokens`` tokens; a new sequence's
        ``plan`` places its prefix (window-pool hits, blocks to restore from the SWA
        state cache: listed in ``seq.window_restore``). Raises MemoryError."""
        if not self.can_allocate(seq, num_tokens, plan):
            raise MemoryError(f"not enough free window KV blocks for {num_tokens} tokens")
        first, window_hits, _ = self._plan(seq, num_tokens, plan)
        table = seq.window_block_table
        if plan is not None:
            table.extend([NULL_BLOCK] * (first - len(table)))
            for block_id in window_hits:
                self._take_hit(block_id)
                table.append(block_id)
            for block_hash in plan.restore:
                block_id = self._take_free()
                table.append(block_id)
                seq.window_restore.append((block_id, block_hash))
        while len(table) < -(-num_tokens // self.block_size):
            table.append(NULL_BLOCK if len(table) < first else self._take_free())

    def slide(self, seq: Sequence) -> None:
        """Release the blocks before the window of the next query (position ``num_computed_tokens``)."""
        table = seq.window_block_table
        for i in range(min(self.first_needed_block(seq.num_computed_tokens), len(table))):
            if table[i] != NULL_BLOCK:
                self._release(table[i])
                table[i] = NULL_BLOCK

    def cache_computed_blocks(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching or seq.num_exact_tokens is not None:  # approximate: never shared
            return
        hashes = self.hashes(seq)
        table = seq.window_block_table
        for i in range(min(seq.num_computed_tokens // self.block_size, len(hashes), len(table))):
            if table[i] != NULL_BLOCK and self.blocks[table[i]].block_hash is None:
                self.blocks[table[i]].block_hash = hashes[i]
                self.cached.setdefault(hashes[i], table[i])

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.window_block_table):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        seq.window_block_table = []


class HybridBlockManager(BlockManager):
    """The full pool (this object: every ``BlockManager`` statistic and block id
    refers to it) plus ``window``, the sliding-window layers' pool. Every
    operation applies to both.

    swa_cache: the host SWA state cache consulted for exact window state (None: none).
    swa_replay: the default reuse mode when the window state is missing,
    "bounded" (replay the last W tokens) or "exact" (recompute).
    """

    def __init__(self, num_blocks: int, block_size: int, window: WindowBlockManager, fingerprint: str = "",
                 enable_prefix_caching: bool = True, swa_cache: SWAStateCache | None = None,
                 swa_replay: str = "bounded"):
        super().__init__(num_blocks, block_size, fingerprint, enable_prefix_caching)
        if swa_replay not in SWA_MODES:
            raise ValueError(f"swa_replay must be one of {SWA_MODES}, not {swa_replay!r}")
        self.window = window
        self.swa_cache = swa_cache
        self.swa_replay = swa_replay

    def replay_mode(self, seq: Sequence) -> str:
        """"bounded" or "exact" for this sequence (exact once it was preempted or has output)."""
        if seq.num_preemptions or seq.num_output_tokens:
            return "exact"
        return seq.sampling.swa_replay or self.swa_replay

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """The full-pool hits to take; the plan for the window layers goes to ``seq.prefix_plan``."""
        hits = super().find_cached_prefix(seq)
        seq.prefix_plan = plan = self.plan_prefix(seq, len(hits))
        return hits[: plan.num_hit_blocks]

    def plan_prefix(self, seq: Sequence, num_hit_blocks: int) -> PrefixPlan:
        """Plan the reuse of a ``num_hit_blocks``-block full-pool hit (see the module docstring)."""
        k, bs, w = num_hit_blocks, self.block_size, self.window
        if not k:
            return PrefixPlan(0, 0, "cold")
        hashes = self.hashes(seq)
        exact = None
        for j in range(k, 0, -1):  # the longest prefix whose window state is exact
            first = w.first_needed_block(j * bs)
            window_hits = w.window_hits(seq, j)
            if window_hits is not None:
                exact = PrefixPlan(j, j * bs, "hit", first, window_hits)
                break
            if self.swa_cache is not None and self.swa_cache.has_all(hashes[first:j]):
                exact = PrefixPlan(j, j * bs, "swa_cache", first, restore=hashes[first:j])
                break
        exact_tokens = exact.start if exact is not None else 0
        start = k * bs - w.window
        if exact_tokens < k * bs and start > exact_tokens and self.replay_mode(seq) == "bounded":
            return PrefixPlan(k, start, "bounded_replay", start // bs, replay=(start, k * bs))
        if exact is None:
            return PrefixPlan(0, 0, "exact_recompute")
        if exact.num_hit_blocks < k:
            exact.path = "exact_recompute"
        return exact

    def _plan_of(self, seq: Sequence, hits) -> PrefixPlan | None:
        plan = seq.prefix_plan
        if plan is None and hits:  # hits not from find_cached_prefix: plan them now
            plan = seq.prefix_plan = self.plan_prefix(seq, len(hits))
        if plan is not None and plan.num_hit_blocks != len(hits):
            raise ValueError(f"{len(hits)} hits given, {plan.num_hit_blocks} planned")
        return plan

    def prefix_start(self, seq: Sequence, hits: list[int]) -> int:
        plan = self._plan_of(seq, hits)
        return plan.start if plan is not None else 0

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        return (super().can_allocate(seq, num_tokens, hits)
                and self.window.can_allocate(seq, num_tokens, self._plan_of(seq, hits)))

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        if not self.can_allocate(seq, num_tokens, hits):
            raise MemoryError(f"not enough free KV blocks for {num_tokens} tokens")
        plan = self._plan_of(seq, hits)
        super().allocate(seq, num_tokens, hits)  # sets num_computed_tokens for hits first
        self.window.allocate(seq, num_tokens, plan)
        if plan is not None:
            seq.prefix_path = plan.path
            if plan.replay is not None:
                seq.replay_start, seq.replay_end = plan.replay
                seq.num_computed_tokens = seq.num_cached_tokens = plan.start
                seq.num_exact_tokens = plan.replay[1]
            seq.prefix_plan = None

    def slide(self, seq: Sequence) -> None:
        self.window.slide(seq)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        super().cache_computed_blocks(seq)
        self.window.cache_computed_blocks(seq)

    def free(self, seq: Sequence) -> None:
        self.window.free(seq)
        super().free(seq)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.window.reset_prefix_cache()
