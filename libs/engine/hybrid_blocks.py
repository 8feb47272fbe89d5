"""KV blocks for hybrid models: full-attention layers keep every block,
sliding-window layers keep only the window's (vLLM v1's hybrid KV cache
manager, simplified to two groups).

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
keeps its hash in the LRU free queue, so a prefix-cache hit of ``k`` blocks is
usable only if the window pool still holds the blocks covering the last W
tokens of that prefix; ``HybridBlockManager.find_cached_prefix`` shortens the
hit until it is (vLLM's ``SlidingWindowManager.find_longest_cache_hit``).
"""

from __future__ import annotations

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.sequence import Sequence

NULL_BLOCK = -1


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

    def _plan(self, seq: Sequence, num_tokens: int, num_hit_blocks: int) -> tuple[int, list[int], int]:
        """(first kept logical block, window hits, fresh blocks needed) to hold ``num_tokens``."""
        computed = max(seq.num_computed_tokens, num_hit_blocks * self.block_size)
        first = self.first_needed_block(computed)
        hits = (self.window_hits(seq, num_hit_blocks) or []) if num_hit_blocks else []
        start = max(len(seq.window_block_table), first + len(hits))
        need = max(0, -(-num_tokens // self.block_size) - start)
        return first, hits, need

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        _, window_hits, need = self._plan(seq, num_tokens, len(hits))
        reusable = sum(1 for b in window_hits if self.blocks[b].ref_count == 0)
        return need <= len(self.free_queue) - reusable

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        """Grow ``seq.window_block_table`` to ``num_tokens`` tokens; ``hits`` are the
        full pool's prefix hits (only their count matters here). Raises MemoryError."""
        if not self.can_allocate(seq, num_tokens, hits):
            raise MemoryError(f"not enough free window KV blocks for {num_tokens} tokens")
        first, window_hits, _ = self._plan(seq, num_tokens, len(hits))
        table = seq.window_block_table
        if window_hits:
            table.extend([NULL_BLOCK] * (first - len(table)))
            for block_id in window_hits:
                self._take_hit(block_id)
                table.append(block_id)
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
        if not self.enable_prefix_caching:
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
    operation applies to both."""

    def __init__(self, num_blocks: int, block_size: int, window: WindowBlockManager, fingerprint: str = "",
                 enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, fingerprint, enable_prefix_caching)
        self.window = window

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        hits = super().find_cached_prefix(seq)
        while hits and self.window.window_hits(seq, len(hits)) is None:
            hits.pop()
        return hits

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        return super().can_allocate(seq, num_tokens, hits) and self.window.can_allocate(seq, num_tokens, hits)

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        if not self.can_allocate(seq, num_tokens, hits):
            raise MemoryError(f"not enough free KV blocks for {num_tokens} tokens")
        super().allocate(seq, num_tokens, hits)  # sets num_computed_tokens for hits first
        self.window.allocate(seq, num_tokens, hits)

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
