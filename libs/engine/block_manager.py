"""KV block pool with prefix caching (vLLM v1's KVCacheManager / BlockPool, simplified).

Every block has a reference count and, once full and computed, the chained
prefix hash of its tokens (``deepinfer.kvstore.hashing``: the same hashes the
storage tier and kvindex use). ``cached`` maps hash -> block id. A block whose
last user finished keeps its hash and goes to the tail of the free queue, so
it can be hit again until it is evicted (LRU: allocation pops the head)::

    free queue:  head [never used | evicted first ... recently freed] tail
    sequence A:  [h0][h1][h2][partial]      ref counts 1 1 1 1
    sequence B:  [h0][h1][new ][partial]    hits h0,h1 -> ref counts 2 2

A sequence's blocks are freed tail first, so a prefix's earlier blocks (the
ones other prompts are most likely to share) are evicted last.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from deepinfer.engine.sequence import Sequence
from deepinfer.kvstore.hashing import extend_hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: str | None = None


class BlockManager:
    """Hands out block ids ``0 .. num_blocks-1``; ``block_size`` tokens per block.

    fingerprint: model fingerprint rooting the hash chain (``model_fingerprint``).
    enable_prefix_caching: reuse computed blocks across sequences by hash.
    """

    def __init__(self, num_blocks: int, block_size: int, fingerprint: str = "", enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[str, int] = {}
        # prefix-cache statistics, in tokens
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # admissions by ``Sequence.prefix_path``, and prefix tokens fed again by bounded replays
        self.prefix_paths: Counter[str] = Counter()
        self.num_replayed_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    # --- hashing -------------------------------------------------------------
    def hashes(self, seq: Sequence) -> list[str]:
        """The sequence's full-block hash chain, extended to its current tokens."""
        return extend_hashes(seq.block_hashes, seq.token_ids, self.block_size, self.fingerprint, seq.cache_salt,
                             seq.images)

    # --- prefix cache -----------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq`` (a new sequence without blocks).

        At least one token is always left to compute (its logits are needed),
        so a fully cached prompt hits all blocks but the last. A sequence that wants its prompt's
        logprobs (``Sequence.prompt_logprobs``) hits nothing: every position needs its logits.
        """
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return []
        hits = []
        for h in self.hashes(seq):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if hits and len(hits) * self.block_size >= len(seq):
            hits.pop()
        return hits

    def prefix_start(self, seq: Sequence, hits: list[int]) -> int:
        """First token a new sequence computes after taking ``hits`` (from ``find_cached_prefix``)."""
        return len(hits) * self.block_size

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        """Whether ``seq`` can hold ``num_tokens`` tokens of KV (after taking ``hits``)."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table) - len(hits)
        # hit blocks that sit in the free queue are taken out of it, not handed out
        reusable = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return need <= len(self.free_queue) - reusable

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        """Take the ``hits`` (cached prefix blocks) then grow the block table to ``num_tokens`` tokens.

        Hits advance ``seq.num_computed_tokens`` and ``seq.num_cached_tokens``.
        Raises MemoryError when not enough blocks are free (check ``can_allocate``).
        """
        if not self.can_allocate(seq, num_tokens, hits):
            raise MemoryError(f"not enough free KV blocks for {num_tokens} tokens")
        for block_id in hits:
            self._take_hit(block_id)
            seq.block_table.append(block_id)
        if hits:
            seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        for _ in range(-(-num_tokens // self.block_size) - len(seq.block_table)):
            seq.block_table.append(self._take_free())

    def record_query(self, seq: Sequence) -> None:
        """Count a newly admitted sequence's prompt and hit tokens for the hit rate, and the
        path its prefix took (``seq.prefix_path``: "hit" or "cold" unless a hybrid pool set it)."""
        if not seq.prefix_path:
            seq.prefix_path = "hit" if seq.num_cached_tokens else "cold"
        self.num_queried_tokens += seq.num_prompt_tokens
        self.num_hit_tokens += seq.num_cached_tokens
        self.prefix_paths[seq.prefix_path] += 1
        self.num_replayed_tokens += seq.num_replayed_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full, computed, exact blocks in the prefix cache (never
        those past ``seq.num_exact_tokens``: they hold approximate KV)."""
        if not self.enable_prefix_caching:
            return
        hashes = self.hashes(seq)
        exact = seq.num_computed_tokens if seq.num_exact_tokens is None else min(seq.num_computed_tokens,
                                                                               seq.num_exact_tokens)
        for i in range(min(exact // self.block_size, len(hashes))):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash = hashes[i]
                self.cached.setdefault(hashes[i], block.block_id)

    def _release(self, block_id: int) -> None:
        """Drop one reference; an unreferenced block joins the free queue (at the
        head when it has no hash, so nothing reusable is evicted before it)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)

    def _take_free(self) -> int:
        """Pop the LRU free block, evicting its hash from the prefix cache."""
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def take_free_blocks(self, n: int) -> list[int]:
        """Pop ``n`` LRU free blocks (evicting their hashes) for KV about to be written into them
        from outside a sequence (a prefix loaded from the storage tier); ``publish_cached`` then
        hands them to the prefix cache. Raises KeyError when fewer than ``n`` are free."""
        return [self._take_free() for _ in range(n)]

    def publish_cached(self, block_ids: list[int], hashes: list[str]) -> None:
        """Blocks from ``take_free_blocks``, now holding the KV of the prefix blocks ``hashes``:
        cached under those hashes, unreferenced, at the free queue's tail (the first evicted last
        among them is the earliest block)."""
        for block_id, block_hash in zip(block_ids, hashes):
            self.blocks[block_id].block_hash = block_hash
            self.cached[block_hash] = block_id
            self._release(block_id)

    def _take_hit(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def slide(self, seq: Sequence) -> None:
        """Release blocks no query can see any more (only sliding-window pools have such)."""

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks (tail first); its KV is gone (num_computed_tokens = 0)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.reset_kv_state()

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated)."""
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
