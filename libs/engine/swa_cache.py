"""The SWA state cache: recent prefixes' sliding-window KV in host memory.

A hybrid model's storage-tier blocks hold only the full-attention layers
(the window layers' KV matters only for the last W tokens of a prefix, so
persisting it for every block would multiply the tier's bytes for nothing).
Reusing a prefix of H tokens still needs the window layers' KV of its last W
tokens. This cache keeps exactly that for recently finished sequences, so a
prefix hit whose window state is here is an exact reuse; otherwise the engine
rebuilds the state by bounded replay (``hybrid_blocks``).

Entries are single window-layer blocks keyed by their chained prefix hash
(``kvstore.hashing``: block i's hash names tokens [0, (i+1)·block_size), so
equal hashes mean equal KV). A prefix of k blocks is restorable when every
block a query at position k·block_size can see is here, i.e. blocks
``first_needed_block(k·block_size) .. k-1``::

    window layers of a finished sequence (W = 2 blocks here):
    block        0    1    2    3    4    5
    window pool  -    -    -    [h3] [h4] [h5]     (-: released, outside the window)
    SWA cache              put  h3   h4   h5  ->   prefixes of 5 or 6 blocks restorable

Bounded by ``capacity_bytes`` of block payload, least recently used first
out (``get`` and ``put`` refresh an entry). Host memory on every device: on
a GPU this is the offload tier; on CPU it is a second copy that outlives the
window pool's eviction. Secondary sources: vLLM PR #56227, SGLang PR #31713.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class SWAStateCache:
    """LRU of window-layer KV blocks by prefix hash, bounded by bytes.

    A block: [num_window_layers, 2 (K, V), block_size, num_kv_heads, head_dim],
    the KV cache's dtype, on the CPU. ``capacity_bytes`` <= 0 keeps nothing.
    Counters: ``hits`` / ``misses`` (blocks asked by ``get``), ``evictions``.
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: str) -> bool:
        """Whether the block is cached (does not refresh it)."""
        return block_hash in self._blocks

    def has_all(self, hashes: list[str]) -> bool:
        return all(h in self._blocks for h in hashes)

    def put(self, block_hash: str, block: torch.Tensor) -> bool:
        """Keep ``block`` (not copied: the caller hands over a tensor it no longer writes)
        under ``block_hash``, evicting least recently used blocks to stay within
        ``capacity_bytes``. False (nothing kept) when one block exceeds the capacity."""
        size = block.numel() * block.element_size()
        if size > self.capacity_bytes:
            return False
        old = self._blocks.pop(block_hash, None)
        if old is not None:
            self.nbytes -= old.numel() * old.element_size()
        self._blocks[block_hash] = block
        self.nbytes += size
        while self.nbytes > self.capacity_bytes:
            _, evicted = self._blocks.popitem(last=False)
            self.nbytes -= evicted.numel() * evicted.element_size()
            self.evictions += 1
        return True

    def get(self, block_hash: str) -> torch.Tensor | None:
        """The cached block (refreshed to most recently used), or None."""
        block = self._blocks.get(block_hash)
        if block is None:
            self.misses += 1
            return None
        self._blocks.move_to_end(block_hash)
        self.hits += 1
        return block

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0
