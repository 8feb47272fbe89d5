"""Image embeddings in the storage tier (vision-language models).

The vision service writes each image's embeddings [tokens_per_image, hidden] as one block file
``<root>/<embeddings fingerprint>/embeddings/<hash[:2]>/<hash>.kvb`` (the block file format:
header, XXH3 checksum), keyed by the image's content hash. Prefill reads them to compute a
prompt's image rows; a decode worker that resumes a request (the gateway's failover) reads them
too, to recompute what the storage tier's KV blocks do not cover.

NOTE: these files are outside the kvindex's retention and capacity accounting (it indexes KV
blocks only, and its replay skips this directory): nothing expires or evicts them; deleting them
is safe (a miss: the image is encoded again); see docs/architecture.md "Images".

Every function here blocks on file I/O: call it from an I/O thread.
"""

from __future__ import annotations

from pathlib import Path

from deepinfer.kvstore.format import EMBEDDINGS as EMBEDDINGS_CLASS  # their directory (not indexed)
from deepinfer.kvstore.store import BlockStore


class EmbeddingsReader:
    """Reads images' embeddings under one storage-tier root, for any embeddings fingerprint."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._stores: dict[str, BlockStore] = {}

    def store(self, fingerprint: str) -> BlockStore:
        if fingerprint not in self._stores:
            self._stores[fingerprint] = BlockStore(self.root, fingerprint)
        return self._stores[fingerprint]

    def read(self, fingerprint: str, images) -> list:
        """Each image's embeddings [length, hidden] (``images``: ``(offset, length, content hash)``).
        Raises RuntimeError when the fingerprint is empty, or an image's embeddings are missing,
        damaged (the block store's checks) or do not fit its placeholder run."""
        if not fingerprint:
            raise RuntimeError("a prompt with images came without its embeddings fingerprint")
        store, out = self.store(fingerprint), []
        for _, length, h in images:
            e = store.get(h, EMBEDDINGS_CLASS)
            if e is None:
                raise RuntimeError(f"image {h[:12]}: embeddings missing from the storage tier (or damaged)")
            if e.dim() != 2 or e.shape[0] != length:
                raise RuntimeError(f"image {h[:12]}: embeddings {list(e.shape)} for {length} placeholders")
            out.append(e)
        return out
