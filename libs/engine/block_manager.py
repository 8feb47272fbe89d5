"""KV block allocation: a free list of fixed-size blocks and per-sequence block tables.

Prefix caching (hash-addressed reuse of blocks) arrives with issue #3; the
hash chain itself lives in ``deepinfer.kvstore.hashing`` so the storage tier
and the index use the same keys.
"""

from __future__ import annotations

from collections import deque

from deepinfer.engine.sequence import Sequence


class BlockManager:
    """Hands out block ids ``0 .. num_blocks-1``; ``block_size`` tokens per block."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold KV for its first ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens`` tokens.

        Raises MemoryError when not enough blocks are free (check ``can_allocate`` first).
        """
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise MemoryError(f"need {need} KV blocks, {len(self.free_blocks)} free")
        for _ in range(need):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks; its KV is gone (num_computed_tokens = 0)."""
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
